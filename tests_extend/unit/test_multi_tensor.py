"""Megatron's Apex/TE-less multi-tensor ops (grad norm, clip scaling, master-to-model copies) as
torch foreach calls: the same numbers as Megatron's own fallback, bit for bit, and bound where
Megatron's optimizer code reads them until the patches are removed."""
import pytest
import torch

from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer as megatron_optimizer

from mindspeed.backends.torch.megatron_shim import CudaToCpuMode
from mindspeed.backends.torch.multi_tensor import apply_foreach_multi_tensor, foreach_l2_norm, foreach_scale
from mindspeed.patching import PatchManager


def _grads(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(128, 384), (384,), (128,), (3, 5, 7), (1,), (257, 129)]
    return [(torch.randn(s, generator=g) * (i + 1)).to(dtype) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_equals_megatrons_fallback(dtype):
    grads = _grads(dtype)
    ours, _ = foreach_l2_norm(2048 * 32, None, [grads], False)
    with CudaToCpuMode():     # Megatron's fallback puts its result on device "cuda"
        theirs, _ = megatron_utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert ours.dtype == torch.float32 and ours.shape == (1,)
    assert torch.equal(ours, theirs.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_scale_equals_megatrons_fallback(dtype):
    ours, theirs = _grads(dtype), _grads(dtype)
    foreach_scale(0, None, [ours, ours], 0.37)
    megatron_utils.local_multi_tensor_scale(0, None, [theirs, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_copy_with_scale_casts_into_the_targets_like_megatrons_fallback():
    sources = _grads(torch.float32, seed=1)
    ours = [torch.zeros_like(s, dtype=torch.bfloat16) for s in sources]
    theirs = [torch.zeros_like(s, dtype=torch.bfloat16) for s in sources]
    foreach_scale(0, None, [sources, ours], 1.0)
    megatron_utils.local_multi_tensor_scale(0, None, [sources, theirs], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not all(torch.equal(s, s.bfloat16().float()) for s in sources)   # the cast did round


def test_bound_where_megatron_reads_them_and_removable():
    assert clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm   # no Apex / TE here
    patcher = PatchManager()
    apply_foreach_multi_tensor(patcher)
    try:
        assert clip_grads.l2_norm_impl is foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is foreach_scale
        assert megatron_optimizer.multi_tensor_scale_impl is foreach_scale
    finally:
        patcher.remove_all()
    assert clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm
    assert megatron_optimizer.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale
