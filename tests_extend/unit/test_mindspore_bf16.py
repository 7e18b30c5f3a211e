"""--bf16 on MindSpore's CPU is emulated (backends/mindspore/precision.py): the ops in MISSING_ON_CPU
have no bf16 kernel there, so the trainer computes them in fp32 and rounds their output to bf16.
The first test keeps that list honest: when a MindSpore release adds a bf16 CPU kernel, its case
fails and the emulation (and the matrix's `emulated` cell) can be narrowed."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
import torch  # noqa: E402
from mindspore import ops  # noqa: E402

from mindspeed.backends.mindspore import precision  # noqa: E402

BF = ms.bfloat16


def _bf16(*shape, seed=0):
    return ms.Tensor(np.random.RandomState(seed).standard_normal(shape).astype(np.float32)).astype(BF)


MISSING = {
    "MatMul": lambda x: ops.MatMul(transpose_b=True)(x, x),
    "BatchMatMul": lambda x: ops.BatchMatMul(transpose_b=True)(x[None], x[None]),
    "Gather": lambda x: ops.gather(x, ms.Tensor(np.array([0, 2], np.int32)), 0),
    "Softmax": lambda x: ops.softmax(x, -1),
    "Sigmoid": lambda x: ops.sigmoid(x),
    "Exp": lambda x: ops.exp(x),
    "Sqrt": lambda x: ops.sqrt(x * x),
    "ReduceSum": lambda x: x.sum(-1),
    "LayerNorm": lambda x: ops.LayerNorm(-1, -1, 1e-5)(x, ops.ones((8,), BF), ops.zeros((8,), BF))[0],
    "Assign": lambda x: ops.assign(ms.Parameter(x.copy(), name="p"), x),
}


def test_the_list_names_every_op_the_emulation_covers():
    assert sorted(MISSING) == sorted(precision.MISSING_ON_CPU)


@pytest.mark.parametrize("op", sorted(MISSING))
def test_mindspore_cpu_has_no_bf16_kernel_for(op):
    x = _bf16(4, 8)
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        out = MISSING[op](x)
        (out[0] if isinstance(out, tuple) else out).asnumpy()
        ms.runtime.synchronize()
    try:        # PyNative dispatches ops asynchronously: an error left pending would surface in the next test
        ms.runtime.synchronize()
    except (TypeError, RuntimeError, ValueError):
        pass


def test_fp32_compute_rounds_a_matmul_as_torchs_bf16_matmul_and_keeps_bf16_gradients():
    x, w = _bf16(16, 32, seed=1), _bf16(8, 32, seed=2)
    matmul = precision.fp32_compute(ops.MatMul(transpose_b=True))
    out = matmul(x, w)
    assert precision.emulated() and out.dtype == BF
    t_x, t_w = (torch.tensor(a.astype(ms.float32).asnumpy()).to(torch.bfloat16).requires_grad_() for a in (x, w))
    t_out = t_x @ t_w.T
    # both accumulate in fp32 and round once: equal up to the last bf16 bit of a few sums
    np.testing.assert_allclose(out.astype(ms.float32).asnumpy(), t_out.float().detach().numpy(), rtol=2 ** -7, atol=1e-6)
    gx, gw = ms.grad(lambda a, b: matmul(a, b).astype(ms.float32).sum(), (0, 1))(x, w)
    t_out.float().sum().backward()
    assert gx.dtype == gw.dtype == BF
    np.testing.assert_allclose(gw.astype(ms.float32).asnumpy(), t_w.grad.float().numpy(), rtol=2 ** -7, atol=1e-6)


def test_fp32_compute_leaves_fp32_alone_and_follows_the_activations_dtype():
    seen = []
    probe = precision.fp32_compute(lambda a, b: seen.append((a.dtype, b.dtype)) or a * b)
    x32 = ms.Tensor(np.ones((2, 2), np.float32))
    assert probe(x32, x32).dtype == ms.float32 and seen[-1] == (ms.float32, ms.float32)
    assert probe(_bf16(2, 2), x32).dtype == BF and seen[-1] == (ms.float32, ms.float32)
    # fp32 activations (an fp32 MoE layer) meeting a bf16 weight stay fp32
    assert probe(x32, _bf16(2, 2)).dtype == ms.float32


def test_assign_writes_a_bf16_parameter_in_place():
    p = ms.Parameter(_bf16(3, 4), name="w")
    value = _bf16(3, 4, seed=5)
    precision.assign(p, value)
    np.testing.assert_array_equal(p.astype(ms.float32).asnumpy(), value.astype(ms.float32).asnumpy())
