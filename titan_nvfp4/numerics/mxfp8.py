"""MXFP8 (OCP MX): E4M3 elements, 32-element blocks along the last dim, E8M0 power-of-two scales.

Scales follow cuBLAS's round-up rule ("RCEIL"): the block scale is the smallest power of two
2^e >= amax_b / 448, so no element saturates. Elements are x · 2^-e rounded to nearest-even E4M3.
A block of zeros gets 2^-127; a block holding NaN or ±Inf gets the E8M0 NaN scale and decodes to NaN.
A NaN element is stored as 0x7F whatever its sign (a GPU's arithmetic drops a NaN's sign, x86's keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import F8_E4M3_MAX, e8m0_from_exponent, e8m0_to_float, to_e4m3_saturating
from .nvfp4 import check_out_dtype, refuse_grad

MX_BLOCK = 32


@dataclass
class MXFP8Tensor:
    """E4M3 elements (x's shape) and E8M0 scales (x.shape[:-1] + (x.shape[-1] // 32,))."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x̂ = element · 2^e per block."""
        check_out_dtype(dtype)
        shape = self.data.shape
        vals = self.data.float().view(*shape[:-1], shape[-1] // MX_BLOCK, MX_BLOCK)
        return (vals * e8m0_to_float(self.scale).unsqueeze(-1)).view(shape).to(dtype)


def _ceil_log2(d: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(d)) for positive finite fp32 d, via frexp (no transcendental rounding)."""
    mant, exp = torch.frexp(d)  # d = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp)


def quantize_mxfp8(x: torch.Tensor) -> MXFP8Tensor:
    """Quantize x to MXFP8 with 1×32 blocks along the last dim. Not differentiable, as quantize_nvfp4: an x
    that requires grad, with grad mode on, is refused (numerics.nvfp4.refuse_grad)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_mxfp8: x must be a torch.Tensor, got {type(x).__name__}")
    refuse_grad("quantize_mxfp8", x=x)
    if not x.is_floating_point():
        raise TypeError(f"MXFP8 quantization needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor to MXFP8")
    if x.dtype == torch.float64 and x.numel() and not torch.compiler.is_compiling():
        big = x.abs().nan_to_num(0.0, posinf=0.0).amax()
        if bool(big > torch.finfo(torch.float32).max):
            raise ValueError(f"x holds finite values beyond float32's range (max |x| = {float(big):.3g}); MXFP8 "
                             "scales are computed in float32: scale x down first")
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the last dim to be a multiple of 32, got shape {tuple(x.shape)}")
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    descale = amax / F8_E4M3_MAX
    exp = _ceil_log2(descale).clamp(-127, 127)
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp)
    bad = ~torch.isfinite(amax)
    exp = torch.where(bad, torch.full_like(exp, 128), exp)
    inv = torch.ldexp(torch.ones_like(amax), -exp)
    scaled = blocks * inv.unsqueeze(-1)
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, float("nan")), scaled)  # one NaN byte, 0x7F
    elems = to_e4m3_saturating(scaled).view(shape)
    return MXFP8Tensor(data=elems, scale=e8m0_from_exponent(exp))
