"""Bodies run in a fresh process (tests_extend.distributed.harness) for test_memory_recompute:
a tiny Megatron-Core GPT trains a few steps under each flag set; losses and saved bytes come back."""
from __future__ import annotations

import torch

FUSED = ["--use-fused-swiglu", "--use-fused-rmsnorm"]
CASES = {
    "off": [],
    "act": ["--recompute-activation-function"],
    "act1": ["--recompute-activation-function", "--recompute-activation-function-num-layers", "1"],
    "norm": ["--recompute-norm"],
    "fused_off": FUSED,
    "fused_norm": FUSED + ["--recompute-norm"],
    "fused_norm1": FUSED + ["--recompute-norm", "--recompute-norm-num-layers", "1"],
    "fused_both": FUSED + ["--recompute-activation-function", "--recompute-norm"],
}
STEPS, LAYERS = 3, 2


def train(flags, steps=STEPS, layers=LAYERS):
    """Losses (exact floats) of `steps` SGD steps and the bytes saved for backward in the last one."""
    import mindspeed
    from tests_extend import megatron_tiny
    from tests_extend.memory_meter import saved_for_backward
    mindspeed.unadapt()
    mindspeed.adapt(list(flags))
    megatron_tiny.init_parallel()
    model = megatron_tiny.build_gpt(layers=layers)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    losses, saved = [], 0
    for step in range(steps):
        tokens, position_ids, labels = megatron_tiny.batch(step)
        with saved_for_backward() as meter:
            loss = model(tokens, position_ids, None, labels=labels).float().mean()
        saved = meter.nbytes(exclude=params)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    mindspeed.unadapt()
    return losses, saved


def all_reports(rank, world_size):
    import time
    out = {}
    for name, flags in CASES.items():
        start = time.perf_counter()
        out[name] = train(flags) + (time.perf_counter() - start,)
    return out
