"""--optimizer-selection fused_ema_adamw on Megatron-Core's optimizers (Float16OptimizerWithFloat16Params,
FP32Optimizer, DistributedOptimizer): the torch AdamW inside each keeps Megatron's update untouched (the losses are
--optimizer adam's bit for bit) and, in the same step call, updates each updated parameter's
'ema_params' state (fp32, beside exp_avg / exp_avg_sq) with one foreach lerp:

    ema_t = d_t * ema_(t-1) + (1 - d_t) * param_t,   d_t = min(decay, (1 + t) / (10 + t)),   ema_0 = param_0

t is the parameter's AdamW step count, which the checkpoint holds: a resumed run continues the warm-up.
As optimizer state the EMA reaches both checkpoint formats through Megatron's own state dicts
(state_dict; sharded_state_dict maps every state key onto the parameter's sharding); a torch_dist load
asks init_state_fn for the state to load into, so that gets 'ema_params' too.

Under the distributed optimizer the inner AdamW holds this rank's shards of the fp32 masters, so the EMA
is sharded as they are; Megatron's dp_reshardable format saves every state key of a shard (its
'ema_params' too). Evaluating with it puts the EMA shards into the masters, copies them into the model's
shards and all-gathers the parameters, as the optimizer's step does; then the same with the masters back.
"""
from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from mindspeed.features.memory.reuse_fp32_param_megatron import attach_after_init

KEY = "ema_params"
OPTIMIZERS = ("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params",
              "megatron.core.optimizer.optimizer.FP32Optimizer",
              "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer")


def decay_at(decay: float, step: int) -> float:
    """Upstream MindSpeed's warm-up: early updates follow the weights closely."""
    return min(decay, (1 + step) / (10 + step))


class EmaOfWeights:
    """The EMA state of one torch optimizer's parameters, kept by its step hooks."""

    def __init__(self, inner: torch.optim.Optimizer, decay: float):
        self.inner, self.decay = inner, decay
        self.updates = 0            # EMA updates run (a test hook: the hook is live)
        self.first = {}             # param -> its weights before its first update (ema_0)
        self.params = []            # the params of the step under way (one scan of the groups per step)
        inner.register_step_pre_hook(lambda opt, *_: self.keep_first(self.stepping()))
        inner.register_step_post_hook(lambda opt, *_: self.update(self.params))

    def stepping(self) -> list:
        """The params this step updates: AdamW's own choice, those with a gradient."""
        self.params = [p for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        return self.params

    def keep_first(self, params) -> None:
        # not into the state yet: AdamW creates its moments only for a param whose state is empty
        for p in params:
            if KEY not in self.inner.state.get(p, {}):
                self.first[p] = p.detach().clone(memory_format=torch.preserve_format)

    def update(self, params) -> None:
        for p, weights in self.first.items():
            self.inner.state[p][KEY] = weights
        self.first, self.params = {}, []
        by_step: dict[int, list] = {}
        for p in params:
            by_step.setdefault(int(self.inner.state[p]["step"]), []).append(p)
        for step, group in by_step.items():
            weight = 1.0 - decay_at(self.decay, step)
            torch._foreach_lerp_([self.inner.state[p][KEY] for p in group], [p.detach() for p in group], weight)
        self.updates += 1

    def init_state(self) -> None:
        """EMA slots beside the moments Megatron's init_state_fn makes (what a torch_dist load fills)."""
        for p in (p for g in self.inner.param_groups for p in g["params"]):
            self.inner.state[p].setdefault(KEY, p.detach().clone(memory_format=torch.preserve_format))


def attach(opt, decay: float) -> EmaOfWeights:
    ema = EmaOfWeights(opt.optimizer, decay)
    opt.mindspeed_ema = ema
    original_init = opt.init_state_fn

    def init_state_fn(inner, *a, **kw):
        original_init(inner, *a, **kw)
        ema.init_state()
    opt.init_state_fn = init_state_fn
    return ema


def install(patcher, decay: float) -> list:
    """Every Megatron optimizer made from now on keeps an EMA of its (master) weights; returns the
    list they are added to."""
    attached = []

    def attach_once(opt):
        if opt.optimizer is not None and not hasattr(opt, "mindspeed_ema"):
            attach(opt, decay)
            attached.append(opt)

    for cls in OPTIMIZERS:
        attach_after_init(patcher, cls, attach_once,
                          "--optimizer-selection fused_ema_adamw: an EMA of the weights in the optimizer step")
    return attached


def evaluate_with_ema(patcher, optimizers: list) -> None:
    """--use-ema under Megatron-LM's own loop: its evaluate() (periodic and final validation, which
    is given the model but not the optimizer) runs with the EMA weights of `optimizers`."""
    if "megatron.training.training" not in sys.modules:     # not under Megatron-LM's pretrain_gpt.py
        return

    def wrap(original):
        @functools.wraps(original)
        def evaluate(*a, **kw):
            with ema_weights(optimizers):
                return original(*a, **kw)
        return evaluate
    patcher.wrap("megatron.training.training.evaluate", wrap,
                 reason="--use-ema: Megatron-LM's validation with the EMA weights")


def model_and_master_pairs(opt):
    """(model parameter, the inner optimizer's parameter) of one Megatron optimizer: the fp32 master
    of a bf16/fp16 parameter, or the parameter itself."""
    if hasattr(opt, "float16_groups"):
        for model_group, master_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            yield from zip(model_group, master_group)
        for group in opt.fp32_from_fp32_groups:
            yield from ((p, p) for p in group)
    else:
        for group in opt.optimizer.param_groups:
            yield from ((p, p) for p in group["params"])


def _sharded(opt) -> bool:
    return hasattr(opt, "shard_fp32_from_float16_groups")


def _publish_masters(opt) -> None:
    """The distributed optimizer's masters into the model's shards, all-gathered (its step's tail)."""
    opt._copy_main_params_to_model_params()
    for chunk in opt.model_chunks:
        chunk.start_param_sync(force_sync=True)


def _swap_in(pairs, opt) -> list:
    """Each (target, master) whose master has an EMA: the target's weights kept, the EMA copied in."""
    saved = []
    for target, master in pairs:
        ema = opt.optimizer.state.get(master, {}).get(KEY)
        if ema is not None:
            saved.append((target, target.detach().clone()))
            target.copy_(ema)
    return saved


@contextmanager
def ema_weights(optimizers):
    """The model holds the EMA weights of `optimizers` (Megatron optimizers, chained or not) inside
    (evaluation), its own weights again after. A parameter without an EMA yet (no update so far)
    keeps its weights."""
    parts = [o for chained in optimizers for o in getattr(chained, "chained_optimizers", [chained])]
    saved, sharded = [], [o for o in parts if _sharded(o)]
    with torch.no_grad():
        for opt in parts:
            masters = ((p, p) for g in opt.optimizer.param_groups for p in g["params"])
            saved += _swap_in(masters if _sharded(opt) else model_and_master_pairs(opt), opt)
        for opt in sharded:
            _publish_masters(opt)
    try:
        yield
    finally:
        with torch.no_grad():
            for target, weights in saved:
                target.copy_(weights)
            for opt in sharded:
                _publish_masters(opt)
