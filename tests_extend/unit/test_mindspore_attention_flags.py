"""The attention flags on the MindSpore trainer, before any work: what the support matrix accepts and
refuses in one line (flash attention's band with context parallelism; packed documents under CP only
as the general mask), and the kernel keywords each sparse mode becomes in the trainer's model."""
import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan

MS = ["--backend", "mindspore"]
CP2 = ["--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo"]
BAND = ["--use-flash-attn", "--sparse-mode", "4", "--pre-tockens", "3"]


def _ids(argv) -> set:
    return {f.id for f in plan(argv).features}


@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_band_runs_without_cp_and_is_refused_with_it(backend):
    """Under CP flash attention defers to the context-parallel attention, which takes no band: refused
    on both trainers rather than dropped."""
    assert {"flash-attn", "flash-attn-band"} <= _ids(["--backend", backend] + BAND)
    with pytest.raises(MindSpeedConfigError, match="context-parallel attention is causal only"):
        plan(["--backend", backend] + BAND + CP2)


def test_documents_under_cp_go_through_the_general_mask_only():
    docs = ["--reset-attention-mask", "--eod-mask-loss"]
    assert {"general-attention-mask", "eod-reset"} <= _ids(MS + CP2 + docs + ["--attention-mask-type", "general"])
    with pytest.raises(MindSpeedConfigError, match="alone goes through it with --attention-mask-type general"):
        plan(MS + CP2 + docs)
    with pytest.raises(MindSpeedConfigError, match="takes no document mask or positions"):
        plan(MS + CP2 + docs + ["--reset-position-ids", "--attention-mask-type", "general"])


def test_variable_seq_lengths_with_pipeline_parallelism_is_accepted():
    assert "variable-seq-lengths" in _ids(MS + ["--variable-seq-lengths", "--pipeline-model-parallel-size", "2"])


def test_documents_with_pipeline_parallelism_are_accepted_and_dropout_refused():
    """Every stage builds its documents' mask from its micro-batch (test_mindspore_parity_pp.py); dropout's
    masks are drawn per layer and the stages exchange none."""
    pp2 = ["--pipeline-model-parallel-size", "2"]
    assert "eod-reset" in _ids(MS + pp2 + ["--reset-attention-mask", "--reset-position-ids"])
    with pytest.raises(MindSpeedConfigError, match="exchange no dropout masks"):
        plan(MS + pp2 + ["--hidden-dropout", "0.1"])


@pytest.mark.parametrize("argv, features, expected", [
    (BAND, ("flash-attn",), (("causal", True), ("next_tokens", 0), ("pre_tokens", 3))),
    (BAND, (), (("causal", True),)),                                  # no flash attention: the flags do nothing
    (["--sparse-mode", "1"], ("flash-attn",), (("causal", True),)),     # the given mask: Megatron's causal one
    (["--sparse-mode", "3"], ("flash-attn",), (("causal", False), ("next_tokens", 0))),
    (["--sparse-mode", "4", "--pre-tockens", "2", "--next-tockens", "-1"], ("flash-attn",),
     (("causal", True), ("next_tokens", -1), ("pre_tokens", 2))),
])
def test_sparse_modes_become_the_kernels_keywords(argv, features, expected):
    pytest.importorskip("mindspore")
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.attention_band import band_keywords
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", *argv], world_size=1)
    assert band_keywords(args, features) == expected
