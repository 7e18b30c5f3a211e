"""--recompute-activation-function / --recompute-norm in the MindSpore trainer's GPT: the same
losses bit for bit over a few SGD steps, and fewer bytes held for backward (counted with
mindspore.saved_tensors_hooks), the first-N-layers limit honoured."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

STEPS = 3
CASES = {
    "off": (),
    "act": ("recompute-activation-function",),
    "norm": ("recompute-norm",),
    "norm1": ("recompute-norm",),           # with --recompute-norm-num-layers 1
    "both": ("recompute-activation-function", "recompute-norm"),
}


def _train(features, num_layers_flags=()):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig, GPTModel, init_full_weights
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from tests_extend.memory_meter import ms_saved_for_backward
    backend = MindSporeBackend("cpu")
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", "16", "--normalization", "RMSNorm", "--swiglu",
                       "--position-embedding-type", "rope", "--disable-bias-linear", *num_layers_flags])
    cfg = GPTConfig.from_args(args, 128, features)
    model = GPTModel(cfg, backend, build_parallel_state(backend.comm, 1))
    model.load_full(init_full_weights(cfg, 3))
    params = model.parameters()
    losses, saved, freed = [], 0, 0
    for step in range(STEPS):
        rng = np.random.RandomState(step)
        tokens = ms.Tensor(rng.randint(0, 128, (2, 16)).astype(np.int32))
        labels = ms.Tensor(np.roll(tokens.asnumpy(), -1, 1))
        mask = ms.Tensor(np.ones((2, 16), np.float32))
        with ms_saved_for_backward() as meter:
            def loss_fn():
                loss = model.loss(tokens, labels, mask)
                meter.snapshot(exclude=params)
                return loss
            loss, grads = ms.value_and_grad(loss_fn, None, params)()
        saved, freed = meter.nbytes(), meter.freed()
        for p, g in zip(params, grads):
            p.set_data(p - 0.5 * g)
        losses.append(float(loss.asnumpy()))
    return losses, saved, freed


@pytest.fixture(scope="module")
def runs():
    out = {name: _train(features) for name, features in CASES.items() if name != "norm1"}
    out["norm1"] = _train(CASES["norm1"], ("--recompute-norm-num-layers", "1"))
    return out


def test_losses_are_bitwise_identical(runs):
    off = runs["off"][0]
    assert off[-1] != off[0]
    for name in ("act", "norm", "norm1", "both"):
        assert runs[name][0] == off, name


def test_saved_bytes_drop(runs):
    saved = {name: r[1] for name, r in runs.items()}
    assert saved["act"] < saved["off"] and saved["both"] < saved["act"], saved
    assert saved["norm"] < saved["norm1"] < saved["off"], saved
    # the outputs themselves are freed (not only fn's insides unsaved): one per activation, two
    # norms per layer, in the layers asked for
    freed = {name: r[2] for name, r in runs.items()}
    assert freed == {"off": 0, "act": 2, "norm": 4, "norm1": 2, "both": 6}, freed
