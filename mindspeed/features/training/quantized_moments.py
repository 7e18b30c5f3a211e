"""Adam's moments in 8 bits (--quant-states), as upstream MindSpeed's low-precision optimizer stores them.

fp8: exp_avg as float8_e4m3fn (largest 448), exp_avg_sq as float8_e5m2 (largest 57344), each scaled
per block of gcd(numel, 128) consecutive elements (one scale for the whole tensor when that is
under 16) by `largest / amax(block)`, kept in fp32 (a block of zeros keeps scale 1); the value
back is `code * (1 / scale)`.

mxfp8: the OCP Microscaling (MX) v1.0 format: blocks of 32 consecutive elements (the last one
shorter) share a power-of-two scale 2^(floor(log2 amax) - emax), stored as its E8M0 byte, with
emax 8 for e4m3 (exp_avg) and 15 for e5m2 (exp_avg_sq); elements are the bf16-rounded values
divided by the scale, rounded to nearest-even and saturated to the format's largest. As upstream,
a moment is stored k-scaled, as its signed square (sign(x) x²), and comes back as the signed square
root: small moments keep more relative precision at the block's scale.

Elements beyond the format's largest are clamped before the cast (torch's e4m3fn cast has no
infinity: an overflow would read back as NaN).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EMAX = {E4M3: 8, E5M2: 15}          # the largest normal's exponent (OCP MX v1.0, table 1)
MX_BLOCK = 32
FP8_BLOCK, FP8_MIN_BLOCK = 128, 16


@dataclass
class Quantized:
    """One moment in 8 bits: flat codes, per-block scales (fp32 multipliers, or E8M0 bytes), shape."""
    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def _largest(dtype) -> float:
    return torch.finfo(dtype).max


def fp8_block(numel: int) -> int:
    """Upstream's block: gcd(numel, 128); under 16 the tensor is one block."""
    block = math.gcd(numel, FP8_BLOCK)
    return block if block >= FP8_MIN_BLOCK else numel


def quantize_fp8(x: torch.Tensor, dtype) -> Quantized:
    flat = x.detach().reshape(-1).float()
    blocks = flat.view(-1, fp8_block(flat.numel())) if flat.numel() else flat.view(0, 1)
    amax = blocks.abs().amax(dim=1)
    largest = _largest(dtype)
    # a true division (`largest / tensor` in torch is largest * reciprocal: two roundings)
    scale = torch.where((amax > 0) & torch.isfinite(amax), torch.full_like(amax, largest).div(amax),
                        torch.ones_like(amax))
    codes = (blocks * scale[:, None]).clamp_(-largest, largest).to(dtype)
    return Quantized(codes.view(-1), scale, x.shape)


def dequantize_fp8(q: Quantized) -> torch.Tensor:
    blocks = q.codes.view(q.scales.numel(), -1).float() if q.codes.numel() else q.codes.float().view(0, 1)
    return (blocks * (1.0 / q.scales)[:, None]).view(q.shape)


def _signed_square(x: torch.Tensor) -> torch.Tensor:
    return x * x.abs() + 0.0          # sign(x) x² (+ 0.0: -0 becomes +0)


def _signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.abs().sqrt()
    return torch.where(x >= 0, magnitude, -magnitude)


def _mx_blocks(flat: torch.Tensor) -> torch.Tensor:
    """[n] -> [ceil(n / 32), 32], the last block zero-padded (zeros change no block's amax)."""
    pad = (-flat.numel()) % MX_BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, MX_BLOCK)


def quantize_mxfp8(x: torch.Tensor, dtype) -> Quantized:
    flat = _signed_square(x.detach().reshape(-1).float()).to(torch.bfloat16).float()
    blocks = _mx_blocks(flat)
    amax = blocks.abs().amax(dim=1)
    # floor(log2 amax) from the exponent field (exact: frexp gives amax = m * 2^e, m in [0.5, 1))
    exponent = torch.frexp(amax).exponent - 1 - EMAX[dtype]
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp_(-127, 127)
    largest = _largest(dtype)
    codes = (blocks * torch.exp2(-exponent.float())[:, None]).clamp_(-largest, largest).to(dtype)
    return Quantized(codes.view(-1)[:flat.numel()], (exponent + 127).to(torch.uint8), x.shape)


def dequantize_mxfp8(q: Quantized) -> torch.Tensor:
    blocks = _mx_blocks(q.codes.float())
    scale = torch.exp2(q.scales.float() - 127.0)
    stored = (blocks * scale[:, None]).view(-1)[:q.codes.numel()]
    return _signed_sqrt(stored).view(q.shape)


CODECS = {"fp8": (quantize_fp8, dequantize_fp8), "mxfp8": (quantize_mxfp8, dequantize_mxfp8)}
MOMENT_DTYPES = {"exp_avg": E4M3, "exp_avg_sq": E5M2}     # both formats: e4m3 for m, e5m2 for v


def quantize(fmt: str, moment: str, x: torch.Tensor) -> Quantized:
    return CODECS[fmt][0](x, MOMENT_DTYPES[moment])


def dequantize(fmt: str, q: Quantized) -> torch.Tensor:
    return CODECS[fmt][1](q)
