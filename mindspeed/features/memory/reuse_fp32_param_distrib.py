"""--reuse-fp32-param on Megatron-Core's DistributedOptimizer (--bf16 --use-distributed-optimizer):
each rank's fp32 master shard lives inside DDP's bf16 parameter buffer, so the separate fp32 shard
is gone; a bf16 residual of the shard's size keeps the low 16 bits. Per bf16 parameter and rank:
2 + 4/DP bytes become 2 + 2/DP (DP=2: 4 -> 3).

Per bucket (bf16, N elements, DP shards of n; rank r owns shard r) at DP >= 2, two layouts:

* bf16 layout (forward, backward, checkpoints): the bucket holds every rank's bf16 parameters, as
  Megatron keeps it; `residual` (n bf16, separate) holds the low halves of this rank's masters.
* fp32 layout (the inner optimizer's step): the 2n slots of the own shard and one neighbour's
  (shards r-1 and r; shards 0 and 1 on rank 0) hold the fp32 masters, (low, high) pairs
  interleaved (little-endian), which Megatron's shard_fp32_from_float16 tensors view.

The update runs step (-> fp32 layout) then Megatron's copy of masters to the model
(-> bf16 layout: own shard rewritten); the neighbour's half then holds fp32 bits, and the param
all-gather that follows every update rewrites it from its owner. Rounding is the Float16 path's
(reuse_fp32_param_megatron): +0x8000, high half = master rounded to nearest (ties away from zero),
low half lossless.

With --overlap-param-gather Megatron defers that all-gather to the next forward: each module's
pre-hook waits for its bucket's gather (dispatching it, and the next bucket's, asynchronously), so
the overlap with the forward is Megatron's own. Until then the neighbour's half is not weights, and
whatever reads whole weights between the update and the next forward gathers first, exactly the
gather the forward would run: a save (mindspeed/checkpoint/torch_dist.py here; Megatron-LM's
save_checkpoint_and_time and its evaluation and weight-hash check already do, force_param_sync /
disable_forward_pre_hook), Megatron-LM's --log-params-norm (calc_params_l2_norm, wrapped below), and
the built-in trainer's evaluation runs forward through the pre-hooks. The next update waits for any
gather still in flight on its buckets before turning them into fp32 pairs.

At data-parallel size 1 (and, for MoE experts' optimizer, expert-data-parallel size 1) a rank's
shard is the whole buffer: there is no neighbour to borrow. Each bf16 buffer's storage then grows to
twice its size in place (untyped_storage().resize_: every view of it, the parameters', the buckets',
Megatron's shard views, follows), and the buffer becomes the Float16 path's `Folded` buffer
(reuse_fp32_param_megatron): [bf16 params | residual] between updates, the fp32 masters interleaved
over the whole storage for the update, switched in place a block at a time. Per bf16 parameter:
2 + 4 bytes become 2 + 2, the formula above at DP=1. The all-gather after the update copies the
buffer onto itself, as without the flag.

Outside the update, readers of the masters (checkpoints: _get/_set_main_param_and_optimizer_states;
a model-only load: _copy_model_params_to_main_params; the dummy step before a load) get or set
exact fp32 values through the bf16 layout, never disturbing the neighbour's parameters.
"""
from __future__ import annotations

import functools
import sys
from contextlib import ExitStack, contextmanager

import torch

from mindspeed.features.memory.reuse_fp32_param_megatron import (ATTACHED, Folded, Halves, attach_after_init,
                                                                  expand_before_step, fp32_meanwhile, join, split)

OPTIMIZER = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
MEGATRON_LM_PARAMS_NORM = "megatron.training.utils.calc_params_l2_norm"     # --log-params-norm
CHUNK = 1 << 20          # elements interleaved per copy: bounds the temporary to 4 MiB


class BucketShard(Halves):
    """This rank's master shard inside one bf16 bucket (DP >= 2): high halves in the own shard,
    low halves in `residual`; for the update, the fp32 masters over the own and a neighbour's shard."""

    def __init__(self, data: torch.Tensor, dp: int, rank: int, chunk: int = CHUNK):
        n = data.numel() // dp
        if dp < 2 or n % 2 or data.storage_offset() % 2:
            raise RuntimeError(f"--reuse-fp32-param: a bucket of {data.numel()} elements over {dp} "
                               "data-parallel ranks leaves no aligned neighbour shard for the fp32 masters")
        self.n, self.chunk = n, chunk
        self.own = self.high = data[rank * n:(rank + 1) * n]
        start = (rank - 1) * n if rank > 0 else 0
        self.region = data[start:start + 2 * n]
        self.own_second = rank > 0      # rank 0 borrows shard 1 after its own, others shard r-1 before
        self.residual = torch.empty(n, dtype=torch.bfloat16, device=data.device)
        self.fp32 = self.region.view(torch.float32)       # valid in the fp32 layout only

    def _ranges(self, forward: bool):
        starts = range(0, self.n, self.chunk)
        return [(s, min(s + self.chunk, self.n)) for s in (starts if forward else reversed(starts))]

    @torch.no_grad()
    def to_fp32(self) -> None:
        # in place: every chunk reads own values no earlier chunk has overwritten (direction below)
        for s, e in self._ranges(forward=self.own_second):
            self.region[2 * s:2 * e].view(torch.int32).copy_(join(self.residual[s:e], self.own[s:e]))

    @torch.no_grad()
    def to_bf16(self) -> None:
        for s, e in self._ranges(forward=not self.own_second):
            halves = split(self.region[2 * s:2 * e].view(torch.float32))
            self.residual[s:e].copy_(halves[:, 0])
            self.own[s:e].copy_(halves[:, 1])

    def saved(self) -> list:
        """What an update can change: the own and borrowed slots, the residual."""
        return [self.region, self.residual]


class WholeBuffer(Folded):
    """One DDP bf16 buffer at data-parallel size 1, its storage grown to [bf16 params | residual]."""

    def __init__(self, buffer, chunk: int | None = None):
        data = buffer.param_data
        m, storage = data.numel(), data.untyped_storage()
        if data.dim() != 1 or data.storage_offset() != 0 or storage.nbytes() != 2 * m:
            raise RuntimeError("--reuse-fp32-param: this DDP bf16 buffer's parameters do not own their storage "
                               "(NCCL user buffers or MXFP8's shared buffer): no room to fold the masters in")
        storage.resize_(4 * m)          # in place: every view of the parameters follows the new memory
        super().__init__(torch.empty(0, dtype=torch.bfloat16, device=data.device).set_(storage, 0, (2 * m,)), chunk)
        self.clear_residual()           # padding too: deterministic bits; the masters are written next

    def bucket(self, bucket) -> "BucketView":
        return BucketView(self, bucket)

    def saved(self) -> list:
        return [self.buffer]


class BucketView(Halves):
    """One bucket of a WholeBuffer: its masters, read and written in the bucket's own numbering."""

    def __init__(self, whole: WholeBuffer, bucket):
        off, self.n = bucket.offset, bucket.param_data.numel()
        self.own = self.high = whole.high[off:off + self.n]
        assert self.own.data_ptr() == bucket.param_data.data_ptr()
        self.residual = whole.residual[off:off + self.n]
        self.fp32 = whole.fp32[off:off + self.n]           # valid in the fp32 layout only


class SharedShards:
    """Every bf16 bucket of one DistributedOptimizer, and where each master lives in them."""

    def __init__(self, opt):
        self.opt = opt
        group = opt.data_parallel_group
        dp, rank = group.size(), group.rank()
        self.units = []                 # what switches layout: BucketShards (DP >= 2), WholeBuffers (DP 1)
        self.buckets = {}               # (gbuf index, bucket id) -> BucketShard or BucketView
        for g, buffer in enumerate(opt.buffers):
            if buffer.param_dtype != torch.bfloat16:
                continue
            if dp == 1:
                whole = WholeBuffer(buffer)
                self.units.append(whole)
                for b, bucket in enumerate(buffer.buckets):
                    self.buckets[(g, b)] = whole.bucket(bucket)
                continue
            for b, bucket in enumerate(buffer.buckets):
                self.buckets[(g, b)] = BucketShard(bucket.param_data, dp, rank)
                self.units.append(self.buckets[(g, b)])
        self.where = {}                 # id(master) -> (BucketShard/View, start, end) in the own shard
        for models, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for model, main in zip(models, mains):
                g, _, b = opt.model_param_gbuf_map[model]
                if (g, b) not in self.buckets:
                    continue
                shard = self.buckets[(g, b)]
                world = opt._get_model_param_range_map(model)["gbuf_world_in_bucket"]
                s, e = world.start - rank * shard.n, world.end - rank * shard.n
                assert 0 <= s <= e <= shard.n and e - s == main.numel()
                shard.write(s, e, main)                       # residuals from the masters as they are
                self.where[id(main)] = (shard, s, e)
                main.data = shard.fp32[s:e]
        self.fp32 = False
        # DDP's bucket groups whose param all-gather writes these buckets (one may be in flight with
        # --overlap-param-gather)
        mine = {id(opt.buffers[g].buckets[b]) for g, b in self.buckets}
        self.gathers = [group for chunk in getattr(opt, "model_chunks", ())
                        for group in list(getattr(chunk, "bucket_groups", ())) +
                        list(getattr(chunk, "expert_parallel_bucket_groups", ()))
                        if any(id(bucket) in mine for bucket in group.buckets)]

    def to_fp32(self) -> None:
        if not self.fp32:
            for group in self.gathers:          # never rewrite a region an all-gather is still writing
                handle = getattr(group, "param_gather_handle", None)
                if handle is not None:
                    handle.wait()
            for unit in self.units:
                unit.to_fp32()
            self.fp32 = True

    def to_bf16(self) -> None:
        if self.fp32:
            for unit in self.units:
                unit.to_bf16()
            self.fp32 = False

    def read(self, main) -> torch.Tensor:
        """An fp32 copy of a master, whatever the layout."""
        if id(main) not in self.where or self.fp32:
            return main.detach().clone()
        shard, s, e = self.where[id(main)]
        return shard.read(s, e).view(main.shape)

    def write(self, main, values) -> None:
        if id(main) not in self.where:
            main.data.copy_(values)
        elif self.fp32:
            main.data.copy_(values)
        else:
            shard, s, e = self.where[id(main)]
            shard.write(s, e, values)

    @contextmanager
    def masters_readable(self):
        """The masters (`param.main_param`, which Megatron-LM's params norm reads) hold their fp32 values
        inside. At DP 1 the buffers are folded in place and split back (bit for bit) after; at DP >= 2
        folding would overwrite the borrowed halves, other ranks' weights (an all-gather to repair), so
        the masters view exact copies meanwhile (4/DP bytes per bf16 parameter, for the call only)."""
        if any(isinstance(unit, WholeBuffer) for unit in self.units):
            with fp32_meanwhile(self):
                yield
            return
        views = {}
        for mains in self.opt.shard_fp32_from_float16_groups:
            for main in mains:
                if id(main) in self.where and not self.fp32:
                    views[id(main)] = (main, main.data)
                    main.data = self.read(main)
        try:
            yield
        finally:
            for main, view in views.values():
                main.data = view

    @contextmanager
    def kept(self):
        """Run something that may step the masters, then put the buckets' own and borrowed slots
        and the residuals (at DP 1: the whole folded storage) back as they were (the dummy step
        before a checkpoint load)."""
        saved = [(t, t.clone()) for unit in self.units for t in unit.saved()]
        fp32 = self.fp32
        try:
            yield
        finally:
            for t, copy in saved:
                t.copy_(copy)
            self.fp32 = fp32

    def bytes(self) -> int:
        """Residual storage this rank adds (the masters themselves take none; at DP 1 the residuals
        are the half each buffer's storage grew by)."""
        return sum(sh.residual.numel() * sh.residual.element_size() for sh in self.buckets.values())


def attach(opt) -> SharedShards:
    _refuse_other_master_holders(opt)
    shared = SharedShards(opt)
    expand_before_step(opt, shared)
    opt._copy_main_params_to_model_params = _copy_main_to_model(opt, shared)
    opt._copy_model_params_to_main_params = _copy_model_to_main(opt, shared)
    opt._get_main_param_and_optimizer_states = _get_states(opt, shared)
    opt._set_main_param_and_optimizer_states = _set_states(opt, shared)
    original_dummy = getattr(opt, "_init_optimizer_states_with_dummy_values", None)   # 0.16; not in 0.12
    if original_dummy is not None:
        opt._init_optimizer_states_with_dummy_values = _kept_across(shared, original_dummy)
    return shared


def _refuse_other_master_holders(opt) -> None:
    config = opt.config          # the names differ across Megatron-Core versions (0.12: no _no_fp8 suffix)
    precision_aware = getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                              getattr(config, "use_precision_aware_optimizer", False))
    fsdp = any(getattr(opt.ddp_config, name, False) for name in ("use_megatron_fsdp", "use_custom_fsdp"))
    if precision_aware or fsdp:
        raise RuntimeError("--reuse-fp32-param: the masters are held by the precision-aware optimizer "
                           "or Megatron FSDP here, not by DistributedOptimizer")


@contextmanager
def _float16_groups_hidden(opt):
    """Megatron's own copy runs for the fp32 parameters only (they have no master of their own here)."""
    saved = opt.shard_fp32_from_float16_groups, opt.model_float16_groups
    opt.shard_fp32_from_float16_groups, opt.model_float16_groups = [], []
    try:
        yield
    finally:
        opt.shard_fp32_from_float16_groups, opt.model_float16_groups = saved


def _copy_main_to_model(opt, shared: SharedShards):
    original = opt._copy_main_params_to_model_params

    def copy_main_to_model():
        shared.to_bf16()                 # own shard rewritten; the all-gather that follows does the rest
        with _float16_groups_hidden(opt):
            original()
    return copy_main_to_model


def _copy_model_to_main(opt, shared: SharedShards):
    original = opt._copy_model_params_to_main_params

    def copy_model_to_main(state_dict=None):
        """Masters := the model's bf16 parameters (or a state dict's values), exactly."""
        source = opt._build_model_param_to_state_dict_param_map(state_dict) if state_dict is not None else {}
        for models, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for model, main in zip(models, mains):
                r = opt._get_model_param_range_map(model)["param"]
                shared.write(main, source.get(model, model).detach().view(-1)[r.start:r.end])
        with _float16_groups_hidden(opt):
            original() if state_dict is None else original(state_dict)
    return copy_model_to_main


def _get_states(opt, shared: SharedShards):
    original = opt._get_main_param_and_optimizer_states

    def get_states(model_param):
        tensors = dict(original(model_param))
        tensors["param"] = shared.read(tensors["param"])
        return tensors
    return get_states


def _set_states(opt, shared: SharedShards):
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        main = opt.optimizer.param_groups[group]["params"][order]
        original(model_param, {**tensors, "param": main.detach().clone()})  # the moments
        shared.write(main, tensors["param"])
    return set_states


def _kept_across(shared: SharedShards, original):
    def init_dummy_states():
        with shared.kept():
            original()
    return init_dummy_states


def finish_param_gathers(model_chunks) -> None:
    """Run the param all-gather --overlap-param-gather deferred to the next forward (waiting for one
    in flight): the chunks' weights whole again, and nothing left for that forward's pre-hooks."""
    for chunk in model_chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def _params_norm_of_gathered_weights(original):
    """Megatron-LM's --log-params-norm reads every bf16 weight right after the update, before the
    deferred all-gather (unlike its save, evaluation and weight-hash check, it does not gather first);
    with --bf16 it reads each bf16 parameter's master (`param.main_param`), which between updates is
    a view of the folded storage, not fp32 values: the call runs with the masters readable."""
    @functools.wraps(original)
    def calc_params_l2_norm(model, *a, **kw):
        finish_param_gathers(model if isinstance(model, (list, tuple)) else [model])
        with ExitStack() as stack:
            for shared in list(ATTACHED):
                stack.enter_context(shared.masters_readable())
            return original(model, *a, **kw)
    return calc_params_l2_norm


def install(patcher) -> None:
    attach_after_init(patcher, OPTIMIZER, attach,
                      "--reuse-fp32-param: fp32 master shards stored in DDP's bf16 parameter buffer")
    if "megatron.training.training" in sys.modules:     # under Megatron-LM's pretrain_gpt.py
        patcher.wrap(MEGATRON_LM_PARAMS_NORM, _params_norm_of_gathered_weights, aliases="megatron",
                     reason="--reuse-fp32-param: --log-params-norm after the deferred param all-gather")
