"""The MindSpore trainer's optimizers (MindSpore's fused AdamWeightDecay kernel, its own SGD) against torch.optim.AdamW /
SGD with Megatron's groups, their state saved and loaded, a checkpoint of the other optimizer refused in
one line; and its learning-rate schedule against Megatron-Core's own OptimizerParamScheduler for
every --lr-decay-style (each WSD decay style included)."""
import numpy as np
import pytest

from mindspeed.training.mindspore.schedule import DECAY_STYLES, WSD_DECAY_STYLES, learning_rate

SHAPES = {"fc.weight": (6, 4), "fc.bias": (6,), "norm.weight": (4,)}


def _model():
    import mindspore as ms
    rng = np.random.RandomState(0)

    class Model:
        params = {n: ms.Parameter(ms.Tensor(rng.randn(*s).astype(np.float32)), name=n) for n, s in SHAPES.items()}
    return Model


def _matches_torch(make, torch_class, steps: int = 5, **torch_kwargs):
    """The trainer's optimizer (`make(model)`) against `torch_class` with Megatron's groups (decay 0.5
    on the matrix only), the lr changing every step; its state saved after step 2 and loaded into a
    fresh optimizer continues the same updates. Returns the state it saved."""
    import torch
    model = _model()
    rng = np.random.RandomState(1)
    ref = {n: torch.nn.Parameter(torch.tensor(p.asnumpy())) for n, p in model.params.items()}
    opt = make(model)
    torch_opt = torch_class([{"params": [ref["fc.weight"]], "weight_decay": 0.5},
                             {"params": [ref["fc.bias"], ref["norm.weight"]], "weight_decay": 0.0}],
                            lr=0.0, **torch_kwargs)
    for step in range(steps):
        if step == 2:
            saved = opt.state_arrays()
            opt = make(model)
            opt.load_state_arrays(saved, 2)
        lr = 0.05 * (step + 1)
        grads = {n: rng.randn(*s).astype(np.float32) for n, s in SHAPES.items()}
        opt.step(grads, lr)
        for n, p in ref.items():
            p.grad = torch.tensor(grads[n])
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        for n, p in ref.items():
            np.testing.assert_allclose(model.params[n].asnumpy(), p.detach().numpy(), rtol=0, atol=1e-6, err_msg=n)
    assert opt.step_count == steps
    return saved


def test_the_trainers_sgd_matches_torch_sgd_and_round_trips_its_momentum():
    """Momentum 0.9 and L2 decay (Megatron-Core's torch.optim.SGD); the momentum buffers round-trip."""
    pytest.importorskip("mindspore")
    import torch

    from mindspeed.training.mindspore.optimizer import SGD
    saved = _matches_torch(lambda m: SGD(m, momentum=0.9, weight_decay=0.5), torch.optim.SGD, momentum=0.9)
    assert sorted(saved) == sorted(f"momentum_buffer/{n}" for n in SHAPES)


def test_the_trainers_adam_matches_torch_adamw_and_round_trips_its_state():
    """MindSpore's fused AdamWeightDecay kernel with AdamW's bias correction folded in is torch.optim.AdamW
    (Megatron's Adam); its moments and step count round-trip. eps 1e-3: large enough that its correction shows."""
    pytest.importorskip("mindspore")
    import torch

    from mindspeed.training.mindspore.optimizer import Adam
    saved = _matches_torch(lambda m: Adam(m, beta1=0.9, beta2=0.95, eps=1e-3, weight_decay=0.5), torch.optim.AdamW,
                           steps=4, betas=(0.9, 0.95), eps=1e-3)
    assert sorted(saved) == sorted(f"{k}/{n}" for k in ("exp_avg", "exp_avg_sq") for n in SHAPES)


def test_an_optimizer_state_of_the_other_kind_is_refused_in_one_line():
    pytest.importorskip("mindspore")
    from mindspeed.training.mindspore.optimizer import SGD, Adam
    model = _model()
    adam_state = Adam(model, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1).state_arrays()
    with pytest.raises(ValueError, match=r"\(exp_avg, exp_avg_sq\) is not --optimizer sgd's \(momentum_buffer\): "
                                         r"add --no-load-optim"):
        SGD(model, momentum=0.9, weight_decay=0.1).load_state_arrays(adam_state, 3)
    sgd_state = SGD(model, momentum=0.9, weight_decay=0.1).state_arrays()
    with pytest.raises(ValueError, match=r"\(momentum_buffer\) is not --optimizer adam's"):
        Adam(model, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1).load_state_arrays(sgd_state, 3)


class _Groups:
    """What Megatron's scheduler writes into: an optimizer's param_groups."""
    param_groups = [{}]


@pytest.mark.parametrize("style, wsd_style", [(s, None) for s in DECAY_STYLES if s != "WSD"]
                         + [("WSD", w) for w in WSD_DECAY_STYLES])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedule_is_megatrons_optimizer_param_scheduler(style, wsd_style, warmup):
    """Megatron's scheduler counts samples (iterations x global batch 4); ours iterations. Past
    the decay too (min_lr), and a WSD decay that does not divide the decay evenly."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    gbs, decay, wsd_decay, total = 4, 30, 7, 36
    kwargs = dict(max_lr=3e-3, min_lr=2e-4, warmup_steps=warmup, decay_steps=decay, decay_style=style,
                  wsd_decay_steps=wsd_decay if wsd_style else None, wsd_decay_style=wsd_style, global_batch=gbs)
    megatron = OptimizerParamScheduler(
        _Groups(), init_lr=0.0, max_lr=3e-3, min_lr=2e-4, lr_warmup_steps=warmup * gbs,
        lr_decay_steps=decay * gbs, lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=total * gbs,
        wd_incr_style="constant", wsd_decay_steps=wsd_decay * gbs if wsd_style else None,
        lr_wsd_decay_style=wsd_style)
    ours, theirs = [], []
    for step in range(total):
        ours.append(learning_rate(step, **kwargs))
        theirs.append(megatron.get_lr(_Groups.param_groups[0]))
        megatron.step(gbs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)
    if style != "constant" or warmup:
        assert len(set(np.round(ours, 12))) > 3      # the schedule moved


def test_wsd_flags_default_to_a_tenth_of_the_decay_and_megatrons_exponential():
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(["--lr-decay-style", "WSD", "--train-iters", "50"], world_size=1)
    assert (args.lr_wsd_decay_iters, args.lr_wsd_decay_style) == (5, "exponential")
    args = parse_args(["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "9", "--lr-wsd-decay-style", "cosine"],
                      world_size=1)
    assert (args.lr_wsd_decay_iters, args.lr_wsd_decay_style) == (9, "cosine")
