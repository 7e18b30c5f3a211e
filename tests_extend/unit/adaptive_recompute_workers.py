"""Bodies run in a fresh process (tests_extend.distributed.harness) for test_adaptive_recompute: a
tiny Megatron-Core GPT trains under each flag set, stepped as the trainer steps it (the session
publishes the step events the plan waits for); losses, bytes held for backward per step and the plan
come back."""
from __future__ import annotations

import torch

STEPS, LAYERS, PROFILED = 20, 4, 2


def train(flags, steps=STEPS, layers=LAYERS):
    """(losses as exact floats, bytes saved for backward per step, the plan's recomputed layers or None)."""
    import mindspeed
    from mindspeed.features.base import TRAIN_STEP_BEGIN, TRAIN_STEP_END
    from tests_extend import megatron_tiny
    from tests_extend.memory_meter import saved_for_backward
    mindspeed.unadapt()
    session = mindspeed.adapt(list(flags))
    megatron_tiny.init_parallel()
    model = megatron_tiny.build_gpt(layers=layers)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    losses, saved = [], []
    for step in range(steps):
        session.publish(TRAIN_STEP_BEGIN, iteration=step + 1)
        tokens, position_ids, labels = megatron_tiny.batch(step)
        with saved_for_backward() as meter:
            loss = model(tokens, position_ids, None, labels=labels).float().mean()
        saved.append(meter.nbytes(exclude=params))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        session.publish(TRAIN_STEP_END, iteration=step + 1)
    controller = session.context.part("adaptive_recompute")
    plan = controller.plan if controller is not None else None
    mindspeed.unadapt()
    return losses, saved, (None if plan is None else (sorted(plan.recompute), plan.held_bytes, plan.fits)), \
        (None if controller is None else controller.profiles)


BUDGET_MB = 1
CASES = {
    "off": [],
    "adaptive": ["--adaptive-recompute-device-size", str(BUDGET_MB), "--adaptive-recompute-profiling-step",
                 str(PROFILED)],
    "still_profiling": ["--adaptive-recompute-device-size", "0"],   # 3 of the default 10 profiled steps: no plan yet
}


def all_reports(rank, world_size):
    return {name: train(flags, steps=3 if name == "still_profiling" else STEPS) for name, flags in CASES.items()}
