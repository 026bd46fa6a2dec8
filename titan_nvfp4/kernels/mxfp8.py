"""Triton MXFP8 quantization (sm_80+, ROCm, the CPU interpreter): one read of a 2D operand emits its
rowwise MXFP8 (1×32 blocks along K) and its columnwise MXFP8 (32-element blocks along the tokens,
stored transposed, tokens zero-padded to a multiple of 32), the operands of an MXFP8 backward.

``_mxfp8_kernel``: each program holds a [BM, BK] tile; the row blocks are its [BM, BK/32, 32] view, the
column blocks its [BM/32, 32, BK] view, so both come from registers. ``_mxfp8_cols_kernel`` emits the
column operand alone (the forward's saved Xᵀ, the backward's W) from 32 row tiles, each column block in
one thread.

The math is the reference's (numerics/mxfp8.py, RCEIL scales): scale exponent e = ceil(log2(amax /
448)) clamped to [-127, 127] (-127 for a zero block, 128 = NaN for a non-finite one), element =
e4m3_rne_sat(x · 2^-e), on fp32 bits so that every path gives the same bytes. On sm_89+ the element
rounding is the GPU's own E4M3 conversion instead (the same rounding in fewer instructions:
94% of the copy ceiling rowwise on an H100, against 75%: ``benchmarks/bench_kernels.py``); the interpreter, sm_80 and
ROCm round on fp32 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.mxfp8 import MX_BLOCK, MXFP8Tensor
from .platform import capability, interpreting
from .launch import autotune, cdiv, launch
from .nvfp4_jit import E4M3_MAX, e4m3_round, nan_to_inf_abs


@triton.jit
def _ceil_log2_div448(amax):
    """e = clamp(ceil(log2(amax / 448)), -127, 127), -127 for amax 0, 128 for amax +inf (int32)."""
    d = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    bits = d.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # normal d = 1.m · 2^(E-127): ceil(log2) = E-127 for m == 0, else E-126
    e = tl.where(mant == 0, biased - 127, biased - 126)
    # subnormal d (E == 0) lies in (0, 2^-126): ceil(log2) is -126 above 2^-127, else <= -127
    e = tl.where(biased == 0, tl.where(mant > 0x400000, -126, -127), e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(amax == float("inf"), 128, e)


@triton.jit
def _pow2_neg(e):
    """2^-e as fp32 for e in [-127, 128] (2^-127 and 2^-128 are subnormal), from its bits."""
    bits = tl.where(e <= 126, (127 - e) << 23, 0x400000 >> (e - 127))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2_pos(e):
    """The block's decode factor 2^e as fp32 (e in [-127, 127]); NaN for e = 128, a non-finite block, as
    the reference decodes it (its E8M0 byte 255 is NaN)."""
    return tl.where(e == 128, float("nan"), _pow2_neg(-e))


@triton.jit
def _to_e4m3(v, HW: tl.constexpr = False):
    """Twin of formats.to_e4m3_saturating: nearest-even E4M3 of fp32 v, ±448 saturation, NaN kept.
    HW (sm_89+): the hardware conversion (cvt.rn.satfinite, the same rounding and saturation) in place
    of the rounding on fp32 bits, which the interpreter and sm_80 need (see nvfp4_jit.e4m3_round)."""
    if HW:
        r = v.to(tl.float8e4nv)
    else:
        mag = e4m3_round(tl.minimum(tl.abs(v), E4M3_MAX))
        sign = v.to(tl.int32, bitcast=True) & -0x80000000  # -0.0 stays -0
        r = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)
    nan = tl.full(v.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)
    return tl.where(v == v, r, nan)


@triton.jit
def _mxfp8_kernel(X, M, K, sxm, sxk, RD, RS, CD, CS, Mpad, ROW: tl.constexpr, COL: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, STAGED: tl.constexpr = False, HW: tl.constexpr = False):
    """RD [M, K] e4m3 and RS [M, K/32] E8M0 bytes; CD [K, Mpad] and CS [K, Mpad/32] for xᵀ. STAGED: RD
    and CD get the dequantized values element·2^e in BF16 instead (what a BF16 GEMM reads; exact unless
    below BF16's normal range), and no scales. HW: round with the hardware E4M3 conversion (_to_e4m3)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    if ROW:
        blocks = tl.reshape(x, (BM, BK // 32, 32))
        e = _ceil_log2_div448(tl.max(nan_to_inf_abs(blocks), axis=2))  # [BM, BK/32]
        q = _to_e4m3(blocks * _pow2_neg(e)[:, :, None], HW)
        if STAGED:
            v = (q.to(tl.float32) * _pow2_pos(e)[:, :, None]).to(tl.bfloat16)
            tl.store(RD + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(v, (BM, BK)), mask=mask)
        else:
            tl.store(RD + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(q, (BM, BK)), mask=mask)
            rs = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
            tl.store(RS + rm[:, None].to(tl.int64) * (K // 32) + rs[None, :], (e + 127).to(tl.uint8),
                     mask=(rm < M)[:, None] & (rs < K // 32)[None, :])
    if COL:
        blocks = tl.reshape(x, (BM // 32, 32, BK))
        e = _ceil_log2_div448(tl.max(nan_to_inf_abs(blocks), axis=1))  # [BM/32, BK]
        q = _to_e4m3(blocks * _pow2_neg(e)[:, None, :], HW)
        cmask = (rk < K)[:, None] & (rm < Mpad)[None, :]
        if STAGED:
            v = tl.reshape((q.to(tl.float32) * _pow2_pos(e)[:, None, :]).to(tl.bfloat16), (BM, BK))
            tl.store(CD + rk[:, None].to(tl.int64) * Mpad + rm[None, :], tl.trans(v), mask=cmask)
        else:
            tl.store(CD + rk[:, None].to(tl.int64) * Mpad + rm[None, :], tl.trans(tl.reshape(q, (BM, BK))),
                     mask=cmask)
            cb = tl.program_id(0) * (BM // 32) + tl.arange(0, BM // 32)
            tl.store(CS + rk[:, None].to(tl.int64) * (Mpad // 32) + cb[None, :], tl.trans((e + 127).to(tl.uint8)),
                     mask=(rk < K)[:, None] & (cb < Mpad // 32)[None, :])


@triton.jit
def _join32(t, G: tl.constexpr, C: tl.constexpr):
    """32-tuple of [G, C] tiles -> [G, C, 32], tile i at index i: the joins only add in-thread dims."""
    a = ()
    for i in tl.static_range(16):
        a = a + (tl.join(t[i], t[i + 16]),)
    b = ()
    for i in tl.static_range(8):
        b = b + (tl.join(a[i], a[i + 8]),)
    c = ()
    for i in tl.static_range(4):
        c = c + (tl.join(b[i], b[i + 4]),)
    d = (tl.join(c[0], c[2]), tl.join(c[1], c[3]))
    return tl.reshape(tl.join(d[0], d[1]), (G, C, 32))  # index 16·d0 + 8·d1 + 4·d2 + 2·d3 + d4


@triton.jit
def _mxfp8_cols_kernel(X, M, K, sxm, sxk, CD, CS, Mpad, G: tl.constexpr, BK: tl.constexpr,
                       STAGED: tl.constexpr = False, HW: tl.constexpr = False):
    """The column operand alone (CD, CS as _mxfp8_kernel's): a program covers G 32-row blocks and BK
    features through 32 loads of [G, BK] tiles, tile i holding rows 32g + i, so that each column
    block's max, its scaling and its 32 stored values stay in one thread (no cross-warp reduction,
    no transpose through shared memory). Programs run along K first: grid axis 0 walks K, axes 1 and 2
    the row blocks (axis 2 only past CUDA's 65535 limit on axis 1; programs past the end store nothing)."""
    g0 = (tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)) * G
    blk = g0 + tl.arange(0, G)
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = (rk < K)[None, :]
    xs = ()
    for i in tl.static_range(32):
        row = blk * 32 + i
        xs = xs + (tl.load(X + row[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=kmask & (row < M)[:, None],
                           other=0.0).to(tl.float32),)
    m = nan_to_inf_abs(xs[0])
    for i in tl.static_range(1, 32):
        m = tl.maximum(m, nan_to_inf_abs(xs[i]))
    e = _ceil_log2_div448(m)  # [G, BK]
    inv = _pow2_neg(e)
    qs = ()
    for i in tl.static_range(32):
        q = _to_e4m3(xs[i] * inv, HW)
        if STAGED:
            q = (q.to(tl.float32) * _pow2_pos(e)).to(tl.bfloat16)
        qs = qs + (q,)
    vals = tl.reshape(tl.permute(_join32(qs, G, BK), (1, 0, 2)), (BK, 32 * G))  # [G, BK, 32] -> rows of xᵀ
    rt = g0 * 32 + tl.arange(0, 32 * G)
    tl.store(CD + rk[:, None].to(tl.int64) * Mpad + rt[None, :], vals, mask=(rk < K)[:, None] & (rt < Mpad)[None, :])
    if not STAGED:
        tl.store(CS + rk[None, :].to(tl.int64) * (Mpad // 32) + blk[:, None], (e + 127).to(tl.uint8),
                 mask=kmask & (blk < Mpad // 32)[:, None])


_BM, _BK = 32, 64  # fixed tiles of small inputs on a GPU
# in Triton's CPU interpreter, which pays per program: the largest tiles of the autotuned configs
_BM_I, _BK_I, _G_I = 64, 128, 2

_mxfp8_autotuned = autotune(
    [triton.Config({"BM": bm, "BK": bk}, num_warps=w)
     for bm, bk, w in ((32, 64, 1), (32, 64, 2), (32, 128, 2), (32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 8),
                       (32, 256, 4))],
    key=["M", "K", "ROW", "COL", "STAGED", "HW"])(_mxfp8_kernel)

_cols_autotuned = autotune(  # the best of a 23-config sweep on an H100, codes and staged
    [triton.Config({"G": g, "BK": bk}, num_warps=w)
     for g, bk, w in ((4, 32, 1), (2, 64, 2), (2, 64, 1), (1, 128, 2), (2, 128, 4))],
    key=["M", "K", "STAGED", "HW"])(_mxfp8_cols_kernel)


def _cols_grid(Mpad: int, K: int, G: int, BK: int) -> tuple[int, int, int]:
    """_mxfp8_cols_kernel's grid: K blocks on axis 0, the row blocks on axis 1 (and 2 past 65535)."""
    row_blocks = cdiv(Mpad // 32, G)
    return cdiv(K, BK), min(row_blocks, 65535), cdiv(row_blocks, 65535)


def hardware_e4m3(device: torch.device) -> bool:
    """Whether the kernel may round with the GPU's own E4M3 conversion: CUDA sm_89 and up (not ROCm,
    not the interpreter, which run the rounding on fp32 bits)."""
    return (device.type == "cuda" and torch.version.hip is None and not interpreting()
            and capability(device) >= (8, 9))


def quantize_mxfp8_tensors(x2d: torch.Tensor, rowwise: bool = True, colwise: bool = False, staged: bool = False):
    """(row elements [M, K] e4m3, row scales [M, K/32] e8m0, column elements [K, Mpad] e4m3, column
    scales [K, Mpad/32] e8m0); an operand not asked for comes back as empty tensors. ``staged``: the
    elements come dequantized (element·2^e) in BF16, the scales empty."""
    if x2d.dim() != 2 or not x2d.is_floating_point():
        raise ValueError(f"quantize_mxfp8: expected a 2D floating-point tensor, got {tuple(x2d.shape)} {x2d.dtype}")
    M, K = x2d.shape
    if K % MX_BLOCK:
        raise ValueError(f"quantize_mxfp8: MXFP8 needs the last dim to be a multiple of 32, got shape {tuple(x2d.shape)}")
    if x2d.numel() >= 2**31:
        raise ValueError(f"quantize_mxfp8: {x2d.numel()} elements exceed the kernel's 2^31 element limit")
    Mpad = M + (-M) % MX_BLOCK
    dev, f8, e8 = x2d.device, torch.float8_e4m3fn, torch.uint8
    ed = torch.bfloat16 if staged else f8
    rd = torch.empty((M, K) if rowwise else (0,), dtype=ed, device=dev)
    rs = torch.empty((M, K // 32) if rowwise and not staged else (0,), dtype=e8, device=dev)
    cd = torch.empty((K, Mpad) if colwise else (0,), dtype=ed, device=dev)
    cs = torch.empty((K, Mpad // 32) if colwise and not staged else (0,), dtype=e8, device=dev)
    if M and K and (rowwise or colwise):
        args = (x2d, M, K, x2d.stride(0), x2d.stride(1), rd, rs, cd, cs, Mpad)
        hw = hardware_e4m3(x2d.device)
        tuned = x2d.is_cuda and x2d.numel() >= 2**22
        if colwise and not rowwise:  # the columns alone: the 32-row-tile kernel
            cargs = (x2d, M, K, x2d.stride(0), x2d.stride(1), cd, cs, Mpad)
            grid = lambda meta: _cols_grid(Mpad, K, meta["G"], meta["BK"])  # noqa: E731
            if tuned:
                launch(_cols_autotuned, grid, *cargs, STAGED=staged, HW=hw)
            else:
                g, bk = (1, _BK) if x2d.is_cuda else (_G_I, _BK_I)
                launch(_mxfp8_cols_kernel, grid({"G": g, "BK": bk}), *cargs, G=g, BK=bk, STAGED=staged, HW=hw,
                       num_warps=2)
        elif tuned:
            grid = lambda meta: (cdiv(Mpad, meta["BM"]), cdiv(K, meta["BK"]))  # noqa: E731
            launch(_mxfp8_autotuned, grid, *args, ROW=rowwise, COL=colwise, STAGED=staged, HW=hw)
        else:
            bm, bk = (_BM, _BK) if x2d.is_cuda else (_BM_I, _BK_I)
            grid = (cdiv(Mpad, bm), cdiv(K, bk))
            launch(_mxfp8_kernel, grid, *args, ROW=rowwise, COL=colwise, BM=bm, BK=bk, STAGED=staged, HW=hw,
                   num_warps=4)
    e8m0 = torch.float8_e8m0fnu
    return rd, rs.view(e8m0), cd, cs.view(e8m0)


def quantize_mxfp8_operand(x2d: torch.Tensor, rowwise: bool = True,
                           colwise: bool = False) -> tuple[MXFP8Tensor | None, MXFP8Tensor | None]:
    """MXFP8 of x2d (1×32 along K) and of x2dᵀ (32 along the tokens, zero-padded), from one read."""
    rd, rs, cd, cs = quantize_mxfp8_tensors(x2d, rowwise, colwise)
    return (MXFP8Tensor(rd, rs) if rowwise else None), (MXFP8Tensor(cd, cs) if colwise else None)
