"""--quant-states on Megatron-Core's optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params,
DistributedOptimizer): between updates Adam's moments are held in 8 bits (quantized_moments.py).

The update runs parameter by parameter: the parameter's moments come back to fp32 in the inner torch
optimizer's state, the inner optimizer steps on that parameter alone (its own Adam: torch's fused
kernel on the cpu), and the new moments go back to 8 bits; so at most one parameter's fp32 moments
exist at a time. As upstream, the embeddings' and the output layer's moments stay fp32.

Checkpoints hold the fp32 moments, the same as without the flag (a checkpoint crosses between runs
with and without it): saving or loading first brings every moment back to fp32 in the state, where it
stays until the parameter's next update. A moment in fp32 at an update is used as it is, so a
resumed run updates from exactly the moments the saving run would have: resume is bit for bit.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

from mindspeed.features.training import quantized_moments as qm

SITE = "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups"
KEEP_FP32 = ("embedding", "output_layer")     # upstream's keep_fp32 parameters (by name)
# (main params, model params) group lists each Megatron optimizer pairs; FP32Optimizer steps the model's own
MAIN_TO_MODEL = (("fp32_from_float16_groups", "float16_groups"),
                 ("shard_fp32_from_float16_groups", "model_float16_groups"),
                 ("shard_fp32_groups", "model_fp32_groups"))
STATE_METHODS = ("state_dict", "sharded_state_dict", "load_state_dict", "get_parameter_state_dp_zero",
                 "get_parameter_state_dp_reshardable", "load_parameter_state_from_dp_zero",
                 "load_parameter_state_from_dp_reshardable", "save_parameter_state", "load_parameter_state")


class QuantizedStates:
    """The 8-bit moments of one Megatron optimizer's inner torch optimizer."""

    def __init__(self, inner, fmt: str, keep_fp32: set):
        self.inner, self.fmt, self.keep_fp32 = inner, fmt, keep_fp32
        self.packed = {}            # param -> {moment: Quantized}, while its moments are in 8 bits

    def params(self) -> list:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def quantized(self, p) -> bool:
        return id(p) not in self.keep_fp32

    def unpack(self, p) -> None:
        state = self.inner.state[p]
        for moment, q in self.packed.pop(p, {}).items():
            state.setdefault(moment, qm.dequantize(self.fmt, q))     # a loaded fp32 moment wins

    def pack(self, p) -> None:
        state = self.inner.state.get(p, {})
        if self.quantized(p) and all(m in state for m in qm.MOMENT_DTYPES):
            self.packed[p] = {m: qm.quantize(self.fmt, m, state.pop(m)) for m in qm.MOMENT_DTYPES}

    def step(self, original_step, closure=None):
        for p in self.params():
            self.unpack(p)
            with _only(self.inner, p):
                original_step(closure)
            self.pack(p)

    def resident(self) -> None:
        for p in list(self.packed):
            self.unpack(p)

    def state_bytes(self) -> int:
        """Bytes the moments hold now: fp32 tensors in the state plus the 8-bit codes and scales."""
        dense = sum(t.numel() * t.element_size() for s in self.inner.state.values()
                    for k, t in s.items() if k in qm.MOMENT_DTYPES)
        return dense + sum(q.nbytes() for moments in self.packed.values() for q in moments.values())


@contextmanager
def _only(inner, param):
    saved = [g["params"] for g in inner.param_groups]
    try:
        for g in inner.param_groups:
            g["params"] = [p for p in g["params"] if p is param]
        yield
    finally:
        for g, params in zip(inner.param_groups, saved):
            g["params"] = params


def keep_fp32_ids(opt, model_chunks) -> set:
    """ids of the inner optimizer's params whose model parameter is an embedding or the output layer."""
    names = {id(p): name for chunk in model_chunks for name, p in chunk.named_parameters()}
    to_model = {}
    for main_attr, model_attr in MAIN_TO_MODEL:
        for mains, models in zip(getattr(opt, main_attr, []), getattr(opt, model_attr, [])):
            to_model.update({id(m): d for m, d in zip(mains, models)})
    keep = set()
    for g in opt.optimizer.param_groups:
        for p in g["params"]:
            name = names.get(id(to_model.get(id(p), p)), "")
            if any(word in name for word in KEEP_FP32):
                keep.add(id(p))
    return keep


def attach(opt, fmt: str, model_chunks) -> QuantizedStates:
    """Hold one Megatron optimizer's Adam moments in `fmt` between updates."""
    states = QuantizedStates(opt.optimizer, fmt, keep_fp32_ids(opt, model_chunks))
    opt.mindspeed_quant_states = states
    original_step = opt.optimizer.step
    opt.optimizer.step = functools.partial(states.step, original_step)

    def with_fp32_moments(method):
        @functools.wraps(method)
        def run(*a, **kw):
            states.resident()
            return method(*a, **kw)
        return run

    for name in STATE_METHODS:
        if hasattr(opt, name):
            setattr(opt, name, with_fp32_moments(getattr(opt, name)))
    return states


def install(patcher, args) -> None:
    """Every Megatron optimizer built from now on holds its Adam moments in --quant-states' format."""
    import megatron.core.optimizer  # noqa: F401  (the site's module)
    fmt = args.quant_states

    def wrap(original):
        @functools.wraps(original)
        def build(config, model_chunks, *a, **kw):
            opt = original(config, model_chunks, *a, **kw)
            if getattr(opt, "optimizer", None) is not None and config.optimizer == "adam":
                attach(opt, fmt, model_chunks)
            return opt
        return build

    patcher.wrap(SITE, wrap, reason=f"--quant-states {fmt}: Adam's moments held in 8 bits between updates")
