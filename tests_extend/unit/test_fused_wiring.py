"""Fused features wired into Megatron-Core: a GPT layer with the flags calls the kernels and one
without does not; a tiny GPT trains to the same losses fused and unfused; bad flags are refused."""
import argparse

import pytest

import mindspeed
from mindspeed.adaptor_core import MindSpeedConfigError, plan
from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import fused_workers


@pytest.fixture(scope="module")
def reports():
    (result,) = run_distributed(fused_workers.all_reports, world_size=1, timeout=600)
    return result


def test_gpt_layer_with_flags_uses_the_kernels_and_without_does_not(reports):
    report = reports["layer"]
    on, off = report["on"], report["off"]
    assert all(on["counts"][k] > 0 for k in fused_workers.COUNTED), on["counts"]
    assert all(v == 0 for v in off["counts"].values()), off["counts"]
    assert (on["norm"], on["final_norm"], on["attention"]) == ("FusedRMSNorm", "FusedRMSNorm",
                                                               "FlashDotProductAttention")
    assert (off["norm"], off["final_norm"], off["attention"]) == ("RMSNorm", "RMSNorm", "DotProductAttention")
    assert on["swiglu_fusion"] and on["grad_fusion"] and not off["swiglu_fusion"] and not off["grad_fusion"]


@pytest.mark.cpu_numerics
def test_tiny_gpt_trains_to_the_same_losses_with_all_fused_flags(reports):
    curves = reports["train"]
    on, off = curves["on"], curves["off"]
    assert len(on) == len(off) == 20
    assert on[-1] < on[0] - 0.5                           # it learns
    for a, b in zip(on, off):
        assert a == pytest.approx(b, abs=2e-3, rel=1e-3)  # fp32: same trajectory


def test_bad_sparse_mode_and_empty_band_are_refused_before_work():
    with pytest.raises(MindSpeedConfigError, match="--sparse-mode 7 is not supported"):
        plan(["--use-flash-attn", "--sparse-mode", "7"])
    with pytest.raises(MindSpeedConfigError, match="empty band"):
        plan(["--use-flash-attn", "--sparse-mode", "4", "--pre-tockens", "-5", "--next-tockens", "2"])
    with pytest.raises(MindSpeedConfigError, match="needs an MoE model"):
        plan(argparse.Namespace(moe_grouped_gemm=True, num_experts=None))


def test_optimization_level_0_drops_the_fused_features():
    ids = {f.id for f in plan(["--use-fused-rmsnorm", "--use-flash-attn"]).features}
    assert {"fused-rmsnorm", "flash-attn"} <= ids
    kept = {f.id for f in plan(["--use-fused-rmsnorm", "--use-flash-attn", "--optimization-level", "0"]).features}
    assert not kept & {"fused-rmsnorm", "flash-attn"}


def test_unadapt_removes_the_fused_hooks():
    from megatron.core.models.backends import LocalSpecProvider
    before = LocalSpecProvider.core_attention
    session = mindspeed.adapt(["--use-flash-attn", "--use-fused-ring-attention-update"])
    assert LocalSpecProvider.core_attention is not before and session.applied("fused-ring-attention-update")
    assert session.fused_features == ("flash-attn", "fused-ring-attention-update")
    assert session.fast_kernels == {"attention", "ring_attention_update"}
    session.close()
    assert LocalSpecProvider.core_attention is before


@pytest.mark.cpu_numerics
def test_moe_grouped_gemm_and_fused_permutation_in_a_megatron_moe_layer(reports):
    """Each fused MoE path, loaded with the unfused run's weights, calls its kernels, uses their
    results (doubling a kernel's output moves the loss), and matches Megatron's own unfused path
    (SequentialMLP + its permutation) in per-token loss and in every parameter's main_grad, within
    bf16 rounding (GroupedMLP runs bf16 only)."""
    report = reports["moe"]
    off = report["off"]
    assert off["experts"] == "SequentialMLP" and all(v == 0 for v in off["counts"].values()), off["counts"]
    expected = {"permute": ("SequentialMLP", {"moe_permute", "moe_unpermute"}),
                "grouped": ("GroupedMLP", {"gmm", "moe_permute", "moe_unpermute"}),
                "grouped+fused_grad": ("GroupedMLP", {"gmm", "moe_permute", "moe_unpermute"})}
    for name, (experts, kernels) in expected.items():
        run = report[name]
        assert run["experts"] == experts, (name, run["experts"])
        assert {k for k, n in run["counts"].items() if n > 0} == kernels, (name, run["counts"])
        assert set(run["sensitivity"]) == kernels and min(run["sensitivity"].values()) > 0.01, (name, run)
        assert run["loss_max_diff"] <= 0.01, (name, run["loss_max_diff"])      # per token, loss ~4.9
        assert set(run["grad_rel_diff"]) == set(report["grad_names"])
        worst = max(run["grad_rel_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 0.02, (name, worst)
    # the fused weight-gradient path fills main_grad itself: one more gmm per expert GEMM backward
    assert report["grouped+fused_grad"]["counts"]["gmm"] > report["grouped"]["counts"]["gmm"]


def test_flash_attention_recognises_megatrons_plain_causal_mask():
    import torch
    from mindspeed.features.fused.flash_attention import _is_plain_causal, band_arguments
    causal = torch.ones(1, 1, 6, 6, dtype=torch.bool).triu(1)
    assert _is_plain_causal(causal, 6, 6)
    reset = causal.clone()
    reset[..., 3:, :3] = True                                  # a document boundary: keep the mask
    assert not _is_plain_causal(reset, 6, 6) and not _is_plain_causal(None, 6, 6)
    assert band_arguments(3, True, 4, 7, 0, 0) == dict(causal=False, next_tokens=3)
    assert band_arguments(4, True, 4, 4, 2, 0) == dict(causal=True, pre_tokens=2, next_tokens=0)


def test_packed_documents_lose_what_each_document_loses_alone(reports):
    """--reset-attention-mask with --use-flash-attn: the documents' ends go to one TND kernel call
    per layer (no mask of any size), and a packed batch's per-token losses equal those of its
    documents run one by one; without the ends the packed batch attends across documents."""
    eod = reports["eod"]
    assert eod["ends"] == [[5, 16, 32], [20, 21, 32]]
    assert eod["calls"] == [("TND", True)] * 2                # 2 layers, forward; no [s, s] mask
    assert eod["max_diff"] <= 1e-5
    assert eod["crossing_diff"] > 1e-2


def test_packed_documents_travel_with_their_micro_batch_through_recompute(reports):
    """The documents are the micro-batch's attention_mask, not a module global: with full recompute,
    micro-batch A's backward after B's forward (a pipeline schedule's order) re-runs A's layers with
    A's documents, so A's gradients are those of A alone; with B's documents they would differ."""
    eod = reports["eod"]
    assert eod["recompute_interleaved_diff"] <= 1e-6, eod["recompute_interleaved_diff"]
    assert eod["recompute_other_documents_diff"] > 1e-3, eod["recompute_other_documents_diff"]


def test_packed_documents_with_sparse_mode_1_stay_causal_in_each_document(reports):
    """--sparse-mode 1 ('the given mask only'): the mask a packed batch would give is the documents'
    causal one, so each document's tokens see only the earlier tokens of their own document."""
    given = reports["eod_given_mask"]
    assert given["calls"] == [("TND", True)] * 2
    assert given["max_diff"] <= 1e-5


def test_documents_come_from_the_eod_tokens_and_replace_the_dense_mask():
    """The trainer's batch: with flash attention (or CP) and --reset-attention-mask the dataset
    builds no attention mask and get_batch puts each sample's document ends in the batch's attention_mask
    (a document ends right after its EOD token); otherwise Megatron's dense mask stays."""
    import torch
    from mindspeed.adaptor_core import plan
    from mindspeed.features import documents
    from mindspeed.features.base import ApplyContext
    from mindspeed.patching import PatchManager
    from mindspeed.session import Session
    from mindspeed.training import data
    from mindspeed.flags.trainer_flags import parse_args

    def packed_documents(args) -> bool:      # the rule of the run these flags plan (nothing applied)
        return Session(plan(args), ApplyContext("torch", "cpu", PatchManager()), PatchManager()).packed_documents(args)

    base = ["--mock-data", "--seq-length", "8", "--reset-attention-mask"]
    assert packed_documents(parse_args(base + ["--use-flash-attn"]))
    assert packed_documents(parse_args(base + ["--context-parallel-size", "2"], world_size=2))
    assert not packed_documents(parse_args(base))
    assert not packed_documents(parse_args(base + ["--use-flash-attn", "--context-parallel-size", "2",
                                               "--attention-mask-type", "general"], world_size=2))
    flash = parse_args(base + ["--use-flash-attn"])
    tokenizer = data.resolve_data(flash)
    assert data._dataset_config(flash, tokenizer, packed_documents(flash)).create_attention_mask is False
    plain = parse_args(base)
    assert data._dataset_config(plain, tokenizer, packed_documents(plain)).create_attention_mask is True
    batch = {"tokens": torch.tensor([[1, 9, 2, 3, 9, 4, 5, 9], [9, 1, 2, 3, 4, 5, 6, 7]]),
             "labels": torch.zeros(2, 8, dtype=torch.long)}
    got = data.get_batch(iter([batch]), "cpu", eod=9)
    assert documents.ends_in(got["attention_mask"]) == [[2, 5, 8], [1, 8]]
    assert "attention_mask" not in data.get_batch(iter([batch]), "cpu", eod=None)   # the plain path: no documents


def test_documents_follow_the_applied_plan_not_the_flags_alone():
    """--use-flash-attn dropped by --optimization-level 0: Megatron's attention (and its dense
    mask) runs, so the dataset must build the mask."""
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(["--mock-data", "--reset-attention-mask", "--use-flash-attn", "--optimization-level", "0"])
    session = mindspeed.adapt(args)
    try:
        assert not session.packed_documents(args)
    finally:
        session.close()
    args = parse_args(["--mock-data", "--reset-attention-mask", "--use-flash-attn"])
    session = mindspeed.adapt(args)
    try:
        assert session.packed_documents(args)
    finally:
        session.close()


def test_each_fused_feature_declares_the_kernels_it_switches_and_the_mindspore_gpt_reads_them():
    """One source for "is fused kernel X on": Feature.kernels (the MindSpore GPT's table of feature ids
    is gone); every declared kernel is one the backends serve."""
    from mindspeed.backends.base import KERNEL_NAMES
    from mindspeed.features.registry import all_features, fast_kernels
    from mindspeed.training.mindspore.gpt_config import GPTConfig
    from mindspeed.flags.trainer_flags import parse_args
    fused = {f.id: f.kernels for f in all_features() if type(f).__module__ == "mindspeed.features.fused.features"}
    assert all(fused.values()) and set().union(*fused.values()) <= set(KERNEL_NAMES)
    assert fast_kernels(["fused-rmsnorm", "flash-attn", "sequence-parallel"]) == {"rms_norm", "attention"}
    cfg = GPTConfig.from_args(parse_args(["--mock-data"]), 128, ("fused-swiglu", "moe-grouped-gemm"))
    assert cfg.fused_kernels == {"swiglu", "gmm"}
