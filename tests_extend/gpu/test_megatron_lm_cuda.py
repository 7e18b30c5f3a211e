"""Megatron-LM's own pretrain_gpt.py with the import line on one CUDA GPU (train_distributed.sh with
MEGATRON_LM=<checkout>, as a user runs it; mock data).

Skipped where torch sees no CUDA device or no Megatron-LM snapshot is found
(tests_extend/system/megatron_lm_kit.py: $MINDSPEED_MEGATRON_LM_SNAPSHOTS). From one seed, the run
with MindSpeed's fused kernels and attention gives the losses of the run without them; bf16 with them
stays close to fp32 (docs/gpu.md).
"""
from __future__ import annotations

import pytest
import torch

from tests_extend.system import megatron_lm_kit as kit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

NEWEST = kit.VERSIONS[-1]
FUSED_FEATURES = {"fused-rmsnorm", "fused-swiglu", "fused-rotary-pos-emb", "flash-attn"}
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"]
FP32_TOLERANCE = 2e-3      # the fused and unfused paths round differently; 10 steps of Adam follow
BF16_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return kit.with_dataset_helpers(kit.checkout_or_skip(NEWEST, tmp_path_factory))


def _train(checkout: str, fused: bool, extra=()) -> tuple[str, dict[int, float]]:
    result = kit.launch(checkout, 1, [*NO_DROPOUT, *extra], {"MOCK_DATA": "1", "FUSED": "1" if fused else "0"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    losses = kit.losses(output)
    assert sorted(losses) == list(range(1, 11)), output[-3000:]
    return output, losses


@pytest.fixture(scope="module")
def unfused(checkout):
    return _train(checkout, fused=False)


@pytest.fixture(scope="module")
def fused(checkout):
    return _train(checkout, fused=True)


def test_the_run_is_on_the_gpu_with_the_fused_kernels(fused):
    output, _ = fused
    line = next(l for l in output.splitlines() if "> MindSpeed backend" in l)
    assert "(device cuda)" in line, line
    assert FUSED_FEATURES <= kit.mindspeed_features(output), line


def test_fused_kernels_give_the_unfused_losses(fused, unfused):
    gaps = {i: abs(fused[1][i] - unfused[1][i]) for i in fused[1]}
    print(f"\nMegatron-LM core_v{NEWEST} on cuda, fused vs unfused: largest loss gap {max(gaps.values()):.2e}")
    assert max(gaps.values()) <= FP32_TOLERANCE, (fused[1], unfused[1])


def test_bf16_with_the_fused_kernels_stays_close_to_fp32(checkout, fused):
    _, bf16 = _train(checkout, fused=True, extra=["--bf16"])
    gaps = {i: abs(bf16[i] - fused[1][i]) for i in bf16}
    print(f"\nMegatron-LM core_v{NEWEST} on cuda, bf16 vs fp32: largest loss gap {max(gaps.values()):.2e}")
    assert max(gaps.values()) <= BF16_TOLERANCE, (bf16, fused[1])
