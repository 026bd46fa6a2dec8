"""MS-EDEN: unbiased NVFP4 quantization of backward operands (Quartet II, arXiv 2601.22813).

Stochastic rounding (SR) makes every element random. MS-EDEN instead rounds the elements to nearest
and puts the randomness in the E4M3 block scales: after a random Hadamard transform (RHT) of size n
along the contraction dim, each group of ``group`` elements (n by default, 128 in Quartet II) gets one
correction factor c = ⟨v, v⟩ / ⟨v, q⟩ (v the block-scaled values, q their E2M1 codes), which
makes the group's projection onto itself exact; c is folded into the group's block scales, which
are then rounded stochastically to E4M3 so that the stored scale equals the corrected one in
expectation. With the signs redrawn for every quantization the estimate is unbiased (EDEN's
argument: the projection is exact and the rotation leaves no preferred direction), and its error
is about half that of SR (docs/numerics.md, "MS-EDEN").

The arithmetic, step by step in fp32 (constants and rounding as in the authors' Triton quantizer, which
their training runs used; tests/test_ms_eden.py checks bit equality with its outputs), for v the
rotated operand [..., cols], blocks of 16 along cols:

    vmax = fp32(6 / scale_override)                        6/0.988125: the block max lands at 5.93
    s    = max((amax / fp32(scale_max)) / vmax, 2⁻¹¹⁷)     tensor decode scale (1 when amax == 0)
    e_b  = e4m3_rne_sat((amax_b / vmax) / s), and 1.0 where that is 0      block scale before correction
    y    = v / (e_b · s)                                   block-scaled values
    q    = e2m1(y), nearest with ties away from zero, saturating at ±6
    c    = fp32(N) / fp32(D) · 2⁻²¹ per group, 1 where D == 0, with the exact integer sums
           N = Σ t², D = Σ t · 2|q|, t = trunc(min(|y|, 16) · 2²²)
    e'_b = e_b · c                                          corrected scale (fp32)
    lo   = the largest E4M3 value <= e'_b, hi the next one; p = (e'_b − lo) / (hi − lo)
    ê_b  = hi if u_b < p else lo                            u_b uniform in [0, 1), one per block
    x̂    = q · ê_b · s                                      decode; ``global_scale`` stores s

``scale_max`` = 255.99 is the scale headroom: the largest pre-correction scale rounds to 256, and c
stays below 1.52 (each block holds its max, at y >= 5.7 with q = 6; the other elements can only
add terms with y/q < 5/4 near the thresholds, which gives c <= 1.23, or y/q <= 9.1/6 in blocks
whose subnormal scale rounded down by up to 1.5×), so e'_b < 390 and its upper E4M3 neighbour is
at most 416 < 448: the corrected scales never saturate and the scale SR stays unbiased. (Without
the headroom, with the max scale at 448, c = 1.22 would push it to 548.) The integer sums make c
independent of the order of summation, so a kernel reduces them in any order and gets the same
bits (as Four Over Six's integer error sums); t < 2²⁶ because |y| < 9.2 whenever amax is at least
the data's, so N < 2⁶³ for groups of up to 1024 elements. The floor 2⁻¹¹⁷ on s keeps e_b · s a normal fp32
number; tensors with amax below 2⁻¹¹⁷ · scale_max · vmax (about 9e-33) flush partly to zero.

Non-finite values: a group holding NaN or ±Inf gets NaN scales (its blocks decode to NaN), and a
non-finite amax makes ``global_scale`` NaN, as in nvfp4.py.

Random streams: the signs and the draws u come from torch Generators seeded with ms_eden_seed(seed,
step, role): (seed·M₀ + role·M₁ + step·M₂) mod 2⁶², the mixing of linear_function.sr_seed with the
role in the layer's place. The same (seed, step, role) always gives the same bits.
"""

from __future__ import annotations

import torch

from .formats import pack_nibbles, to_e4m3_saturating
from .nvfp4 import BLOCK, NVFP4Tensor
from .rht import rht

#: Quartet II's backward scale override: 17/16 keeps a block's max at or below 6 after its scale
#: rounds to nearest, and 0.93 is the authors' MSE-optimal shrink for MS-EDEN with E4M3 scales.
MS_EDEN_SCALE_OVERRIDE = (17 / 16) * 0.93
#: E4M3 target of the largest pre-correction block scale: headroom for the correction and the SR step.
MS_EDEN_SCALE_MAX = 255.99
#: Quartet II's Hadamard size (and correction group) on both backward GEMMs.
MS_EDEN_GROUP = 128
#: fixed-point fraction bits of the correction's integer sums (module docstring)
EDEN_FRACTION_BITS = 22
#: floor of the tensor decode scale: keeps e_b · s a normal fp32 number
MIN_TENSOR_SCALE = 2.0 ** -117
#: the streams one backward draws: the sign vector of each GEMM and the scale draws of each operand
ROLES = ("dgrad_signs", "wgrad_signs", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")

_SEED_MASK = 2**62 - 1
_SEED_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)  # linear_function.sr_seed's constants
# E2M1 nearest with ties away from zero: a magnitude moves up one code at each midpoint, inclusive
_RTN_AWAY = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_MAX_BYTE = 0x7E  # 448
_Y_CLAMP = 16.0


def ms_eden_seed(seed: int, step: int, role: str | int) -> int:
    """The generator seed of stream ``role`` (a name in ROLES or its index) at training step ``step``."""
    if isinstance(role, str):
        if role not in ROLES:
            raise ValueError(f"MS-EDEN role must be one of {ROLES}, got {role!r}")
        role = ROLES.index(role)
    for name, v in (("seed", seed), ("step", step), ("role", role)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"MS-EDEN {name} must be a non-negative integer, got {v!r}")
    return (seed * _SEED_MIX[0] + role * _SEED_MIX[1] + step * _SEED_MIX[2]) & _SEED_MASK


def ms_eden_generator(seed: int, step: int, role: str | int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch Generator on ``device`` seeded with ms_eden_seed(seed, step, role)."""
    return torch.Generator(device=device).manual_seed(ms_eden_seed(seed, step, role))


def ms_eden_signs(seed: int, step: int, role: str | int = "dgrad_signs", size: int = MS_EDEN_GROUP,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The ±1 fp32 RHT signs of length ``size`` for (seed, step, role): redrawn every step, the same on
    every rank (drawn on the CPU, as rht_signs)."""
    if size < 2 or size & (size - 1):
        raise ValueError(f"MS-EDEN Hadamard size must be a power of two >= 2, got {size}")
    bits = torch.randint(0, 2, (size,), generator=ms_eden_generator(seed, step, role))
    return (1.0 - 2.0 * bits.float()).to(device)


def e2m1_encode_away(v: torch.Tensor) -> torch.Tensor:
    """fp32 values to E2M1 codes (uint8, sign in bit 3), nearest with ties away from zero, saturating
    at ±6 (the authors' rounding); NaN encodes as +0."""
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t in _RTN_AWAY:
        code += (a >= t).to(torch.uint8)
    return code | ((torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3)


def _e4m3_neighbours(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) fp32: the largest E4M3 value <= c and the next one up (hi = lo = 448 for c >= 448), for
    finite c >= 0."""
    near = to_e4m3_saturating(c)
    byte = near.view(torch.uint8)
    byte = torch.where(near.float() > c, byte - 1, byte)  # c rounded up: step down one code
    up = torch.clamp(byte + 1, max=_E4M3_MAX_BYTE)
    return byte.view(torch.float8_e4m3fn).float(), up.view(torch.float8_e4m3fn).float()


def correction(y: torch.Tensor, codes: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 c per group of ``group`` consecutive elements of the last dim (module docstring), from the
    block-scaled values y and their E2M1 codes; shape y.shape[:-1] + (cols / group,)."""
    k = (codes & 7).to(torch.int64)
    # 2|q| for codes 0..7 = 0, 1, 2, 3, 4, 6, 8, 12 (arithmetic: no table lookup)
    mag2 = torch.where(k < 4, k, (4 + 2 * (k & 1)) << ((k >> 1) - 2).clamp(min=0))
    # |y| < 9.2 whenever amax >= max|v|; the clamp only bounds the sums for a smaller passed-in amax
    a = torch.where(torch.isfinite(y), y.abs().clamp(max=_Y_CLAMP), torch.zeros_like(y))
    t = (a * 2.0**EDEN_FRACTION_BITS).to(torch.int64)  # exact scaling, then truncation
    shape = y.shape[:-1] + (y.shape[-1] // group, group)
    num = (t * t).view(shape).sum(-1)
    den = (t * mag2).view(shape).sum(-1)
    c = num.float() / den.float() * 2.0 ** -(EDEN_FRACTION_BITS - 1)
    c = torch.where(den == 0, torch.ones_like(c), c)
    bad = ~torch.isfinite(y).view(shape).all(-1)
    return torch.where(bad, torch.full_like(c, float("nan")), c)


def ms_eden_tensor_scale(amax: torch.Tensor, scale_override: float = MS_EDEN_SCALE_OVERRIDE,
                         scale_max: float = MS_EDEN_SCALE_MAX) -> torch.Tensor:
    """s = max((amax / scale_max) / vmax, 2⁻¹¹⁷) in fp32; 1 for amax == 0; NaN for a non-finite amax."""
    amax = amax.float()
    # tensor / tensor: a correctly rounded fp32 division, as a kernel's div_rn
    s = amax / torch.full_like(amax, _fp32(scale_max)) / torch.full_like(amax, _fp32(6.0 / scale_override))
    s = torch.clamp(s, min=MIN_TENSOR_SCALE)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def _fp32(v: float) -> float:
    """v rounded to fp32 (as a Python float): the constants the authors' Triton kernel computes in."""
    return float(torch.tensor(v, dtype=torch.float32))


def ms_eden_parts(v: torch.Tensor, amax: torch.Tensor, group: int = MS_EDEN_GROUP,
                  scale_override: float = MS_EDEN_SCALE_OVERRIDE,
                  scale_max: float = MS_EDEN_SCALE_MAX) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deterministic half of MS-EDEN on v (fp32 [..., cols], already rotated): (E2M1 codes [...,
    cols], pre-correction scales e_b and corrected scales e'_b, fp32 [..., cols/16], tensor decode
    scale s, fp32 of amax's shape). ``amax`` is 0-d, or one per leading index of a batch of independent
    tensors (shape [B, 1, ..., 1], broadcasting against [..., cols/16]). The stochastic rounding of
    e'_b is left to the caller (quantize_ms_eden, stochastic_e4m3)."""
    cols = v.shape[-1]
    s = ms_eden_tensor_scale(amax, scale_override, scale_max)
    blocks = v.view(*v.shape[:-1], cols // BLOCK, BLOCK)
    bmax = blocks.abs().amax(-1)
    e = to_e4m3_saturating(bmax / torch.full_like(bmax, _fp32(6.0 / scale_override)) / s).float()
    e = torch.where(e == 0, torch.ones_like(e), e)
    y = blocks / (e * s).unsqueeze(-1)
    codes = e2m1_encode_away(y).view(v.shape)
    c = correction(y.view(v.shape), codes, group)
    corrected = e * c.repeat_interleave(group // BLOCK, dim=-1)
    return codes, e, corrected, s


def stochastic_e4m3(c: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn: c (fp32 >= 0) rounded to its upper E4M3 neighbour when u < (c − lo) / (hi − lo),
    else to its lower one; unbiased up to 448 (saturated above); NaN stays NaN."""
    finite = torch.isfinite(c)
    cc = torch.where(finite, c, torch.zeros_like(c))
    lo, hi = _e4m3_neighbours(cc)
    p = torch.where(hi > lo, (cc - lo) / (hi - lo), torch.zeros_like(cc))
    out = torch.where(uniforms.to(cc.device, torch.float32) < p, hi, lo)
    return torch.where(finite, out, torch.full_like(out, float("nan"))).to(torch.float8_e4m3fn)


def quantize_ms_eden(x: torch.Tensor, signs: torch.Tensor | None = None, *, group: int | None = None,
                     amax: torch.Tensor | float | None = None, uniforms: torch.Tensor | None = None,
                     generator: torch.Generator | None = None,
                     scale_override: float = MS_EDEN_SCALE_OVERRIDE,
                     scale_max: float = MS_EDEN_SCALE_MAX) -> NVFP4Tensor:
    """MS-EDEN quantization of the 2D operand x along its last dim (the GEMM's contraction dim):
    the RHT with ``signs`` (length n; None: x is already rotated), then the steps of the module
    docstring. Returns an NVFP4Tensor of the *rotated* operand (1×16 blocks, ``global_scale`` = s), so
    that a GEMM of two operands rotated with the same signs gives the product of the originals.

    group: correction group (default len(signs), or 128 without signs); a multiple of 16 dividing
    cols. amax: the rotated operand's amax to use (e.g. all-reduced across ranks). uniforms: the
    scale draws, fp32 in [0, 1), one per block [rows, cols/16]; else drawn with torch.rand from
    ``generator`` (ms_eden_generator)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"quantize_ms_eden needs a 2D floating-point tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if group is None:
        group = signs.numel() if signs is not None else MS_EDEN_GROUP
    rows, cols = x.shape
    if group % BLOCK or group > 1024 or cols % group:
        raise ValueError(f"MS-EDEN group must be a multiple of 16, at most 1024, dividing the last dim; "
                         f"got group {group} for shape {tuple(x.shape)}")
    if uniforms is not None and uniforms.shape != (rows, cols // BLOCK):
        raise ValueError(f"uniforms must have one draw per block, shape {(rows, cols // BLOCK)}, got {tuple(uniforms.shape)}")
    v = rht(x, signs) if signs is not None else x.float()
    if amax is None:
        amax_t = v.abs().amax() if v.numel() else torch.zeros((), device=v.device)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=v.device).reshape(())
    codes, _, corrected, s = ms_eden_parts(v, amax_t, group, scale_override, scale_max)
    if uniforms is None:
        uniforms = torch.rand(corrected.shape, generator=generator, device=v.device, dtype=torch.float32)
    return NVFP4Tensor(data=pack_nibbles(codes), scale=stochastic_e4m3(corrected, uniforms),
                       global_scale=s, shape=v.shape, block_shape=(1, BLOCK))


__all__ = ["MS_EDEN_GROUP", "MS_EDEN_SCALE_MAX", "MS_EDEN_SCALE_OVERRIDE", "ROLES", "correction",
           "e2m1_encode_away", "ms_eden_generator", "ms_eden_parts", "ms_eden_seed", "ms_eden_signs",
           "ms_eden_tensor_scale", "quantize_ms_eden", "stochastic_e4m3"]
