"""Megatron-Core's torch Adam, its fallback without Transformer Engine or Apex, where Megatron assumes
what TE's and Apex's FusedAdam do.

`lr=None`: Megatron builds its Adam with the config's `lr`, None in a default OptimizerConfig: the learning rate
comes later, from Megatron's OptimizerParamScheduler, which sets every group's `lr` before a step.
TE's and Apex's FusedAdam store the None; torch's Adam and AdamW refuse it at construction
(`'<=' not supported between 'float' and 'NoneType'`), so every Megatron optimizer built from a
default config failed where TE and Apex are absent. The stand-in builds torch's optimizer with a
valid placeholder and leaves None where TE's would: the defaults and each group without its own
`lr`. A step before the scheduler set a rate fails as TE's would; a rate torch refuses otherwise
(negative) is still refused.

A state dict before the first step: without Apex or TE, Megatron's DistributedOptimizer.state_dict()
reads the Adam step from every parameter's torch state, which torch's Adam creates lazily at its
first step, and asserts there is one step (`assert len(steps) == 1`: none before a step). Loading a
checkpoint into a fresh optimizer (`sharded_state_dict(is_loading=True)`) starts there. The stand-in
creates the state torch's first step would create first (step 0, zero moments), so the step read
is 0, as it is; the first real step then finds that state and goes on from it unchanged.
"""
from __future__ import annotations

import functools

import torch

ADAM_INIT = "torch.optim.Adam.__init__"     # AdamW's __init__ calls it
DISTRIBUTED_STATE_DICT = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict"


def _wrap_adam_init(original):
    @functools.wraps(original)
    def __init__(self, params, lr=1e-3, *args, **kwargs):
        if lr is not None:
            return original(self, params, lr, *args, **kwargs)
        params = list(params)
        own_rate = [isinstance(group, dict) and "lr" in group for group in params]
        original(self, params, 0.0, *args, **kwargs)
        self.defaults["lr"] = None
        for group, own in zip(self.param_groups, own_rate):
            if not own:
                group["lr"] = None
    return __init__


def create_initial_adam_state(optimizer) -> None:
    """The per-parameter state torch's Adam creates at its first step (step 0, zero moments), for
    the parameters that have none yet."""
    if not isinstance(optimizer, torch.optim.Adam):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if "step" in state:
                continue
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
            for name in names:
                state.setdefault(name, torch.zeros_like(param, memory_format=torch.preserve_format))


def _wrap_state_dict(original):
    @functools.wraps(original)
    def state_dict(self):
        create_initial_adam_state(self.optimizer)
        return original(self)
    return state_dict


def apply_torch_adam_fallback(patcher) -> int:
    """torch's Adam takes lr=None and a fresh distributed optimizer has a state dict, where Megatron
    falls back to torch's Adam; the count of patches applied (0 with TE's or Apex's)."""
    import megatron.core.optimizer as megatron_optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    applied = 0
    if getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        patcher.wrap(ADAM_INIT, _wrap_adam_init,
                     reason="Megatron's torch Adam (no TE / Apex) with lr=None: the scheduler sets it, as with TE's")
        applied += 1
    if not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        patcher.wrap(DISTRIBUTED_STATE_DICT, _wrap_state_dict,
                     reason="Megatron's torch Adam (no TE / Apex): a state dict before the first step reads step 0")
        applied += 1
    return applied
