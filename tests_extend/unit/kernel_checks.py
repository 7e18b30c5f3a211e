"""Shared helpers for the kernel tests: run a kernel forward+backward and compare with another
implementation at docs/kernels.md tolerances (fp32: torch defaults; bf16: at most 2x the reference's
own error against an fp64 ground truth, plus a small floor)."""
from __future__ import annotations

import torch

FP32_TOL = dict(atol=1e-5, rtol=1.3e-6)


def run(fn, inputs, grad_seed: int = 1, n_out: int = 1):
    """fn(*inputs) -> outputs (tuple ok); backward with fixed random cotangents on the first
    n_out outputs. Returns (outputs, input grads)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(grad_seed)
    used = [o for o in outs[:n_out] if o is not None and o.requires_grad]
    cots = [torch.randn(o.shape, generator=g).to(device=o.device, dtype=o.dtype) for o in used]
    torch.autograd.backward(used, cots)
    return [o.detach() for o in outs if o is not None], [t.grad for t in leaves if t.is_floating_point()]


def assert_close_fp32(a, b, atol=FP32_TOL["atol"], rtol=FP32_TOL["rtol"]):
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=rtol)


def assert_low_precision_ok(test, ref, truth, floor=2e-2):
    """Each tensor of `test` is at most 2x as far from `truth` (fp64) as `ref` is, + floor."""
    for t, r, g in zip(test, ref, truth):
        if t is None:
            continue
        err_t, err_r = _max_error(t, g), _max_error(r, g)
        assert err_t <= 2 * err_r + floor, f"error {err_t:.3g} vs reference error {err_r:.3g}"


def _max_error(x, truth):
    """Largest |x - truth|; equal values (including equal infinities, e.g. -inf logsumexp of a
    fully masked row) count as no error."""
    x, truth = x.double(), truth.double()
    diff = torch.where(x == truth, torch.zeros_like(x), (x - truth).abs())
    return diff.max().item() if diff.numel() else 0.0
