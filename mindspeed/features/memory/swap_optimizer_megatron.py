"""--swap-optimizer on Megatron-Core's optimizers: the fp32 master copy (Float16OptimizerWithFloat16Params,
DistributedOptimizer) and Adam's moments live on the host; the update brings them in, in
--swap-optimizer-times chunks: swap a chunk in, step the inner optimizer on that chunk only, copy
its masters to the model's parameters, swap it out. Tensors keep their identity (the optimizer's
state and Megatron's groups are keyed by them): the device storage is emptied and refilled in place
(memory.release_to_host / restore_from_host).

With FP32Optimizer (no --bf16/--fp16) the "master" is the model's parameter itself: only the moments
move. Saving or loading a checkpoint, or Megatron copying model params to main params, first brings
everything back (state_dict, sharded_state_dict, load_state_dict, _copy_model_params_to_main_params);
the next update sends it all out again, so checkpoints are the same with the swap on or off.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager


OPTIMIZERS = ("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params",
              "megatron.core.optimizer.optimizer.FP32Optimizer",
              "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer")
# (master groups, model groups) each class zips in _copy_main_params_to_model_params
COPY_GROUPS = {"Float16OptimizerWithFloat16Params": (("fp32_from_float16_groups", "float16_groups"),),
               "DistributedOptimizer": (("shard_fp32_from_float16_groups", "model_float16_groups"),
                                        ("shard_fp32_groups", "model_fp32_groups")),
               "FP32Optimizer": ()}
MASTERS = {"Float16OptimizerWithFloat16Params": "fp32_from_float16_groups",
           "DistributedOptimizer": "shard_fp32_from_float16_groups"}
RESIDENT_METHODS = ("state_dict", "sharded_state_dict", "load_state_dict", "_copy_model_params_to_main_params")


class OptimizerSwap:
    """The host side of one Megatron optimizer's states."""

    def __init__(self, opt, times: int, memory):
        self.opt, self.inner, self.times, self.memory = opt, opt.optimizer, times, memory
        self.kind = next(k for k in COPY_GROUPS if any(c.__name__ == k for c in type(opt).__mro__))
        masters = [p for g in getattr(opt, MASTERS.get(self.kind, ""), []) for p in g]
        for p in masters:   # a master must own its storage, or emptying it would free other data
            assert p.untyped_storage().nbytes() == memory.nbytes(p) and p.storage_offset() == 0
        self.masters = {id(p) for p in masters}
        self.host = {}              # id(tensor) -> its host copy, while it is swapped out
        self.copying = False        # inside step_with_ready_grads: each chunk copies main -> model
        self.copied = False
        self.chunks_run = 0         # chunks updated (a test hook: the chunking ran)
        self.device_peak = 0        # most managed bytes resident at once during an update
        for p in masters:
            memory.ledger.adjust("device", memory.nbytes(p))
        self.swap_out(self.params())

    # -- what moves ------------------------------------------------------------------------
    def params(self) -> list:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def tensors(self, params) -> list:
        """The managed tensors of these params: master (if swappable) and every moment."""
        out = []
        for p in params:
            if id(p) in self.masters:
                out.append(p)
            out += [v for v in self.inner.state.get(p, {}).values()
                    if hasattr(v, "shape") and tuple(v.shape) == tuple(p.shape) and v.numel() > 1]
        return out

    def swap_out(self, params) -> None:
        for t in self.tensors(params):
            if id(t) not in self.host:
                self.host[id(t)] = self.memory.release_to_host(t)

    def swap_in(self, params) -> None:
        for t in self.tensors(params):
            host = self.host.pop(id(t), None)
            if host is not None:
                self.memory.restore_from_host(t, host)

    def resident_bytes(self) -> int:
        """Managed bytes that hold device storage now (what a device-side counter sees)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors(self.params()))

    def new_moment_bytes(self, params) -> int:
        return sum(self.memory.nbytes(t) for t in self.tensors(params) if id(t) not in self.host
                   and id(t) not in self.masters)

    def chunks(self) -> list:
        """The params in order, cut into `times` runs of about equal element counts."""
        params = self.params()
        total = sum(p.numel() for p in params) or 1
        out, current, seen = [], [], 0
        for p in params:
            current.append(p)
            seen += p.numel()
            if seen * self.times >= total * (len(out) + 1):
                out.append(current)
                current = []
        return out + ([current] if current else [])

    # -- the update ------------------------------------------------------------------------
    def step(self, original_step, copy_main_to_model):
        for chunk in self.chunks():
            self.swap_in(chunk)
            self.device_peak = max(self.device_peak, self.resident_bytes() + self.new_bytes_upper(chunk))
            with _only(self.inner, chunk):
                original_step()
            if self.copying:
                with _copy_groups_only(self.opt, self.kind, chunk):
                    copy_main_to_model()
            self.memory.ledger.adjust("device", self.new_moment_bytes(chunk))   # moments born here
            self.swap_out(chunk)
            self.chunks_run += 1
        self.copied = self.copying

    def new_bytes_upper(self, chunk) -> int:
        """Moments a first update creates (two per param, fp32)."""
        return sum(2 * self.memory.nbytes(p) for p in chunk if not self.inner.state.get(p))


@contextmanager
def _only(inner, chunk):
    keep = {id(p) for p in chunk}
    saved = [g["params"] for g in inner.param_groups]
    try:
        for g in inner.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        yield
    finally:
        for g, params in zip(inner.param_groups, saved):
            g["params"] = params


@contextmanager
def _copy_groups_only(opt, kind, chunk):
    keep = {id(p) for p in chunk}
    saved = {}
    try:
        for main_attr, model_attr in COPY_GROUPS[kind]:
            mains, models = getattr(opt, main_attr), getattr(opt, model_attr)
            saved[main_attr], saved[model_attr] = mains, models
            pairs = [[(m, d) for m, d in zip(mg, dg) if id(m) in keep] for mg, dg in zip(mains, models)]
            setattr(opt, main_attr, [[m for m, _ in g] for g in pairs])
            setattr(opt, model_attr, [[d for _, d in g] for g in pairs])
        yield
    finally:
        for attr, value in saved.items():
            setattr(opt, attr, value)


def attach(opt, times: int, memory) -> OptimizerSwap:
    """Give one Megatron optimizer instance host-resident states, moved by `memory` (the run's backend.memory)."""
    swap = OptimizerSwap(opt, times, memory)
    opt.mindspeed_swap = swap
    original_step = opt.optimizer.step
    original_copy = getattr(opt, "_copy_main_params_to_model_params", lambda: None)   # FP32Optimizer: none

    def inner_step(closure=None):
        swap.step(original_step, original_copy)

    def copy_main_to_model():
        if swap.copied:              # done chunk by chunk inside the update
            swap.copied = False
            return
        with resident():
            original_copy()

    @contextmanager
    def resident():
        swap.swap_in(swap.params())
        yield                        # stays in until the next update sends it out

    def make_resident(method):
        @functools.wraps(method)
        def run(*a, **kw):
            with resident():
                return method(*a, **kw)
        return run

    opt.optimizer.step = inner_step
    opt._copy_main_params_to_model_params = copy_main_to_model
    for name in RESIDENT_METHODS:
        if hasattr(opt, name):
            setattr(opt, name, make_resident(getattr(opt, name)))
    original_ready = opt.step_with_ready_grads

    @functools.wraps(original_ready)
    def step_with_ready_grads():
        swap.copying = True
        try:
            return original_ready()
        finally:
            swap.copying = False
            swap.copied = False
    opt.step_with_ready_grads = step_with_ready_grads
    return swap


def install(patcher, args, memory) -> None:
    """Every Megatron optimizer made from now on swaps its states through `memory` (the run's backend.memory)."""
    times = args.swap_optimizer_times

    def wrap_init(original):
        @functools.wraps(original)
        def init(self, *a, **kw):
            original(self, *a, **kw)
            if not hasattr(self, "mindspeed_swap"):
                attach(self, times, memory)
        return init

    for cls in OPTIMIZERS:
        patcher.wrap(cls + ".__init__", wrap_init,
                     reason="--swap-optimizer: optimizer states on the host, swapped in by chunks for the update")
