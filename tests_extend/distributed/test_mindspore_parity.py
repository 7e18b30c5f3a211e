"""Parity of the two trainers: the same GPT, the same initial weights and the same batches give the same
losses (fp32, within 1e-4 per step over 20 steps) on Megatron-Core's GPTModel (torch, CPU) and on
the MindSpore trainer; at TP=1 in one process and at TP=2 on 2 processes (gloo vs msrun), plus
TP=2 with sequence parallelism and CP=2 with Ulysses and ring attention (first steps); TP runs trace
the forward into a MindSpore graph, CP runs PyNative. TP=2 with --use-ascend-coc (PyNative), with
and without SP, gives the plain TP=2 losses within 1e-6. Issue 15: GELU + LayerNorm + learned
positions at TP=2 with SP give their TP=1 losses; selective recompute at CP=2 gives CP=2's; CP=2
with --attention-mask-type general takes packed documents' mask and gives CP=1's losses with it. Weights cross both ways: torch writes the initial checkpoint that
MindSpore loads; MindSpore writes its trained checkpoint that torch loads (at TP=2) and evaluates.
--qk-layernorm (Qwen3's per-head q/k norms, --kv-channels of its own) at TP=2, with and without SP,
gives Megatron-Core's TP=2 losses, and its MindSpore checkpoint Megatron-Core's evaluation loss.
YaRN RoPE scaling (--rope-scaling-type yarn) at TP=1: the rotary tables are Megatron-Core's
YarnRotaryEmbedding's (two settings), the losses Megatron-Core's (a dense GPT with position type yarn)."""
import os

import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_model as pm  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

TOL = 1e-4
NORM_RTOL = 1e-4
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_parity_worker.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {"init": str(root / "init"), "ms_final": str(root / "ms_final"), "root": root,
            "qk_init": str(root / "qk_init"), "ms_qk": str(root / "msrun" / "ms_qk"), "ms_yarn": str(root / "ms_yarn")}


@pytest.fixture(scope="module")
def torch_tp1(ckpts):
    (result,) = run_distributed(mp.torch_train, world_size=1, args=(1, ckpts["init"], True), timeout=300)
    return result


@pytest.fixture(scope="module")
def ms_tp1(ckpts, torch_tp1):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return mp.ms_train(MindSporeBackend("cpu"), 1, False, ckpts["init"], save_dir=ckpts["ms_final"])


def test_tp1_losses_match(torch_tp1, ms_tp1):
    t, m = np.array(torch_tp1["losses"]), np.array(ms_tp1["losses"])
    assert len(t) == len(m) == mp.STEPS
    np.testing.assert_allclose(m, t, atol=TOL, rtol=0)
    # the gradient's scale too (clipping and Adam would hide a uniformly scaled gradient from the losses)
    np.testing.assert_allclose(ms_tp1["grad_norms"], torch_tp1["grad_norms"], rtol=NORM_RTOL)
    assert m[-4:].mean() < m[:4].mean() - 0.05      # it trains: four repeated batches get easier
    assert ms_tp1["graph_mode"]      # one rank, no memory features: the traced graph is what matched


@pytest.fixture(scope="module")
def ms_tp2(ckpts, torch_tp1):
    """One msrun launch for every 2-process MindSpore run (mindspore_parity_worker.py)."""
    out_dir = ckpts["root"] / "msrun"
    out_dir.mkdir()
    pm.write_qk_init(ckpts["qk_init"])
    return run_msrun(WORKER, [str(out_dir), ckpts["init"], ckpts["qk_init"]], str(out_dir), workers=2, timeout=480)


@pytest.fixture(scope="module")
def torch_tp2(ckpts, ms_tp1, ms_tp2):
    """One 2-process launch for Megatron-Core at TP=2: the default model (then MindSpore's TP=1
    checkpoint evaluated), and the q/k-norm model (then MindSpore's TP=2 q/k-norm checkpoint)."""
    return run_distributed(pm.torch_tp2_with_qk, world_size=2, timeout=300,
                           args=(ckpts["init"], ckpts["ms_final"], ckpts["qk_init"], ckpts["ms_qk"]))


def test_tp2_losses_match_and_checkpoint_crosses_backends(torch_tp1, ms_tp1, ms_tp2, torch_tp2):
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        plain = torch_tp2[rank]["plain"]
        t = np.array(plain["losses"])
        np.testing.assert_allclose(ms_tp2[rank]["tp2"]["losses"], t, atol=TOL, rtol=0)
        np.testing.assert_allclose(ms_tp2[rank]["tp2"]["grad_norms"], plain["grad_norms"], rtol=NORM_RTOL)
        for run in ("tp2_sp", "cp2_ulysses_cp_algo", "cp2_megatron_cp_algo", "cp2_kvallgather_cp_algo"):
            short = ms_tp2[rank][run]["losses"]
            np.testing.assert_allclose(short, t[:len(short)], atol=TOL, rtol=0, err_msg=run)
            np.testing.assert_allclose(ms_tp2[rank][run]["grad_norms"], plain["grad_norms"][:len(short)],
                                       rtol=NORM_RTOL, err_msg=run)
        # what matched at TP=2 (with and without SP) is the traced graph, its collectives'
        # gradients included; context parallelism runs PyNative (its attention is made of Cells)
        assert ms_tp2[rank]["tp2"]["graph_mode"] and ms_tp2[rank]["tp2_sp"]["graph_mode"]
        assert not ms_tp2[rank]["cp2_ulysses_cp_algo"]["graph_mode"]
        np.testing.assert_allclose(t, torch_tp1["losses"], atol=TOL, rtol=0)
        # the MindSpore TP=1 checkpoint, loaded by Megatron-Core at TP=2, gives MindSpore's eval loss
        assert plain["eval_loss_of_other"] == pytest.approx(ms_tp1["eval_loss"], abs=TOL)


def test_qk_layernorm_at_tp2_matches_megatron_and_its_checkpoint_crosses(ckpts, ms_tp2, torch_tp2):
    """--qk-layernorm with --kv-channels of its own (Qwen3's attention) at TP=2, with and without SP:
    Megatron-Core's losses and gradient norms (its finalize_model_grads sums the per-head norms'
    gradients over TP, as the MindSpore trainer does); MindSpore's TP=2 checkpoint holds the trained
    norms under Megatron-Core's names and gives MindSpore's evaluation loss in Megatron-Core."""
    from mindspeed.checkpoint import neutral as nf
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        t = torch_tp2[rank]["qk"]
        for run in ("tp2_qk", "tp2_sp_qk"):
            m = ms_tp2[rank][run]
            np.testing.assert_allclose(m["losses"], t["losses"], atol=TOL, rtol=0, err_msg=run)
            np.testing.assert_allclose(m["grad_norms"], t["grad_norms"], rtol=NORM_RTOL, err_msg=run)
            assert not m["graph_mode"], run      # PyNative (ms_qk_tp2)
        assert t["eval_loss_of_other"] == pytest.approx(ms_tp2[rank]["tp2_qk"]["eval_loss"], abs=TOL)
    (init, _, _), (trained, _, _) = nf.load(ckpts["qk_init"]), nf.load(ckpts["ms_qk"])
    for name in ("decoder.layers.1.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.k_layernorm.weight"):
        assert trained[name].shape == (16,) and np.abs(trained[name] - init[name]).max() > 1e-3, name


def test_coc_losses_match_plain_tp2(ms_tp2):
    """--use-ascend-coc on MindSpore (chunked GEMMs, MsComm's async collectives, PyNative): the
    losses of the plain TP=2 runs (the traced graph), with and without sequence parallelism."""
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        for run, plain in (("tp2_coc", "tp2"), ("tp2_sp_coc", "tp2_sp")):
            coc = ms_tp2[rank][run]
            np.testing.assert_allclose(coc["losses"], ms_tp2[rank][plain]["losses"][:len(coc["losses"])],
                                       atol=1e-6, rtol=0, err_msg=run)
            assert not coc["graph_mode"], run       # CoC's linears wait on collectives: PyNative
            # every forward (3 steps + 1 evaluation) went through CoC: 2 layers x (qkv, fc1) and
            # the output layer are column-parallel, 2 layers x (proj, fc2) row-parallel
            assert coc["calls"] == {"column": 4 * 5, "row": 4 * 4}, run


def test_full_recompute_at_tp2_matches_plain_tp2(ms_tp2):
    """--recompute-granularity full at TP=2 on MindSpore (PyNative: recompute reruns each layer in
    backward, through the tensor-parallel collectives' gradient taps) gives plain TP=2's losses."""
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        run = ms_tp2[rank]["tp2_recompute_full"]
        np.testing.assert_allclose(run["losses"], ms_tp2[rank]["tp2"]["losses"][:len(run["losses"])],
                                   atol=1e-6, rtol=0)
        assert not run["graph_mode"]


def test_model_variants_at_tp2_sp_match_tp1(ms_tp2):
    """GELU MLP + LayerNorm + learned positions (test_mindspore_parity_model.py checks them against
    Megatron-Core at TP=1) at TP=2 with sequence parallelism give the TP=1 losses."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    tp1 = mp.ms_train(MindSporeBackend("cpu"), 1, False, None, steps=pm.SHORT_STEPS, extra=pm.combined_flags())
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        run = ms_tp2[rank]["tp2_sp_gelu_layernorm_learned"]
        np.testing.assert_allclose(run["losses"], tp1["losses"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(run["grad_norms"], tp1["grad_norms"], rtol=NORM_RTOL)
        assert run["graph_mode"]


def test_selective_recompute_with_context_parallelism(ms_tp2):
    """--recompute-granularity selective reruns the ring attention of CP=2 in backward: the losses of
    the CP=2 run without it."""
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        run = ms_tp2[rank]["cp2_selective_recompute"]
        plain = ms_tp2[rank]["cp2_megatron_cp_algo"]["losses"]
        np.testing.assert_allclose(run["losses"], plain[:len(run["losses"])], atol=1e-6, rtol=0)
        # each layer's attention once in every forward (the steps and one evaluation), and once more
        # in every backward
        steps = len(run["losses"])
        assert run["attention_calls"] == mp.LAYERS * (steps + 1) + mp.LAYERS * steps


def test_general_mask_with_context_parallelism(ckpts, ms_tp2):
    """--attention-mask-type general at CP=2: ring attention takes the batch's own mask (packed
    documents, --reset-attention-mask) and gives the CP=1 losses with that mask
    (test_mindspore_parity_eod.py checks those against Megatron-Core), not the causal mask's."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed import mindspore_parity_eod as pe
    backend = MindSporeBackend("cpu")
    documents = pe.ms_documents(backend, ckpts["init"])
    causal = pe.ms_documents(backend, ckpts["init"], flags=("--eod-mask-loss",))
    assert np.abs(np.array(documents["losses"]) - causal["losses"]).max() > 10 * TOL   # the mask matters: 7.6e-3
    for rank in range(2):
        assert ms_tp2[rank]["ok"], ms_tp2[rank].get("error")
        run = ms_tp2[rank]["cp2_general_documents"]
        np.testing.assert_allclose(run["losses"], documents["losses"], atol=TOL, rtol=0)
        np.testing.assert_allclose(run["grad_norms"], documents["grad_norms"], rtol=NORM_RTOL)


# --- YaRN RoPE scaling ------------------------------------------------------------------------------
# DeepSeek-V3's factor and a context of 8 for the 16-token sequence: the ramp interpolates all but the fastest
# frequency, and the concentration factor (1.37) sharpens the attention
YARN_FLAGS = ("--rope-scaling-type", "yarn", "--rope-scaling-factor", "40",
              "--rope-scaling-original-max-position-embeddings", "8")
# (kv_channels, rotary_base, seq, settings other than the defaults) of the tables compared
YARN_TABLES = ((mp.HIDDEN // mp.HEADS, 10000.0, mp.SEQ, {"rotary_scaling_factor": 40.0, "original_max_position_embeddings": 8}),
               (16, 500.0, 40, {"rotary_scaling_factor": 2.5, "original_max_position_embeddings": 24, "beta_fast": 4.0,
                                "beta_slow": 0.5, "mscale": 0.8, "mscale_all_dim": 0.5}))


@pytest.fixture(scope="module")
def yarn_runs(ckpts, torch_tp1):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.family_flags import YARN_DEFAULTS
    ms = mp.ms_train(MindSporeBackend("cpu"), 1, False, ckpts["init"], save_dir=ckpts["ms_yarn"], extra=YARN_FLAGS)
    tables = [(kv, base, seq, dict(YARN_DEFAULTS, **given)) for kv, base, seq, given in YARN_TABLES]
    (torch_side,) = run_distributed(mp.torch_yarn, world_size=1, timeout=300,
                                    args=(ckpts["init"], ckpts["ms_yarn"], tables[0][3], tables))
    return ms, torch_side, tables


def test_yarn_tables_are_megatron_cores(yarn_runs):
    from mindspeed.flags.family_flags import YARN_DEFAULTS
    from mindspeed.training.mindspore import rope
    _, torch_side, tables = yarn_runs
    assert torch_side["defaults"] == YARN_DEFAULTS          # what the MindSpore trainer fills in, Megatron-Core's
    for (kv, base, seq, yarn), theirs in zip(tables, torch_side["tables"]):
        cos, _ = rope.rope_tables(kv, 1.0, base, seq, yarn=yarn)
        plain, _ = rope.rope_tables(kv, 1.0, base, seq)
        ours = cos.asnumpy().reshape(seq, -1)
        np.testing.assert_allclose(ours, np.array(theirs), rtol=0, atol=2e-6)
        assert np.abs(ours - plain.asnumpy().reshape(seq, -1)).max() > 0.05      # YaRN changed them


def test_yarn_losses_match_megatron_core_and_its_checkpoint_crosses(yarn_runs, torch_tp1):
    ms, torch_side, _ = yarn_runs
    np.testing.assert_allclose(ms["losses"], torch_side["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(ms["grad_norms"], torch_side["grad_norms"], rtol=NORM_RTOL)
    assert np.abs(np.array(ms["losses"]) - np.array(torch_tp1["losses"])).max() > 10 * TOL     # not plain RoPE
    assert torch_side["eval_loss_of_other"] == pytest.approx(ms["eval_loss"], abs=TOL)
