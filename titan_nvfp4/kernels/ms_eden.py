"""Triton kernels of the MS-EDEN backward operand quantizer (Quartet II): the twin, bit for bit, of
numerics/ms_eden_operand.ms_eden_operand under the same Philox streams (tests/test_ms_eden_kernel.py).

Two passes over ``values`` [R, C] (any float dtype, any strides: a transposed view is read as it is), or
over an NVFP4 storage's codes read in place (CODES: packed uint8 codes, E4M3 block scales, 1×16 or 16×16
tiles, the operand its q·e_b or, with TRANS, their transpose; each element decoded exactly in fp32, so the
bits are those of the same values given staged):
``_amax_kernel`` folds max|rotated x| into one fp32 (bits in int32, atomic max; non-finite -> +inf), and
``_quantize_kernel`` emits the codes and E4M3 scales (or the emulated GEMM's staged fp16 values q·ê_b)
plus the tensor decode scale s, computed on the device from the amax (no host sync). A program takes a
tile of BR rows × SIZE columns, one correction group per row: x·pre_scale (fp32), zero padding past C,
sign flip, log2(SIZE) butterfly stages in the reference's order (rht.rht), × rht_norm(SIZE), then the
steps of numerics/ms_eden.py.

Layout: each thread holds whole rows of its tile, as SIZE/16 blocks [BR, 16] whose 16 columns are in the
thread (loaded 16 bytes at a time along a row, or as [16, BR] a row per thread from a transposed view), so
the butterflies are in-thread adds (stages h < 16 within a block, the others between blocks), and every
per-block quantity (block max, scales, correction, Philox draw) is computed once, by the thread that needs
it. (Reshaping a loaded [BR, SIZE] tile instead let Triton spread a block over 16 lanes: every per-block
step ran 16 times and the butterflies were shuffles, 265-294 SASS instructions per element against ~60.)

Bits: the kernels compile without fp fusion (an fma would change bits); the divisions of the reference are
div_rn, except y = v / (e_b·s) per element, taken as v times the fp64 reciprocal rounded once to fp32, the
same fp32 wherever t and the code depend on it (e2m1_of_quotient). The correction's sums are int64, exact in
any order. Signs: tl.randint(sign_seed, i), -1 where the word's top bit is set; draw of block (r, j):
tl.randint(draw_seed, r·Cpad/16 + j) >> 8, × 2⁻²⁴.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..numerics.ms_eden import MIN_TENSOR_SCALE, MS_EDEN_SCALE_MAX, MS_EDEN_SCALE_OVERRIDE, ms_eden_tensor_scale
from ..numerics.ms_eden_operand import check_operand_args, padded_cols
from ..numerics.rht import rht_norm
from .launch import cdiv, launch
from .nvfp4_jit import e4m3_round
from .platform import interpreting


def _f32(v: float) -> float:
    """v rounded to fp32, as a Python float (the reference's constants)."""
    return float(torch.tensor(v, dtype=torch.float32))


VMAX = tl.constexpr(_f32(6.0 / MS_EDEN_SCALE_OVERRIDE))
SCALE_MAX = tl.constexpr(_f32(MS_EDEN_SCALE_MAX))
MIN_S = tl.constexpr(MIN_TENSOR_SCALE)
#: warps per program on a GPU; elements per program tile in the CPU interpreter (few programs)
WARPS, TILE_CPU = 4, 8192


@triton.jit
def _e2m1_value(nib):
    """fp32 value (exact, -0 kept) of the E2M1 codes in the low 4 bits of int32 ``nib`` (sign bit 3): the code's
    bits placed as an fp32's exponent and mantissa make the value times 2⁻¹²⁶ (bias 1 against 127; 0.5 becomes a
    subnormal, exact), one multiply undoes it."""
    return (((nib & 7) << 22) | ((nib & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2¹²⁶


@triton.jit
def _e2m1_half(code):
    """fp16 value (exact, -0 kept) of E2M1 codes (int32, sign bit 3): the bits placed in an fp16 make the value
    times 2⁻¹⁴ (bias 1 against 15; 0.5 becomes a subnormal, exact), one multiply undoes it."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def _e4m3_value(b):
    """fp32 value of any E4M3 byte (int32 0..255): signed, subnormals exact, 0x7F / 0xFF NaN; as _e2m1_value, the
    byte's bits placed in an fp32 make the value times 2⁻¹²⁰."""
    v = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2¹²⁰
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _zip(parts, BR: tl.constexpr, W: tl.constexpr):
    """[BR, W] whose column j is parts[j] (a tuple of W [BR] tensors, W a power of two): in-thread joins."""
    for lv in tl.static_range(W.bit_length() - 1):
        nxt = ()
        for m in tl.static_range(W >> (lv + 1)):
            j = tl.join(parts[m], parts[m + (W >> (lv + 1))])  # [.., x, 2]: column 2x + (0, 1) of the next level
            nxt = nxt + (j if lv == 0 else tl.reshape(j, (BR, 2 << lv)),)
        parts = nxt
    return parts[0]


@triton.jit
def _cat(parts, BR: tl.constexpr, N: tl.constexpr):
    """[BR, N · n]: the N tensors [BR, n] of ``parts`` side by side (N a power of two): in-thread joins."""
    for lv in tl.static_range(N.bit_length() - 1):
        nxt = ()
        for m in tl.static_range(N >> (lv + 1)):
            a = parts[2 * m]
            nxt = nxt + (tl.reshape(tl.permute(tl.join(a, parts[2 * m + 1]), (0, 2, 1)), (BR, 2 * a.shape[1])),)
        parts = nxt
    return parts[0]


@triton.jit
def _block_max(a, BR: tl.constexpr):
    """[BR] max over the 16 columns of a [BR, 16] (exact; NaN if the row holds one): in-thread halvings."""
    for lv in tl.static_range(4):
        if lv < 3:
            lo, hi = tl.split(tl.reshape(a, (BR, 8 >> lv, 2)))
        else:
            lo, hi = tl.split(a)
        a = tl.maximum(lo, hi, propagate_nan=tl.PropagateNan.ALL)
    return a


#: Triton's coalescing lays out a tile whose dimensions are equally contiguous with the first one fastest up to
#: 3.6 and the last one fastest in 3.9 (getOrderFromContiguity's ties); _tile_load puts the rows there
_ROWS_FIRST = tl.constexpr(tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7))


@triton.jit
def _tile_load(P, row_offs, col_offs, mask):
    """[BR, W] of P at row_offs[:, None] + col_offs[None, :] under ``mask`` (0 elsewhere), each row in one thread
    whatever the strides: the offsets are declared without contiguity and the rows laid out fastest, so a thread
    loads its row's elements one by one (a row spread over lanes would turn every later step into shuffles)."""
    if _ROWS_FIRST:
        offs = tl.max_contiguous(row_offs[:, None] + col_offs[None, :], [1, 1])
        return tl.load(P + offs, mask=mask, other=0)
    else:
        offs = tl.max_contiguous(col_offs[:, None] + row_offs[None, :], [1, 1])
        return tl.trans(tl.load(P + offs, mask=tl.trans(mask), other=0))


@triton.jit
def _operand_blocks(X, S, PRE, rows, R, C, sxr, sxc, ssr, ssc, c0, HAS_PRE: tl.constexpr, CODES: tl.constexpr,
                    TRANS: tl.constexpr, TILE_DIV: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr,
                    SIZE: tl.constexpr):
    """Columns c0 .. c0 + SIZE - 1 of rows ``rows`` of the operand, × pre_scale, 0 outside [R, C]: a tuple of
    SIZE / 16 fp32 blocks [BR, 16], each row of a block in one thread. X read as values (VEC > 1: rows of
    contiguous columns, VEC at a time; else _tile_load), or (CODES) e2m1(q)·e_b of packed codes X and E4M3 scale
    bytes S at storage (i, j) = (row, col), or (col, row) with TRANS; scale row i // TILE_DIV (16: 16×16 tiles)."""
    rin = rows < R
    r64 = rows.to(tl.int64)
    out = ()
    for b in tl.static_range(SIZE // 16):
        cb = c0 + b * 16  # a multiple of 16
        cols = cb + tl.arange(0, 16)
        inside = rin[:, None] & (cols < C)[None, :]
        if CODES:
            if TRANS:  # element (r, c) at storage (c, r)
                byte = _tile_load(X, (r64 >> 1) * sxc, cols * sxr, inside).to(tl.int32)
                nib = byte >> ((rows & 1) * 4)[:, None]
                if TILE_DIV == 16:
                    sb = tl.load(S + (cb // 16) * ssr + (r64 >> 4) * ssc, mask=rin & (tl.broadcast_to(cb, [BR]) < C),
                                 other=0).to(tl.int32)[:, None]
                else:  # 1×16 blocks along the storage rows: a scale per column
                    sb = _tile_load(S, (r64 >> 4) * ssc, cols * ssr, inside).to(tl.int32)
            else:  # a block's 8 code bytes (VEC > 1: one 8-byte load), and its scale byte
                wc = (cb >> 1) + tl.arange(0, 8)
                if VEC > 1:
                    byte = tl.load(X + r64[:, None] * sxr + wc[None, :] * sxc,
                                   mask=rin[:, None] & (wc * 2 < C)[None, :], other=0)
                else:
                    byte = _tile_load(X, r64 * sxr, wc * sxc, rin[:, None] & (wc * 2 < C)[None, :])
                byte = byte.to(tl.int32)
                nib = tl.reshape(tl.join(byte, byte >> 4), (BR, 16))  # column 2i in the low nibble
                sb = tl.load(S + (r64 // TILE_DIV) * ssr + (cb >> 4) * ssc, mask=rin & (tl.broadcast_to(cb, [BR]) < C),
                             other=0).to(tl.int32)[:, None]
            x = tl.where(inside, _e2m1_value(nib) * _e4m3_value(sb), 0.0)
        elif VEC > 1:
            chunks = ()
            for q in tl.static_range(16 // VEC):
                cq = cb + q * VEC + tl.arange(0, VEC)
                mq = rin[:, None] & (cq < C)[None, :]
                chunks = chunks + (tl.load(X + r64[:, None] * sxr + cq[None, :] * sxc, mask=mq, other=0.0),)
            x = _cat(chunks, BR, 16 // VEC).to(tl.float32)
        else:  # any strides (a transposed view: the rows contiguous)
            x = _tile_load(X, r64 * sxr, cols * sxc, inside).to(tl.float32)
        if HAS_PRE:
            x = tl.where(inside, x * tl.load(PRE), 0.0)  # the padding is added after the multiply
        out = out + (x,)
    return out


@triton.jit
def _rotated_blocks(X, S, PRE, SIGN_SEED, rows, R, C, sxr, sxc, ssr, ssc, c0, HAS_PRE: tl.constexpr,
                    CODES: tl.constexpr, TRANS: tl.constexpr, TILE_DIV: tl.constexpr, VEC: tl.constexpr,
                    BR: tl.constexpr, SIZE: tl.constexpr, NORM: tl.constexpr, LOG2: tl.constexpr):
    """The rotated tile as a tuple of SIZE / 16 fp32 blocks [BR, 16] (_operand_blocks): sign flip, butterflies
    h = 1, 2, 4, ... (i meets i + h: a + b at i, a - b at i + h), × NORM: rht.rht of the padded operand. Stages
    h < 16 act within a block, the others between blocks: all in the thread that holds the row."""
    x = _operand_blocks(X, S, PRE, rows, R, C, sxr, sxc, ssr, ssc, c0, HAS_PRE, CODES, TRANS, TILE_DIV, VEC, BR,
                        SIZE)
    i = tl.arange(0, SIZE)
    neg = (tl.randint(tl.load(SIGN_SEED), i).to(tl.int32, bitcast=True) < 0).to(tl.int32)
    k16 = tl.arange(0, 16)
    v = ()
    for b in tl.static_range(SIZE // 16):  # signs of a block: bits of a word reduced from the [SIZE] draws
        word = tl.sum(tl.where((i >> 4) == b, neg << (i & 15), 0), axis=0)  # distinct bits: the sum is their OR
        flip = ((word >> k16) & 1) << 31  # x · ±1 as its sign bit flipped (the same bits; NaN stays NaN)
        y = (x[b].to(tl.int32, bitcast=True) + flip[None, :]).to(tl.float32, bitcast=True)
        for stage in tl.static_range(4):  # h = 2^stage < 16
            y = tl.permute(tl.reshape(y, (BR, 16 >> (stage + 1), 2, 1 << stage)), (0, 1, 3, 2))
            lo, hi = tl.split(y)
            y = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2)), (BR, 16))
        v = v + (y,)
    for stage in tl.static_range(LOG2 - 4):  # h = 16·2^stage: block j meets block j + 2^stage
        w = ()
        for b in tl.static_range(SIZE // 16):
            if (b >> stage) % 2 == 0:
                w = w + (v[b] + v[b + (1 << stage)],)
            else:
                w = w + (v[b - (1 << stage)] - v[b],)
        v = w
    out = ()
    for b in tl.static_range(SIZE // 16):
        out = out + (v[b] * NORM,)
    return out


@triton.jit
def _amax_kernel(X, S, PRE, SIGN_SEED, AMAX, R, C, sxr, sxc, ssr, ssc, HAS_PRE: tl.constexpr, CODES: tl.constexpr,
                 TRANS: tl.constexpr, TILE_DIV: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr,
                 SIZE: tl.constexpr, NORM: tl.constexpr, LOG2: tl.constexpr):
    """AMAX (fp32 bits in int32) |= max|rotated x| over this program's tile; NaN counts as +inf."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    v = _rotated_blocks(X, S, PRE, SIGN_SEED, rows, R, C, sxr, sxc, ssr, ssc, tl.program_id(1) * SIZE, HAS_PRE,
                        CODES, TRANS, TILE_DIV, VEC, BR, SIZE, NORM, LOG2)
    m = tl.abs(v[0])
    for b in tl.static_range(1, SIZE // 16):
        m = tl.maximum(m, tl.abs(v[b]), propagate_nan=tl.PropagateNan.ALL)  # exact; NaN kept
    m = _block_max(m, BR)
    m = tl.where(m == m, m, float("inf"))
    tl.atomic_max(AMAX, tl.max(m, axis=0).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _tensor_scale(amax):
    """Twin of ms_eden_tensor_scale: max((amax / 255.99) / vmax, 2⁻¹¹⁷); 1 for 0; NaN for non-finite amax."""
    one = tl.full(amax.shape, 1.0, tl.float32)
    s = tl.math.div_rn(tl.math.div_rn(amax, one * SCALE_MAX), one * VMAX)
    s = tl.where(s < MIN_S, MIN_S, s)
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where((amax == amax) & (tl.abs(amax) != float("inf")), s, float("nan"))


@triton.jit
def _e4m3_sat(v):
    """Non-negative fp32 (inf included) to the nearest-even E4M3 value, saturating at 448; NaN stays NaN
    (to_e4m3_saturating)."""
    r = e4m3_round(tl.where(v > 448.0, 448.0, v))
    return tl.where(v == v, r, float("nan"))


@triton.jit
def _e4m3_byte(v):
    """The E4M3 byte (int32) of a non-negative fp32 value that is exactly an E4M3 value."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    return tl.where(v < 0.015625, (v * 512.0).to(tl.int32), normal)


@triton.jit
def _e4m3_from_byte(b):
    """fp32 value of an E4M3 byte 0..0x7E (int32)."""
    normal = (((b >> 3) + 120) << 23 | (b & 7) << 20).to(tl.float32, bitcast=True)
    return tl.where(b < 8, (b & 7).to(tl.float32) * 0.001953125, normal)


@triton.jit
def _opaque(x, ASM: tl.constexpr):
    """int64 x unchanged; with ASM (a CUDA GPU) through an empty PTX move, which LLVM cannot see through: the
    adds of one block's sums are not reassociated with the next block's (that keeps every product of a group
    live for one balanced tree at the end, and spills at 64 and 128)."""
    if ASM:
        x = tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=True, pack=1)
    return x


@triton.jit
def e2m1_of_quotient(v, r):
    """MS-EDEN's per-element quantities of y = v / d, given fp32 v and r = RN64(1/d) (fp64; d > 0, or NaN): with
    a = min(|y|, 16) (0 for NaN; the bound of the correction's sums), (t, k, mag2, neg) int32: t = trunc(a·2²²),
    k the E2M1 magnitude code of y (nearest, ties away from zero, saturating at 6), mag2 = 2|q| and neg the sign of
    a number (numerics/ms_eden.py: e2m1_encode_away, correction).

    y is v · r computed in fp64 and rounded once to fp32: that product is within 2⁻⁵² of v / d, and a quotient of
    two fp32 numbers is never within 2⁻⁴⁹ (relative) of a point where the fp32 rounding changes, so y is the
    correctly rounded division; below 2⁻¹²⁶, where it need not be, t and k are 0 either way and the sign is v's.
    One multiply instead of a division per element."""
    y = (v.to(tl.float64) * r).to(tl.float32)
    isnum = y == y
    a = tl.where(isnum, tl.minimum(tl.abs(y), 16.0), 0.0)
    t = (a * 4194304.0).to(tl.int32)  # × 2²², truncated: <= 2²⁶
    ab = a.to(tl.int32, bitcast=True)
    # below 1, 2|y| rounded half up (t / 2²¹); from 1, the fp32 bits rounded to one mantissa bit (a carry moves the
    # exponent up), at most 7
    k = tl.where(ab < 0x3F800000, (t + 0x100000) >> 21, tl.minimum(((ab + 0x200000) >> 22) - 252, 7))
    mag2 = (-932957680 >> (k * 4)) & 0xF  # 0, 1, 2, 3, 4, 6, 8, 12: the nibbles of 0xC8643210
    neg = ((y.to(tl.int32, bitcast=True) < 0) & isnum).to(tl.int32)
    return t, k, mag2, neg


@triton.jit
def _quantize_kernel(X, XS, PRE, SIGN_SEED, DRAW_SEED, AMAX, GS, D, S, R, C, sxr, sxc, ssr, ssc,
                     HAS_PRE: tl.constexpr, CODES: tl.constexpr, TRANS: tl.constexpr, TILE_DIV: tl.constexpr,
                     VEC: tl.constexpr, STAGED: tl.constexpr, BR: tl.constexpr, SIZE: tl.constexpr,
                     NORM: tl.constexpr, LOG2: tl.constexpr, ASM: tl.constexpr):
    """MS-EDEN of a [BR, SIZE] tile (one correction group per row): D uint8 [R, Cpad/2] packed codes and
    S uint8 [R, Cpad/16] E4M3 scale bytes, or with STAGED D fp16 [R, Cpad] of q·ê_b (S unused); GS [1] = s
    (program (0, 0)). AMAX: fp32 [1], the rotated operand's amax. X (and XS with CODES): as _operand_blocks.
    A thread holds whole rows: each block's quantities are computed once, in that thread."""
    NB: tl.constexpr = SIZE // 16
    pr, pc = tl.program_id(0), tl.program_id(1)
    cpad = tl.num_programs(1) * SIZE
    amax = tl.load(AMAX)
    s = _tensor_scale(amax)
    if (pr == 0) & (pc == 0):
        tl.store(GS, s)
    rows = pr * BR + tl.arange(0, BR)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    v = _rotated_blocks(X, XS, PRE, SIGN_SEED, rows, R, C, sxr, sxc, ssr, ssc, pc * SIZE, HAS_PRE, CODES, TRANS,
                        TILE_DIV, VEC, BR, SIZE, NORM, LOG2)
    sv = tl.broadcast_to(s, [BR])
    num = tl.zeros([BR], tl.int64)  # the correction's exact sums over the row's group
    den = tl.zeros([BR], tl.int64)
    bad = rows < 0  # a non-finite y in the group
    es = ()
    qs = ()
    for b in tl.static_range(NB):
        bmax = _block_max(tl.abs(v[b]), BR)
        e = _e4m3_sat(tl.math.div_rn(tl.math.div_rn(bmax, tl.full([BR], VMAX, tl.float32)), sv))
        e = tl.where(e == 0.0, 1.0, e)
        es = es + (e,)
        d = e * sv
        r = 1.0 / d.to(tl.float64)  # fp64 division: correctly rounded
        # the block's largest |y| (y is monotonic in v): every y is finite iff ym is (as e2m1_of_quotient's y, the
        # division's own fp32 where that is normal or overflows, which is all the finiteness test sees)
        ym = (bmax.to(tl.float64) * r).to(tl.float32)
        bad = bad | (ym != ym) | (ym == float("inf"))
        t, k, mag2, neg = e2m1_of_quotient(v[b], r[:, None])
        tu = t.to(tl.uint32).to(tl.int64)  # (non-negative: zero-extended, one wide multiply)
        num += tl.sum(tu * tu, axis=1)  # (a group with a non-finite y: c is NaN)
        den += tl.sum((t * mag2).to(tl.uint32).to(tl.int64), axis=1)  # < 2³⁰
        num, den = _opaque(num, ASM), _opaque(den, ASM)
        if STAGED:
            qs = qs + (_e2m1_half(k | (neg << 3)),)
        else:
            lo_n, hi_n = tl.split(tl.reshape(k | (neg << 3), (BR, 8, 2)))
            wc = pc * (SIZE // 2) + b * 8 + tl.arange(0, 8)
            tl.store(D + r64[:, None] * (cpad // 2) + wc[None, :], (lo_n | (hi_n << 4)).to(tl.uint8),
                     mask=rmask[:, None])
    c = tl.math.div_rn(num.to(tl.float32), den.to(tl.float32)) * 4.76837158203125e-07  # × 2⁻²¹
    c = tl.where(den == 0, 1.0, c)
    c = tl.where(bad, float("nan"), c)
    seed = tl.load(DRAW_SEED)
    scales = ()
    for b in tl.static_range(NB):
        corr = es[b] * c
        ok = (corr == corr) & (corr != float("inf"))
        cc = tl.where(ok, corr, 0.0)
        near = _e4m3_sat(cc)
        lo_b = _e4m3_byte(near) - (near > cc).to(tl.int32)
        hi_b = tl.minimum(lo_b + 1, 0x7E)
        lo, hi = _e4m3_from_byte(lo_b), _e4m3_from_byte(hi_b)
        # p = (cc - lo) / (hi - lo): the neighbours' gap is a power of two (one E4M3 step), so the quotient is the
        # product by its reciprocal, whose fp32 bits are (254 << 23) minus the gap's
        gap = tl.where(hi > lo, hi - lo, 1.0).to(tl.int32, bitcast=True)
        p = tl.where(hi > lo, (cc - lo) * ((254 << 23) - gap).to(tl.float32, bitcast=True), 0.0)
        u = (tl.randint(seed, r64 * (cpad // 16) + (pc * NB + b)) >> 8).to(tl.float32) * 5.960464477539063e-08
        up = u < p  # u: × 2⁻²⁴
        if STAGED:
            ev = tl.where(ok, tl.where(up, hi, lo), float("nan"))
            cols = pc * SIZE + b * 16 + tl.arange(0, 16)
            # q·ê_b in fp16: exact (at most 6 significant bits, from 2⁻¹⁰ to 2688), the bits of the fp32 product
            tl.store(D + r64[:, None] * cpad + cols[None, :], qs[b] * ev.to(tl.float16)[:, None],
                     mask=rmask[:, None])
        else:
            scales = scales + (tl.where(ok, tl.where(up, hi_b, lo_b), 0x7F).to(tl.uint8),)
    if not STAGED:
        if NB == 1:
            tl.store(S + r64 * (cpad // 16) + pc, scales[0], mask=rmask)
        else:
            blk = pc * NB + tl.arange(0, NB)
            tl.store(S + r64[:, None] * (cpad // 16) + blk[None, :], _zip(scales, BR, NB), mask=rmask[:, None])


def tile_rows(rows: int, size: int, cuda: bool) -> int:
    """BR: rows per program (a power of two, at most what the rows need). On a GPU each of the program's threads
    holds max(1, 32 / size) whole rows of the tile; the CPU interpreter takes TILE_CPU elements at a time."""
    br = 32 * WARPS * max(1, 32 // size) if cuda else max(1, TILE_CPU // size)
    return max(1, min(br, 1 << max(rows - 1, 0).bit_length()))


class _Source(NamedTuple):
    """The operand as the kernels read it: X (values, or packed codes) and S (scale bytes, or X again, unread),
    the logical [R, C], X's and S's strides and the constexprs CODES, TRANS, TILE_DIV, VEC."""
    x: torch.Tensor
    s: torch.Tensor
    rows: int
    cols: int
    strides: tuple[int, int, int, int]
    consts: dict


def _vec(t: torch.Tensor, vec: int) -> int:
    """VEC: ``vec`` where rows of contiguous elements start 16-byte aligned as Triton sees it (the row stride and
    the address specialized as multiples of 16), so that 16-byte loads keep a row in its thread; else 1."""
    return vec if t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 else 1


def _source(values: torch.Tensor, block_scales: torch.Tensor | None, transposed: bool, tiles: bool) -> _Source:
    """values [R, C] (values.t() with ``transposed``), or with ``block_scales`` the q·e_b of the NVFP4 storage of
    codes ``values`` [rows, cols/2] (or its transpose), read in place."""
    if block_scales is None:
        v = values.t() if transposed else values
        return _Source(v, v, v.shape[0], v.shape[1], (v.stride(0), v.stride(1), 0, 0),
                       dict(CODES=False, TRANS=False, TILE_DIV=1, VEC=_vec(v, 16 // v.element_size())))
    sb = block_scales.view(torch.uint8)
    rows, cols = values.shape[0], values.shape[1] * 2
    r, c = (cols, rows) if transposed else (rows, cols)
    return _Source(values, sb, r, c, (values.stride(0), values.stride(1), sb.stride(0), sb.stride(1)),
                   dict(CODES=True, TRANS=bool(transposed), TILE_DIV=16 if tiles else 1, VEC=_vec(values, 8)))


def _pre_arg(pre_scale: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    if pre_scale is None:
        return values.new_empty((1,), dtype=torch.float32)  # unread (HAS_PRE=False)
    return pre_scale.reshape(1).to(values.device)


def _seed_arg(seed: torch.Tensor | int, device: torch.device, what: str) -> torch.Tensor:
    """int64 [1] on the device (a Python int becomes one; a tensor is used as it is)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"ms_eden kernels: {what} must be an int64 tensor of one element, got {seed.dtype} "
                             f"{tuple(seed.shape)}")
        return seed.reshape(1).to(device)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
        raise ValueError(f"ms_eden kernels: {what} must be an int64 tensor or an integer in [-2**63, 2**63), "
                         f"got {seed!r}")
    return torch.tensor([seed], dtype=torch.int64, device=device)


def _amax_into(buf: torch.Tensor, src: _Source, pre: torch.Tensor, sign_seed: torch.Tensor, size: int,
               has_pre: bool) -> None:
    R, C = src.rows, src.cols
    if R == 0 or C == 0:
        return
    br = tile_rows(R, size, src.x.is_cuda)
    launch(_amax_kernel, (cdiv(R, br), padded_cols(C, size) // size), src.x, src.s, pre, sign_seed, buf, R, C,
           *src.strides, HAS_PRE=has_pre, **src.consts, BR=br, SIZE=size, NORM=rht_norm(size),
           LOG2=size.bit_length() - 1, num_warps=WARPS, enable_fp_fusion=False)


def ms_eden_amax_tensor(values: torch.Tensor, pre_scale: torch.Tensor | None, sign_seed: torch.Tensor | int, *,
                        size: int, block_scales: torch.Tensor | None = None, transposed: bool = False,
                        tiles: bool = False) -> torch.Tensor:
    """fp32 0-d max|rotated operand| (twin of numerics ms_eden_operand_amax; non-finite -> +inf). The operand:
    values [R, C], or with ``block_scales`` an NVFP4 storage's q·e_b read from its codes ``values`` (``tiles``:
    16×16 scale tiles); ``transposed``: its transpose."""
    check_operand_args(values, size, pre_scale, "ms_eden_amax", block_scales=block_scales, tiles=tiles)
    buf = torch.zeros(1, dtype=torch.int32, device=values.device)
    _amax_into(buf, _source(values, block_scales, transposed, tiles), _pre_arg(pre_scale, values),
               _seed_arg(sign_seed, values.device, "sign_seed"), size, pre_scale is not None)
    return buf.view(torch.float32).reshape(())


def ms_eden_quantize_tensors(values: torch.Tensor, pre_scale: torch.Tensor | None, sign_seed: torch.Tensor | int,
                             draw_seed: torch.Tensor | int, amax: torch.Tensor | None, *, size: int,
                             staged: bool, block_scales: torch.Tensor | None = None, transposed: bool = False,
                             tiles: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, Cpad/2], E4M3 scales [R, Cpad/16], s fp32 [1]), or with ``staged`` (fp16 q·ê_b
    [R, Cpad], empty scales, s): ms_eden_operand's quantization from two kernel passes (one with ``amax``).
    The operand as in ms_eden_amax_tensor: values, or an NVFP4 storage's codes with ``block_scales``."""
    check_operand_args(values, size, pre_scale, "ms_eden_quantize", block_scales=block_scales, tiles=tiles)
    src = _source(values, block_scales, transposed, tiles)
    R, C = src.rows, src.cols
    dev = values.device
    cpad = padded_cols(C, size)
    pre = _pre_arg(pre_scale, values)
    sseed, dseed = _seed_arg(sign_seed, dev, "sign_seed"), _seed_arg(draw_seed, dev, "draw_seed")
    if amax is None:
        buf = torch.zeros(1, dtype=torch.int32, device=dev)
        _amax_into(buf, src, pre, sseed, size, pre_scale is not None)
        amax_t = buf.view(torch.float32)
    else:
        amax_t = amax.reshape(1).to(dev, torch.float32)
    gs = torch.empty(1, dtype=torch.float32, device=dev)
    if staged:
        d = torch.empty((R, cpad), dtype=torch.float16, device=dev)
        sc = torch.empty((0,), dtype=torch.float8_e4m3fn, device=dev)
    else:
        d = torch.empty((R, cpad // 2), dtype=torch.uint8, device=dev)
        sc = torch.empty((R, cpad // 16), dtype=torch.float8_e4m3fn, device=dev)
    if R == 0 or cpad == 0:  # no program runs: s from the amax on the device
        gs.copy_(ms_eden_tensor_scale(amax_t))
        return d, sc, gs
    br = tile_rows(R, size, values.is_cuda)
    launch(_quantize_kernel, (cdiv(R, br), cpad // size), src.x, src.s, pre, sseed, dseed, amax_t, gs, d,
           sc.view(torch.uint8) if not staged else d, R, C, *src.strides, HAS_PRE=pre_scale is not None,
           **src.consts, STAGED=staged, BR=br, SIZE=size, NORM=rht_norm(size), LOG2=size.bit_length() - 1,
           ASM=values.is_cuda and torch.version.hip is None and not interpreting(),
           num_warps=WARPS, enable_fp_fusion=False)
    return d, sc, gs


__all__ = ["ms_eden_amax_tensor", "ms_eden_quantize_tensors"]
