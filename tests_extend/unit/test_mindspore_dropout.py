"""Dropout and packed documents in the MindSpore trainer (one process, real MindSpore and Megatron).

Dropout's random masks cannot match torch's, so instead: the masks' statistics and RNG rules
(Megatron's tensor_parallel/random.py: hidden masks the same on every TP rank without sequence
parallelism, attention-probability masks per TP rank), where each mask applies (every site against
the same model with that layer's weight scaled), the attention kernel's drop mask against numpy, no
effect with all-ones masks or in evaluation, recompute dropping the same values, and training with
dropout 0.1 still lowering the loss. Packed documents: the batches' loss mask, positions and
attention mask are the ones Megatron-Core's _get_ltor_masks_and_position_ids builds."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspeed.training.mindspore.dropout import DropoutMasks, keep_mask  # noqa: E402
from mindspeed.training.mindspore.eod import EodRules  # noqa: E402
from mindspeed.training.mindspore.parallel import ParallelState  # noqa: E402
from tests_extend.distributed import mindspore_parity as mp  # noqa: E402

DROP = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")


@pytest.fixture(scope="module")
def backend():
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return MindSporeBackend("cpu")


def _args(*flags):
    from mindspeed.flags.trainer_flags import parse_args
    return parse_args(mp.trainer_argv(1) + list(flags))


def _trainer(backend, *flags):
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    args = _args(*flags)
    return Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, mp.VOCAB))


def _micro(step):
    tokens, labels, mask = mp.batch(step)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


def _ps(tp_rank, sp=False):
    return ParallelState(tp_size=2, dp_size=1, tp_rank=tp_rank, dp_rank=0, tp_group=None, dp_group=None,
                         sequence_parallel=sp)


# -- packed documents -------------------------------------------------------------------------------
def test_eod_rules_build_megatrons_masks_and_positions():
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 9, (5, 24)).astype(np.int32)
    tokens[0, [0, 5, 6, 23]] = 0           # EOD first, twice in a row, last
    tokens[1, 11] = 0
    tokens[3, rng.choice(24, 6, replace=False)] = 0     # row 2: no EOD at all
    loss_mask = rng.randint(0, 2, tokens.shape).astype(np.float32)
    for flags in [(True, False, False), (False, True, False), (False, False, True), (True, True, True)]:
        got = EodRules(0, *flags).apply({"tokens": tokens, "labels": tokens, "loss_mask": loss_mask})
        rows = [_get_ltor_masks_and_position_ids(torch.from_numpy(r), 0, flags[1], flags[2], flags[0], True)
                for r in tokens]
        np.testing.assert_array_equal(got["loss_mask"], loss_mask * np.stack([r[1].numpy() for r in rows]))
        if flags[1]:
            np.testing.assert_array_equal(got["position_ids"], np.stack([r[2].numpy() for r in rows]))
        if flags[2]:
            np.testing.assert_array_equal(got["attention_mask"], np.stack([r[0].numpy() for r in rows]))
        assert ("position_ids" in got) == flags[1] and ("attention_mask" in got) == flags[2]


# -- dropout masks ----------------------------------------------------------------------------------
def test_keep_masks_drop_p_and_scale_the_rest():
    mask = keep_mask(np.random.default_rng(1), (1000, 1000), 0.1)
    dropped = float((mask == 0).mean())
    assert abs(dropped - 0.1) < 0.002                   # 1e6 draws: the std of the fraction is 3e-4
    assert set(np.unique(mask)) == {np.float32(0), np.float32(1) / np.float32(0.9)}


def test_masks_follow_megatrons_tensor_parallel_rng_rules():
    from mindspeed.training.mindspore.model import GPTConfig
    cfg = GPTConfig.from_args(_args(*DROP), mp.VOCAB)
    draw = lambda ps, it=3, micro=1: DropoutMasks(cfg, ps, 1234, cfg.num_layers).draw(it, micro, mp.MBS)
    r0, r1 = draw(_ps(0)), draw(_ps(1))
    assert r0["hidden_keep"].shape == (1 + 2 * mp.LAYERS, mp.SEQ, mp.MBS, mp.HIDDEN)
    assert r0["probs_keep"].shape == (mp.LAYERS, mp.MBS, mp.HEADS // 2, mp.SEQ, mp.SEQ)
    # replicated hidden stream: the same positions dropped on every TP rank
    np.testing.assert_array_equal(r0["hidden_keep"], r1["hidden_keep"])
    # the attention probabilities of each rank's own heads: a stream per TP rank
    assert (r0["probs_keep"] != r1["probs_keep"]).mean() > 0.05
    # sequence parallel: each rank drops its slice of the sequence, together the whole mask
    sp0, sp1 = draw(_ps(0, True)), draw(_ps(1, True))
    np.testing.assert_array_equal(np.concatenate([sp0["hidden_keep"], sp1["hidden_keep"]], 1), r0["hidden_keep"])
    # a new draw per micro-batch and per step, the same for the same ones
    assert (draw(_ps(0), micro=2)["hidden_keep"] != r0["hidden_keep"]).any()
    assert (draw(_ps(0), it=4)["hidden_keep"] != r0["hidden_keep"]).any()
    np.testing.assert_array_equal(draw(_ps(0))["probs_keep"], r0["probs_keep"])


def test_attention_kernel_applies_the_drop_mask_like_numpy():
    from mindspeed.backends.mindspore.kernels import reference
    rng = np.random.RandomState(2)
    s, b, n, d = 6, 2, 2, 4
    q, k, v = (rng.randn(s, b, n * d).astype(np.float32) for _ in range(3))
    drop = keep_mask(np.random.default_rng(3), (b, n, s, s), 0.3)
    out = reference.attention(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), layout="SBH", head_num=n, causal=True,
                              drop_mask=ms.Tensor(drop))[0].asnumpy()
    bnsd = lambda t: t.reshape(s, b, n, d).transpose(1, 2, 0, 3)
    scores = bnsd(q) @ bnsd(k).transpose(0, 1, 3, 2) / np.sqrt(d) + np.triu(np.full((s, s), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = ((probs * drop) @ bnsd(v)).transpose(2, 0, 1, 3).reshape(s, b, n * d)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_each_hidden_site_is_where_megatron_drops(backend):
    """Scaling site k's mask by 2 equals doubling the weight that produces that site's input: the
    word embedding (site 0), each layer's attention output projection (1 + 2j) and fc2 (2 + 2j).
    All-ones masks (hidden and attention) leave the logits exactly as without dropout."""
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.model import Extras, init_full_weights
    model = _trainer(backend, *DROP).model
    cfg = model.cfg
    weights = init_full_weights(cfg, 7)
    model.load_full(weights)
    tokens = ms.Tensor(mp.batch(0)[0])
    sites = 1 + 2 * cfg.num_layers
    plain = model.logits(tokens).asnumpy()
    ones = Extras(hidden_keep=ms.Tensor(np.ones((sites, mp.SEQ, mp.MBS, mp.HIDDEN), np.float32)),
                  probs_keep=ms.Tensor(np.ones((cfg.num_layers, mp.MBS, mp.HEADS, mp.SEQ, mp.SEQ), np.float32)))
    np.testing.assert_array_equal(model.logits(tokens, None, ones).asnumpy(), plain)
    weight_of = ["embedding.word_embeddings.weight"] + [
        nf.layer_name(j, part) for j in range(cfg.num_layers)
        for part in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")]
    for site, name in enumerate(weight_of):
        keep = np.ones((sites, mp.SEQ, mp.MBS, mp.HIDDEN), np.float32)
        keep[site] = 2.0
        model.load_full(weights)
        dropped = model.logits(tokens, None, Extras(hidden_keep=ms.Tensor(keep))).asnumpy()
        model.load_full({**weights, name: weights[name] * 2})
        np.testing.assert_allclose(dropped, model.logits(tokens).asnumpy(), rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.abs(dropped - plain).max() > 1e-3, name


# -- the trainer -----------------------------------------------------------------------------------
def test_p0_draws_nothing_and_evaluation_does_not_drop(backend):
    off = _trainer(backend, "--hidden-dropout", "0", "--attention-dropout", "0")
    assert off._train_names == () and off.dropout.draw(1, 0, mp.MBS) == {}
    on = _trainer(backend, *DROP)
    assert on._train_names == ("hidden_keep", "probs_keep") and on._eval_names == ()
    batch = [_micro(mp.EVAL_SEED)]
    assert on.evaluate(batch) == off.evaluate(batch)      # same initial weights, no dropout in evaluation
    loss_on, loss_off = on.train_step([_micro(0)], 1)[0], off.train_step([_micro(0)], 1)[0]
    assert abs(loss_on - loss_off) > 1e-3                  # while training it drops


def test_training_with_dropout_lowers_the_loss(backend):
    trainer = _trainer(backend, *DROP)
    assert trainer.graph_mode               # the masks are inputs of the traced graph
    losses = np.array([trainer.train_step([_micro(step)], step + 1)[0] for step in range(mp.STEPS)])
    assert np.isfinite(losses).all() and losses[-4:].mean() < losses[:4].mean() - 0.05


@pytest.mark.parametrize("recompute", [("--recompute-granularity", "full", "--recompute-method", "uniform"),
                                       ("--recompute-granularity", "selective")], ids=["full", "selective"])
def test_recompute_drops_the_same_values(backend, recompute):
    """The recomputed forward (backward's rerun) gets the same masks: the gradients are those of
    the run without recompute."""
    plain, again = _trainer(backend, *DROP), _trainer(backend, *DROP, *recompute)
    assert not again.graph_mode
    for step in range(2):
        (l0, n0, _), (l1, n1, _) = plain.train_step([_micro(step)], step + 1), again.train_step([_micro(step)], step + 1)
        assert abs(l0 - l1) < 1e-6 and abs(n0 - n1) < 1e-6 * n0
