"""Element formats: FP4 E2M1 (round-to-nearest-even and stochastic), FP8 E4M3, E8M0, nibble packing.

Everything here is elementwise fp32 math with one defined result per input, so that the Triton
kernels can reproduce it bit for bit.
"""

from __future__ import annotations

import torch

F4_E2M1_MAX = 6.0
F8_E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max

#: Magnitudes of the eight non-negative E2M1 codes 0b000..0b111.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Round-to-nearest-even decision points between neighbouring grid values. A magnitude moves up one
# code when it passes a midpoint; at an exact midpoint it moves up only if the upper neighbour has
# an even mantissa (codes 0b010, 0b100, 0b110 = 1, 2, 4), hence ">=" there and ">" elsewhere.
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)  # midpoint ties stay down (lower code has even mantissa)
_RNE_INCLUSIVE = (0.75, 1.75, 3.5)  # midpoint ties go up (upper code has even mantissa)


def _grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)


def e2m1_encode_rne(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8, sign in bit 3), nearest-even, saturating at ±6.

    NaN encodes as +0 (code 0): callers mark non-finite blocks through the block scale instead.
    """
    v = v.float()
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t in _RNE_STRICT:
        code += (a > t).to(torch.uint8)
    for t in _RNE_INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    return code | (_sign_bit(v) << 3)


def _sign_bit(v: torch.Tensor) -> torch.Tensor:
    """1 for negative values and -0.0, 0 otherwise; 0 for NaN (whose sign bit is not portable)."""
    return (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8)


#: Random bits per stochastically rounded element: 8, as Blackwell's cvt.rs.satfinite.e2m1x4.f32
#: takes them (one 32-bit word of random bits for four values) and Transformer Engine feeds it.
SR_BITS = 8


def e2m1_encode_stochastic(v: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """Stochastically round fp32 values to E2M1 codes: up with probability F / 2⁸, where F is the
    distance from the lower grid neighbour over the gap in units of 2⁻⁸, rounded to nearest even.
    So E[decode(code)] = v within 2⁻⁹ of a gap for |v| <= 6 (unbiased to that resolution, and
    without a systematic direction: the error of F is nearest-even, not truncation).

    ``rbits`` holds independent random integers in [0, 2⁸), one per element; the value rounds up
    when F + rbits >= 2⁸. Saturates at ±6; NaN gives +0.
    """
    v = v.float()
    a = v.abs().clamp(max=F4_E2M1_MAX)
    grid = _grid(v.device)
    lo_idx = (a.unsqueeze(-1) >= grid[1:]).sum(-1).to(torch.uint8)  # index of largest grid <= a
    hi_idx = (lo_idx + 1).clamp(max=7)
    lo = grid[lo_idx.long()]
    hi = grid[hi_idx.long()]
    gap = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    frac = (a.double() - lo.double()) / gap.double()  # exact: fp32 difference over a power of two
    steps = torch.round(frac * 2.0**SR_BITS)  # half to even
    code = lo_idx + (steps + rbits.double() >= 2.0**SR_BITS).to(torch.uint8)
    code = torch.where(torch.isnan(v), torch.zeros_like(code), code)
    return code | (_sign_bit(v) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low nibble) to fp32 values."""
    code = code.to(torch.uint8)
    mag = _grid(code.device)[(code & 0x7).long()]
    return torch.where((code & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs of 4-bit codes along the last dim into bytes: element 2i in the low nibble,
    2i+1 in the high nibble (the order of torch.float4_e2m1fn_x2 and the FP4 tensor cores)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes into bytes")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: bytes to codes, last dim doubled."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """fp32 to float8_e4m3fn, round-to-nearest-even, clamping finite values to ±448 first
    (torch's own cast turns out-of-range values into NaN). NaN stays NaN."""
    return x.float().clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn)


def to_e4m3_round_up(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 to float8_e4m3fn: the smallest E4M3 value >= x (x > 448 gives 448; any x > 0 at
    least the smallest subnormal 2⁻⁹, so nothing underflows to 0). NaN stays NaN. The block scales of
    sr_block_scale = "up": a block's max then never maps above 6, so stochastic rounding never clips."""
    x = x.float().clamp(max=F8_E4M3_MAX)
    near = to_e4m3_saturating(x)
    below = near.float() < x  # false for NaN; never at 448 (x <= 448)
    return torch.where(below, near.view(torch.uint8) + 1, near.view(torch.uint8)).view(torch.float8_e4m3fn)


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Unbiased int exponents in [-127, 127] (or 128 meaning NaN) to float8_e8m0fnu."""
    return (exp + 127).clamp(0, 255).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu to fp32 (2**(byte - 127); byte 255 is NaN)."""
    byte = scale.view(torch.uint8).to(torch.int32)
    val = torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte - 127)
    return torch.where(byte == 255, torch.full_like(val, float("nan")), val)
