"""NVFP4 quantization, the reference every kernel is checked against.

The arithmetic follows Transformer Engine's NVFP4 recipe (the one the NVIDIA report trained with),
step by step in fp32:

    S   = min(6·448 / amax, FP32_MAX)            global encode scale; S = 1 when amax == 0
    e_b = e4m3_rne_sat(amax_b · (S · fp32(1/6)))   block decode scale, stored as float8_e4m3fn
    r_b = min(1 / (float(e_b) · (1/S)), FP32_MAX)  block encode factor
    q   = e2m1(x · r_b)                           nearest-even or stochastic, saturating at ±6
    x̂   = q · float(e_b) · (1/S)                  decode; `global_scale` stores 1/S

Edge cases (defined here, tested in tests/test_nvfp4_numerics.py):
  * amax == 0 (all zeros): S = 1, every scale and code is 0, x̂ = 0.
  * a block of zeros, or a block whose scale underflows E4M3 (amax_b·S/6 < 2⁻¹⁰): e_b = 0, the
    block decodes to exact zeros (codes may be saturated, as in Transformer Engine; they are
    multiplied by a zero scale).
  * a passed-in amax smaller than the data's: block scales saturate at 448 and codes at ±6.
  * e_b rounds to nearest, so a block's largest element may map slightly above 6 (by up to half
    an E4M3 step, 6.25%) and saturate; stochastic rounding is unbiased for everything else.
    ``sr_block_scale="up"`` (stochastic rounding only) rounds e_b up instead, to the smallest E4M3
    value >= amax_b·(S·fp32(1/6)) (formats.to_e4m3_round_up; the top block's stays 448): nothing
    saturates, so the mean of many draws converges to x (tests/test_sr_block_scale.py), at ~13% more
    error per draw. A block below E4M3's range then gets the smallest scale 2⁻⁹ instead of 0.
  * NaN or ±Inf in a block: that block's scale is E4M3 NaN, so it decodes to NaN and any GEMM that
    reads it yields NaN. A non-finite amax makes `global_scale` NaN: the whole tensor decodes to
    NaN. Non-finite inputs never produce finite garbage (Transformer Engine would saturate them).

Four Over Six (``four_over_six=True``; arXiv 2512.02010): every block is encoded twice, its max scaled
to 6 and to 4, and keeps the candidate with the lower error. The tensor scale becomes S = 6·256/amax,
so that the "4" candidate's scale (1.5× the "6" one, at most 384) stays inside E4M3:

    e_b⁶ = e4m3(amax_b · (S · fp32(1/6)))     e_b⁴ = e4m3(amax_b · (S · 0.25))
    err  = Σ_i D_i², D_i = min(⌊|y_i − g_i · float(e_b)| · 2¹⁰ / u⌋, 2047)   (int32, exact)

with y_i = |x_i| · S, g_i the nearest-even E2M1 magnitude of x_i · r_b, and u = 2^⌊log₂(amax_b · S)⌋.
The "4" candidate wins only if its err is strictly lower and its scale is not 0. The error is the
squared quantization error in units of 2⁻¹⁰·u, truncated to an integer so that every backend sums it
exactly, in any order and with or without fused multiply-adds (a float sum would let an FMA or a
tree reduction flip near-ties between the reference and a kernel). The choice is always made on the
nearest-even encodings, also when the block is then encoded stochastically, so that stochastic
rounding stays unbiased given the chosen scale (choosing on a random draw would not be). With
``sr_block_scale="up"`` both candidates' scales are rounded up (the "4" one's, at most 384, stays in
range), and the choice is made between those: neither candidate then clips.
"""

from __future__ import annotations

from dataclasses import dataclass

import math
import numbers

import torch

from .formats import (
    F4_E2M1_MAX,
    F8_E4M3_MAX,
    FP32_MAX,
    SR_BITS,
    e2m1_decode,
    e2m1_encode_rne,
    e2m1_encode_stochastic,
    pack_nibbles,
    to_e4m3_round_up,
    to_e4m3_saturating,
    unpack_nibbles,
)

BLOCK = 16
_INV6_F32 = 0.1666666716337204  # fp32(1/6), written out so that no rounding of 1/6 depends on the op
#: E4M3 max of the "6" candidate's block scales under Four Over Six (the "4" one reaches 1.5× that)
F8_E4M3_MAX_FOUR_OVER_SIX = 256.0
#: the error unit of Four Over Six: D_i counts 2^-10 of the block's power-of-two magnitude u, capped
FOS_FRACTION_BITS = 10
FOS_D_MAX = 2047
#: Block shapes: (1, 16) rowwise along the last dim; (16, 1) along dim 0 (stored transposed, so the
#: packed codes run along dim 0 of x); (16, 16) square tiles whose quantization is transpose-symmetric.
BLOCK_SHAPES = ((1, BLOCK), (BLOCK, 1), (BLOCK, BLOCK))
#: How the block scales of a stochastically rounded tensor round (recipe key sr_block_scale): to nearest
#: (the published recipe) or up (no element clips, so the rounding is unbiased; module docstring)
SR_BLOCK_SCALES = ("nearest", "up")


def global_encode_scale(amax: torch.Tensor, four_over_six: bool = False) -> torch.Tensor:
    """S = 6·448/amax (6·256/amax with ``four_over_six``) in fp32, capped at FP32_MAX; 1 for
    amax == 0; NaN for a non-finite amax."""
    amax = amax.float()
    # python scalars, not torch.tensor(...): no host-to-device copy (which would stall a GPU stream);
    # 2688, 1536 and fp32(1/6) are exact fp32 values, so the arithmetic is the same fp32 arithmetic
    # full_like fills on the device; `2688.0 / amax` would be reciprocal(amax) * 2688 (not IEEE division)
    top = F4_E2M1_MAX * (F8_E4M3_MAX_FOUR_OVER_SIX if four_over_six else F8_E4M3_MAX)
    s = torch.clamp(torch.full_like(amax, top) / amax, max=FP32_MAX)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def block_decode_scale(block_amax: torch.Tensor, s_enc: torch.Tensor, to_four: bool = False,
                       round_up: bool = False) -> torch.Tensor:
    """e_b = e4m3(amax_b · (S · fp32(1/6))), or with ``to_four`` e4m3(amax_b · (S · 0.25)) (Four Over
    Six's second candidate); rounded to nearest, or with ``round_up`` up (sr_block_scale = "up"); NaN for
    non-finite blocks; returns float8_e4m3fn."""
    to_e4m3 = to_e4m3_round_up if round_up else to_e4m3_saturating
    e = to_e4m3(block_amax.float() * (s_enc * (0.25 if to_four else _INV6_F32)))
    bad = ~torch.isfinite(block_amax) | ~torch.isfinite(s_enc)
    nan = torch.full_like(block_amax, float("nan"), dtype=torch.float32).to(torch.float8_e4m3fn)
    return torch.where(bad, nan, e)


def block_encode_factor(e_b: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """r_b = min(1 / (float(e_b) · (1/S)), FP32_MAX): what each element is multiplied by before E2M1."""
    s_dec = torch.reciprocal(s_enc)
    return torch.clamp(torch.reciprocal(e_b.float() * s_dec), max=FP32_MAX)


def four_over_six_error(blocks: torch.Tensor, e_b: torch.Tensor, s_enc: torch.Tensor,
                        block_amax: torch.Tensor) -> torch.Tensor:
    """int32 error of encoding ``blocks`` (fp32 [..., n], one block per row) nearest-even with scales
    ``e_b`` [...] (module docstring: Σ D_i²). Non-finite blocks give meaningless values (never chosen)."""
    e32 = e_b.float().unsqueeze(-1)
    g = e2m1_decode(e2m1_encode_rne(blocks * block_encode_factor(e_b, s_enc).unsqueeze(-1))).abs()
    d = (blocks.abs() * s_enc - g * e32).abs()
    # p = 2^10 / u as fp32 bits: the exponent field of amax_b·S, kept where the power of two is normal
    ab_bits = (block_amax.float() * s_enc).view(torch.int32)
    exp = ((ab_bits >> 23) & 0xFF).clamp(min=10, max=253)
    p = ((264 - exp) << 23).view(torch.float32).unsqueeze(-1)
    t = torch.clamp(d * p, max=float(FOS_D_MAX))
    dq = torch.where(t == t, t, torch.zeros_like(t)).to(torch.int32)  # truncation: ⌊t⌋ for t ≥ 0
    return (dq * dq).sum(dim=-1, dtype=torch.int32)


def four_over_six_scales(blocks: torch.Tensor, s_enc: torch.Tensor, round_up: bool = False) -> torch.Tensor:
    """Four Over Six's block decode scales (float8_e4m3fn [...]) for ``blocks`` (fp32 [..., n]) under the
    tensor encode scale ``s_enc`` (global_encode_scale(amax, four_over_six=True)): per block the
    candidate, max to 6 or to 4, with the lower four_over_six_error; ``round_up``: both candidates'
    scales rounded up (block_decode_scale)."""
    bamax = blocks.abs().amax(dim=-1)
    e6 = block_decode_scale(bamax, s_enc, round_up=round_up)
    e4 = block_decode_scale(bamax, s_enc, to_four=True, round_up=round_up)
    err6 = four_over_six_error(blocks, e6, s_enc, bamax)
    err4 = four_over_six_error(blocks, e4, s_enc, bamax)
    return torch.where((e4.float() != 0) & (err4 < err6), e4, e6)


def refuse_grad(fn: str, **tensors) -> None:
    """Refuse a tensor argument that requires grad while grad mode is on: quantization is not differentiable.

    NVFP4Tensor and MXFP8Tensor are plain containers of integer codes and scales, outside the autograd graph
    (as TorchAO's NVFP4Tensor, built with requires_grad=False); autograd could only reach x through the
    scales, a partial and meaningless gradient. A straight-through estimator (Transformer Engine's FP8 cast)
    would need a tensor subclass in the graph, and the recipe's gradient path (stochastic rounding of dY, the
    RHT of wgrad) belongs to nvfp4_linear, so the quantizers say so instead of returning half a graph."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{fn}: {name} requires grad, but quantization is not differentiable (its codes and "
                             f"scales carry no gradient to {name}); pass {name}.detach() or call it under "
                             "torch.no_grad(), and train through nvfp4_linear / NVFP4Linear, whose backward quantizes "
                             "the gradients itself")


def check_out_dtype(dtype) -> None:
    """A dequantized tensor is floating point: refuse an integer, bool or non-dtype ``dtype`` instead of truncating."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize needs a floating-point torch.dtype, got {dtype!r}")


@dataclass
class NVFP4Tensor:
    """A quantized tensor: packed E2M1 codes, E4M3 block scales, and the fp32 global decode scale.

    Storage is a 2D matrix whose rows hold consecutive 16-element blocks along its last dim:
    x reshaped to (-1, shape[-1]) for block shapes (1, 16) and (16, 16), and xᵀ for (16, 1).
    ``data`` is (rows, cols/2) uint8; ``scale`` is (rows, cols/16), or (rows/16, cols/16) for
    16×16 tiles; ``global_scale`` is a 0-d fp32 tensor equal to 1/S.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    block_shape: tuple[int, int]

    @property
    def transposed(self) -> bool:
        """True when the storage holds xᵀ (blocks of 16 along dim 0 of x)."""
        return tuple(self.block_shape) == (BLOCK, 1)

    @property
    def storage_shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1] * 2)

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes (uint8) in the storage layout."""
        return unpack_nibbles(self.data)

    def row_scales(self) -> torch.Tensor:
        """E4M3 block scales expanded to one per (storage row, 16-column block)."""
        if tuple(self.block_shape) == (BLOCK, BLOCK):
            return self.scale.repeat_interleave(BLOCK, dim=0)
        return self.scale

    def scaled_codes(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q · e_b in the storage layout, without the global scale: exact in fp32, bf16 and fp16
        (a 2-significant-bit code times a 4-bit-significand scale), the operand an emulated FP4
        tensor core multiplies."""
        check_out_dtype(dtype)
        rows, cols = self.storage_shape
        vals = e2m1_decode(self.codes()).view(rows, cols // BLOCK, BLOCK)
        out = vals * self.row_scales().float().unsqueeze(-1)
        return out.view(rows, cols).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x̂ = q · e_b · global_scale, in x's shape."""
        check_out_dtype(dtype)
        out = self.scaled_codes(torch.float32) * self.global_scale.float()
        if self.transposed:
            out = out.t()
        return out.reshape(self.shape).to(dtype)

    def t(self) -> "NVFP4Tensor":
        """The same quantized values as an NVFP4Tensor of xᵀ; for 16×16 tiles this is exact
        (the tiles of xᵀ are the transposed tiles of x), which is why weights use them."""
        if tuple(self.block_shape) != (BLOCK, BLOCK) or len(self.shape) != 2:
            raise ValueError(f"only 2D tensors with 16x16 blocks transpose exactly, got block_shape={self.block_shape}")
        codes = self.codes().t().contiguous()
        return NVFP4Tensor(
            data=pack_nibbles(codes),
            scale=self.scale.t().contiguous(),
            global_scale=self.global_scale,
            shape=torch.Size((self.shape[1], self.shape[0])),
            block_shape=(BLOCK, BLOCK),
        )


def _as_storage(x: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """x as the 2D fp32 storage matrix, after checking that its dims fit the block shape."""
    if not x.is_floating_point():
        raise TypeError(f"NVFP4 quantization needs a floating-point tensor, got {x.dtype}")
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"block_shape must be one of {BLOCK_SHAPES}, got {block_shape}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor to NVFP4")
    if block_shape != (1, BLOCK) and x.dim() != 2:
        raise ValueError(f"block_shape {block_shape} needs a 2D tensor, got shape {tuple(x.shape)}")
    if block_shape == (1, BLOCK):
        if x.shape[-1] % BLOCK:
            raise ValueError(f"NVFP4 1x16 blocks need the last dim to be a multiple of 16, got shape {tuple(x.shape)}")
        return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()  # explicit: -1 is ambiguous if numel is 0
    if block_shape == (BLOCK, 1):
        if x.shape[0] % BLOCK:
            raise ValueError(f"NVFP4 16x1 blocks need dim 0 to be a multiple of 16, got shape {tuple(x.shape)}")
        return x.t().float()
    if x.shape[0] % BLOCK or x.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 16x16 blocks need both dims to be multiples of 16, got shape {tuple(x.shape)}")
    return x.float()


def _check_quantize_args(x, block_shape, stochastic, seed, generator, four_over_six,
                         sr_block_scale) -> tuple[int, int]:
    """quantize_nvfp4's arguments other than amax checked by type (a clear error, not a deep one); block_shape as a tuple."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_nvfp4: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2:
        raise ValueError(f"block_shape must be one of {BLOCK_SHAPES}, got {block_shape!r}")
    for name, flag in (("stochastic", stochastic), ("four_over_six", four_over_six)):
        if not isinstance(flag, bool):
            raise TypeError(f"quantize_nvfp4: {name} must be True or False, got {flag!r}")
    check_sr_block_scale(sr_block_scale, stochastic, "quantize_nvfp4")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise ValueError(f"quantize_nvfp4: seed must be an integer in [-2**63, 2**64), got {seed!r}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"quantize_nvfp4: generator must be a torch.Generator, got {type(generator).__name__}")
        if seed is not None:
            raise ValueError("quantize_nvfp4: pass seed or generator, not both (the generator would ignore the seed)")
        if stochastic and generator.device.type != x.device.type:
            raise ValueError(f"quantize_nvfp4: generator is on {generator.device}, x on {x.device}: "
                             "stochastic rounding draws on x's device")
    return tuple(block_shape)


def check_sr_block_scale(sr_block_scale, stochastic: bool, where: str) -> None:
    """Refuse an sr_block_scale outside SR_BLOCK_SCALES, and "up" without stochastic rounding (it is defined to
    make stochastic rounding unbiased; for nearest-even the clipping it avoids is a deterministic error anyway)."""
    if sr_block_scale not in SR_BLOCK_SCALES:
        raise ValueError(f"{where}: sr_block_scale must be one of {list(SR_BLOCK_SCALES)}, got {sr_block_scale!r}")
    if sr_block_scale == "up" and not stochastic:
        raise ValueError(f"{where}: sr_block_scale='up' rounds the block scales of stochastically rounded "
                         "operands, and nothing here is rounded stochastically (it would do nothing)")


def _random_bits_like(a: torch.Tensor, seed: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """SR_BITS random bits per element of a (int32), from ``generator`` or a fresh one seeded with ``seed``.
    On the meta device (shape inference) no number is drawn, so the seed has nothing to seed."""
    if a.is_meta:
        return torch.empty(a.shape, dtype=torch.int32, device=a.device)
    if generator is None and seed is not None:
        generator = torch.Generator(device=a.device).manual_seed(int(seed))
    return torch.randint(0, 2**SR_BITS, a.shape, generator=generator, device=a.device, dtype=torch.int32)


def _given_amax(amax: torch.Tensor | float, a: torch.Tensor, eager: bool) -> torch.Tensor:
    """A caller's tensor amax as a 0-d fp32 tensor on ``a``'s device; in eager mode, checked against ``a``."""
    if not isinstance(amax, (torch.Tensor, numbers.Real)) or isinstance(amax, bool):
        raise TypeError(f"amax must be a real number or a one-element tensor, got {type(amax).__name__}")
    if isinstance(amax, torch.Tensor):
        if amax.is_complex() or amax.dtype == torch.bool:
            raise TypeError(f"amax must be a real number or a one-element tensor, got a {amax.dtype} tensor")
        if amax.numel() != 1:
            raise ValueError(f"amax must hold one value (a number or a 0-d tensor), got shape {tuple(amax.shape)}")
        if amax.device.type == "meta" and a.device.type != "meta":
            raise ValueError(f"amax is on the meta device (it holds no value); x is on {a.device}")
        if eager and amax.dtype == torch.float64 and not amax.is_meta:  # wider than fp32: one more sync
            _check_fp32_range(float(amax.reshape(())))
    else:
        _check_fp32_range(amax)
    amax_t = torch.as_tensor(amax, dtype=torch.float32, device=a.device).reshape(())
    if eager and a.device.type != "meta" and bool(amax_t <= 0):  # one sync; inf and NaN pass (NaN decode)
        given = float(amax) if not isinstance(amax, torch.Tensor) else float(amax.reshape(()))
        if given < 0:
            raise ValueError(f"amax must be non-negative, got {given}")
        x_amax = float(a.abs().amax()) if a.numel() else 0.0
        if x_amax > 0:
            zero = "amax = 0" if given == 0 else f"amax = {given:g} rounds to 0 in float32"
            raise ValueError(f"{zero} but x has non-zero values (max |x| = {x_amax:.3g}); pass x's amax, or None "
                             "to take it from x")
    return amax_t


def _check_fp32_range(value) -> None:
    """A given amax that float32 (the scales' arithmetic) cannot hold, named instead of turned into inf."""
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float
        raise ValueError(f"amax = an integer of {len(str(abs(value)))} digits is beyond float32's range (max "
                         f"{FP32_MAX:.3e}): NVFP4 scales are computed in float32; scale x and amax down together") from None
    if math.isfinite(v) and abs(v) > FP32_MAX:
        raise ValueError(f"amax = {v:.3g} is beyond float32's range (max {FP32_MAX:.3e}): NVFP4 scales are "
                         "computed in float32; scale x and amax down together")


def quantize_nvfp4(
    x: torch.Tensor,
    block_shape: tuple[int, int] = (1, BLOCK),
    stochastic: bool = False,
    seed: int | None = None,
    amax: torch.Tensor | float | None = None,
    generator: torch.Generator | None = None,
    four_over_six: bool = False,
    *,
    sr_block_scale: str = "nearest",
) -> NVFP4Tensor:
    """Quantize x to NVFP4 (see the module docstring for the exact arithmetic).

    block_shape: (1, 16), (16, 1) or (16, 16). stochastic: stochastic rounding of the elements
    (scales round to nearest unless sr_block_scale="up"), reproducible with ``seed`` or a ``generator``
    (on the meta device, shape inference, nothing is drawn and the seed is not used). amax: a global amax to use instead of
    max|x| (e.g. one all-reduced across ranks), within float32's range. four_over_six: each block's
    scale from the Four Over Six rule (module docstring). sr_block_scale: with ``stochastic``, "up" rounds
    the block scales up instead of to nearest, so that no element clips (module docstring).

    Not differentiable: an x (or amax) that requires grad, with grad mode on, is refused (refuse_grad says
    why); quantize ``x.detach()``, or train through nvfp4_linear / NVFP4Linear.
    """
    block_shape = _check_quantize_args(x, block_shape, stochastic, seed, generator, four_over_six, sr_block_scale)
    refuse_grad("quantize_nvfp4", x=x, amax=amax)
    eager = not torch.compiler.is_compiling()  # checks with data-dependent branches stay out of graphs
    if eager and x.dtype == torch.float64 and x.numel():
        big = x.abs().nan_to_num(0.0, posinf=0.0).amax()
        if bool(big > torch.finfo(torch.float32).max):
            raise ValueError(f"x holds finite values beyond float32's range (max |x| = {float(big):.3g}); NVFP4 "
                             "scales are computed in float32: scale x down first")
    a = _as_storage(x, block_shape)
    rows, cols = a.shape
    if amax is None:
        amax_t = a.abs().amax() if a.numel() else torch.zeros((), device=a.device)
    else:
        amax_t = _given_amax(amax, a, eager)
    s_enc = global_encode_scale(amax_t, four_over_six)
    up = sr_block_scale == "up"

    if block_shape == (BLOCK, BLOCK):
        tiles = a.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        if four_over_six:
            e_b = four_over_six_scales(tiles.permute(0, 2, 1, 3).reshape(rows // BLOCK, cols // BLOCK, -1), s_enc,
                                       round_up=up)
        else:
            e_b = block_decode_scale(tiles.abs().amax(dim=(1, 3)), s_enc, round_up=up)  # (rows/16, cols/16)
        factor = block_encode_factor(e_b, s_enc).repeat_interleave(BLOCK, dim=0)
    else:
        blocks = a.view(rows, cols // BLOCK, BLOCK)
        if four_over_six:
            e_b = four_over_six_scales(blocks, s_enc, round_up=up)
        else:
            e_b = block_decode_scale(blocks.abs().amax(dim=-1), s_enc, round_up=up)
        factor = block_encode_factor(e_b, s_enc)
    v = (a.view(rows, cols // BLOCK, BLOCK) * factor.unsqueeze(-1)).view(rows, cols)
    if stochastic:
        codes = e2m1_encode_stochastic(v, _random_bits_like(v, seed, generator))
    else:
        codes = e2m1_encode_rne(v)
    return NVFP4Tensor(
        data=pack_nibbles(codes),
        scale=e_b,
        global_scale=torch.reciprocal(s_enc),
        shape=x.shape,
        block_shape=block_shape,
    )


# -- 16×16 weights quantized one row shard at a time (FSDP2's NVFP4 all-gather) -----------------------
# A shard holds rows [offset, offset + rows) of W [N, K]; a 16×16 tile may straddle two shards. Each
# rank reduces its rows into the whole tile-amax grid, the ranks all-reduce (max) it, and every rank
# then derives the same scales and encodes its own rows: bit-identical to quantize_nvfp4(W, (16, 16)).

def tile_amax_of_rows(rows: torch.Tensor, offset: int, n_rows: int) -> torch.Tensor:
    """fp32 [n_rows/16, K/16]: the tile amaxes of W that rows [offset, offset + len(rows)) reach
    (0 for tiles they do not touch; +inf for tiles with NaN or ±Inf, so that a max-reduce keeps them).
    Rows past ``n_rows`` (FSDP2's padding of the last shard) are ignored."""
    n, k = rows.shape
    if k % BLOCK or n_rows % BLOCK:
        raise ValueError(f"16x16 tiles need both weight dims to be multiples of 16, got [{n_rows}, {k}]")
    keep = max(0, min(n, n_rows - offset))
    grid = torch.zeros(n_rows // BLOCK, k // BLOCK, dtype=torch.float32, device=rows.device)
    if keep == 0:
        return grid
    a = rows[:keep].float().abs().view(keep, k // BLOCK, BLOCK).amax(dim=-1)
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    tile = (torch.arange(offset, offset + keep, device=rows.device) // BLOCK).unsqueeze(1).expand(keep, k // BLOCK)
    return grid.scatter_reduce_(0, tile, a, reduce="amax")


def tile_scales(tile_amax: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 tile scales e_b, fp32 global encode scale S) of a weight from its whole tile-amax grid;
    the decode scale NVFP4Tensor stores is 1/S, as in quantize_nvfp4. ``amax``: the tensor amax to
    use instead of the grid's max (a tensor-parallel shard's: the whole weight's)."""
    if amax is None:
        amax = tile_amax.amax() if tile_amax.numel() else tile_amax.new_zeros(())
    s_enc = global_encode_scale(amax)
    return block_decode_scale(tile_amax, s_enc), s_enc


def encode_tile_rows(rows: torch.Tensor, offset: int, e_b: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes (uint8 [len(rows), K/2], nearest-even) of rows [offset, …) of a 16×16-tiled
    weight whose tile scales and encode scale are ``e_b`` and ``s_enc`` (tile_scales). Padding rows
    past the weight encode as 0."""
    n, k = rows.shape
    keep = max(0, min(n, e_b.shape[0] * BLOCK - offset))
    codes = torch.zeros(n, k, dtype=torch.uint8, device=rows.device)
    if keep:
        factor = block_encode_factor(e_b, s_enc)
        factor = factor.repeat_interleave(BLOCK, dim=0)[offset:offset + keep]
        v = rows[:keep].float().view(keep, k // BLOCK, BLOCK) * factor.unsqueeze(-1)
        codes[:keep] = e2m1_encode_rne(v.view(keep, k))
    return pack_nibbles(codes)
