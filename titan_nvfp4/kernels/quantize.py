"""Triton NVFP4 quantization kernels (sm_80+, ROCm, and the CPU interpreter under TRITON_INTERPRET=1).

Two passes over the input: ``_amax_kernel`` reduces the tensor amax of x and, for the wgrad operand,
of the Hadamard-transformed xᵀ; ``_quantize_kernel`` then emits the rowwise 1×16 operand (forward /
dgrad) and the transposed operand with 16-element blocks along dim 0 (wgrad), nearest-even or
stochastic (Philox), plus the two global decode scales. ``_quantize_2d_kernel`` emits 16×16-block
weights together with the codes of Wᵀ.

Every 16-element block is laid out across a 16-tuple of tiles, tile i holding element i of each
block: for the column operand tile i holds rows 16g + i, for the row operand columns 16kb + i (two
8-element vector loads, split in registers). The RHT, block amax, scales, rounding and nibble packing
are then elementwise work between tiles and no value crosses threads; only the transposed column
codes are moved once before their store. Reference twin: titan_nvfp4/numerics/nvfp4.py (checked in
tests/test_kernels.py).

``TUNE_M`` (every kernel here, and the SwiGLU kernels) is not read by the kernels: it is the row count
rounded up to a power of two, which the autotuners key on instead of the row count (launch.tune_bucket).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.expert_blocks import block_experts
from ..numerics.nvfp4 import NVFP4Tensor, check_sr_block_scale, global_encode_scale
from ..numerics.operands import operand_pair, weight_pair
from .expert_map import block_experts_triton
from .launch import autotune, cdiv, launch, next_pow2, tune_bucket
from .nvfp4_jit import global_encode_scale as _jit_global_scale
from .nvfp4_jit import (add_nibble, amax16, block_scales, e2m1_nibble, e2m1_staged, e4m3_value, four_over_six_d2,
                        four_over_six_unit, join_slices16, nibble_word, pack_pairs, pick_four_or_six, quantize_slices16, rht16_slices,
                        round_to, split8, words_along_slices)

G_Q = 2  # 16-row blocks per program (fixed tiles: small inputs on a GPU)
BK_Q = 64  # features per program
# Fixed tiles in Triton's CPU interpreter, which pays per program and per operation, not per element: larger than
# any autotuned config's, so a test shape takes a few programs (8 experts of 128 x 256: 2.7 s, 6.7 s at 4 x 128);
# every config's decomposition is tested against these tiles (tests/test_kernels.py, *_every_tile_config_*)
G_I, BK_I = 16, 256


@triton.jit
def program_tile(cols, BK: tl.constexpr, COLS_FIRST: tl.constexpr):
    """(row tile, column tile) of this program: grid (row tiles, column tiles), or with COLS_FIRST a 1D
    grid whose consecutive programs take the column tiles of one row strip in turn, so that the programs
    resident at once read whole rows of x rather than one tile column of many rows (launch_grid)."""
    if COLS_FIRST:
        nc = tl.cdiv(cols, BK)
        return tl.program_id(0) // nc, tl.program_id(0) % nc
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _load16(X, blk, rk, M, K, sxm, sxk, AS_LOADED: tl.constexpr = False):
    """Sixteen fp32 tiles [G, BK] of x; tile i holds rows 16·blk + i (zeros outside x). AS_LOADED:
    in x's own dtype (fewer registers while all 16 are live; exact, as fp32 is taken on use)."""
    col = rk[None, :] * sxk
    kmask = (rk < K)[None, :]
    xs = ()
    for i in tl.static_range(16):
        rows = blk * 16 + i
        ptr = X + rows[:, None].to(tl.int64) * sxm + col
        x = tl.load(ptr, mask=(rows < M)[:, None] & kmask, other=0.0)
        xs = xs + (x if AS_LOADED else x.to(tl.float32),)
    return xs


@triton.jit
def _amax_kernel(X, M, K, sxm, sxk, AMAX, SIGNS, BEXP, NSLOT, TUNE_M, ROW: tl.constexpr, COL: tl.constexpr,
                 RHT: tl.constexpr, GROUPED: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
                 COLS_FIRST: tl.constexpr = False):
    """AMAX[e] |= max|x| and AMAX[NSLOT + e] |= max|rht(xᵀ)| (see reduce_amax16) over x's 16-row
    blocks; programs tile [16·G rows, BK features] (ordered by program_tile)."""
    pr, pc = program_tile(K, BK, COLS_FIRST)
    blk = pr * G + tl.arange(0, G)
    rk = pc * BK + tl.arange(0, BK)
    reduce_amax16(_load16(X, blk, rk, M, K, sxm, sxk), blk, M, AMAX, SIGNS, BEXP, NSLOT, ROW, COL, RHT, GROUPED)


@triton.jit
def reduce_amax16(xs, blk, M, AMAX, SIGNS, BEXP, NSLOT, ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
                  GROUPED: tl.constexpr):
    """Fold 16 fp32 tiles [G, BK] (tile i = rows 16·blk + i, zeros outside the tensor) into the amaxes:
    AMAX[e] |= max|x| and AMAX[NSLOT + e] |= max|rht(xᵀ)| (fp32 bits in int32; non-finite -> +inf),
    where e is 0, or with GROUPED the slot BEXP[b] of each 16-row block b (its expert). Shared by the
    amax pass and the kernels that produce a tensor and its amaxes together (swiglu.py). The atomics
    are relaxed: only later kernels read AMAX, and Triton's default (acq_rel) fences every program's
    end with a GPU-wide memory barrier and an L1 invalidation, which cost the RHT amax pass ~25% of
    its time on an H200 (``python benchmarks/quant_variants.py --amax``)."""
    if GROUPED:
        valid = blk < tl.cdiv(M, 16)
        e = tl.load(BEXP + blk, mask=valid, other=0)
    if ROW:
        if GROUPED:
            tl.atomic_max(AMAX + e, tl.max(amax16(xs), axis=1).to(tl.int32, bitcast=True), mask=valid, sem="relaxed")
        else:
            tl.atomic_max(AMAX, tl.max(tl.max(amax16(xs), axis=1), axis=0).to(tl.int32, bitcast=True), sem="relaxed")
    if COL:
        scale: tl.constexpr = 0.25 if RHT else 1.0  # the RHT's * 0.25, once per max instead of per element
        if RHT:
            xs = rht16_slices(xs, SIGNS, SCALE=False)
        col_max = tl.max(amax16(xs), axis=1) * scale
        if RHT:  # the transform's output rounded to the signs' dtype (rht16_slices), once per max
            col_max = round_to(col_max, SIGNS.dtype.element_ty, False)
        if GROUPED:
            tl.atomic_max(AMAX + NSLOT + e, col_max.to(tl.int32, bitcast=True), mask=valid, sem="relaxed")
        else:
            tl.atomic_max(AMAX + NSLOT, tl.max(col_max, axis=0).to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _store_decode_scales(GS, AMAX, NS, NSP2: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):
    """GS[i] = 1/S of AMAX[i] for the NS slots (twin of NVFP4Tensor.global_scale), by program (0, 0);
    a slot of an operand not emitted holds amax 0, giving 1: every output is defined."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        i = tl.arange(0, NSP2)
        tl.store(GS + i, _decode_scale(tl.load(AMAX + i, mask=i < NS, other=0), FOUR_OVER_SIX), mask=i < NS)


@triton.jit
def _decode_scale(amax_bits, FOUR_OVER_SIX: tl.constexpr):
    """1/S of amaxes given as fp32 bits in int32 (twin of NVFP4Tensor.global_scale)."""
    s_enc = _jit_global_scale(amax_bits.to(tl.float32, bitcast=True), FOUR_OVER_SIX)
    return tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)


@triton.jit
def _encode_scale(AMAX, BEXP, blk, nblk, GROUPED: tl.constexpr, FOUR_OVER_SIX: tl.constexpr):
    """The tensor encode scale S of 16-row blocks ``blk``: a scalar, or with GROUPED one per block
    (of its expert's slot BEXP[blk]) shaped [len(blk), 1] to broadcast over the block's tiles."""
    if GROUPED:
        e = tl.load(BEXP + blk, mask=blk < nblk, other=0)
        return _jit_global_scale(tl.load(AMAX + e).to(tl.float32, bitcast=True), FOUR_OVER_SIX)[:, None]
    else:
        return _jit_global_scale(tl.load(AMAX).to(tl.float32, bitcast=True), FOUR_OVER_SIX)


@triton.jit
def _load16_cols(X, rows, kb, M, K, sxm, sxk, AS_LOADED: tl.constexpr = False):
    """Sixteen fp32 tiles [R, C] of x (AS_LOADED: in x's dtype, as _load16); tile j holds
    x[rows, 16·kb + j] (zeros outside x): two vector loads of 8 elements per block, split in registers."""
    R: tl.constexpr = rows.shape[0]
    C: tl.constexpr = kb.shape[0]
    col = kb[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    ptr = X + rows[:, None, None].to(tl.int64) * sxm + col * sxk
    mask = (rows < M)[:, None, None] & (col < K)
    lo = tl.load(ptr, mask=mask, other=0.0)
    hi = tl.load(ptr + 8 * sxk, mask=mask, other=0.0)
    if not AS_LOADED:
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    return split8(lo, R, C) + split8(hi, R, C)


@triton.jit
def _quantize_kernel(X, M, K, sxm, sxk, AMAX, GS, RD, RS, CD, CS, SIGNS, SEED, Mpad, BEXP, NSLOT, TUNE_M,
                     ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr, STOCHASTIC_ROW: tl.constexpr,
                     STOCHASTIC_COL: tl.constexpr, GROUPED: tl.constexpr, ROW_STAGED: tl.constexpr, NSP2: tl.constexpr,
                     G: tl.constexpr, BK: tl.constexpr, COL_STAGED: tl.constexpr = False,
                     FOUR_OVER_SIX: tl.constexpr = False, COLS_FIRST: tl.constexpr = False,
                     SR_BLOCK_SCALE_UP: tl.constexpr = False):
    """Row operand: RD [M, K/2], RS [M, K/16]. Column operand of xᵀ (tokens zero-padded to Mpad):
    CD [K, Mpad/2], CS [K, Mpad/16]. GS [2·NSLOT]: the decode scales of the two, from AMAX (row slots,
    then column slots). NSLOT is 1, or with GROUPED one slot per expert: 16-row block b then takes
    the tensor scale of slot BEXP[b] (routed tokens grouped by expert, groups aligned to 16). A
    program covers 16·G rows and BK columns; it reads them twice (the second time from cache), once
    as 16 tiles per row block for the column operand and once as 16 tiles per column block for the
    row operand, so that every 16-element block is elementwise work between tiles. Philox counters
    (quantize_slices16): row block (m, kb) uses m·K/16 + kb, column block (b, k) uses
    (Mpad/16)·K + b·K + k: the two roundings draw independent numbers from one seed. ROW_STAGED: the row
    operand goes out as the GEMM's staged fp16 values q·e_b in RD [M, K] instead of codes and scales;
    COL_STAGED likewise the column operand in CD [K, Mpad]. FOUR_OVER_SIX: Four Over Six block scales (and its
    tensor scales) for both operands. SR_BLOCK_SCALE_UP (sr_block_scale = "up"): the block scales of the
    stochastically rounded operands round up. Programs are ordered by program_tile (COLS_FIRST)."""
    pr, pc = program_tile(K, BK, COLS_FIRST)
    seed = tl.load(SEED)  # a dummy pointer when neither rounding is stochastic
    _store_decode_scales(GS, AMAX, 2 * NSLOT, NSP2, FOUR_OVER_SIX)
    nblk = Mpad // 16
    if COL:
        blk = pr * G + tl.arange(0, G)
        rk = pc * BK + tl.arange(0, BK)
        xs = _load16(X, blk, rk, M, K, sxm, sxk)
        if RHT:
            xs = rht16_slices(xs, SIGNS)
        s = _encode_scale(AMAX + NSLOT, BEXP, blk, nblk, GROUPED, FOUR_OVER_SIX)
        # (not k·Mpad/16 + b: that expression is the CS store's offsets, whose layout it would then share)
        out, e = quantize_slices16(xs, s, STOCHASTIC_COL, seed, (Mpad // 16) * K + blk[:, None] * K + rk[None, :],
                                   STAGED=COL_STAGED, FOUR_OVER_SIX=FOUR_OVER_SIX, SR_SCALE_UP=SR_BLOCK_SCALE_UP)
        kmask = (rk < K)[:, None]
        if COL_STAGED:  # [G, BK, 16] (token 16g + i last) -> [BK, 16G]: rows of xᵀ
            vals = tl.reshape(tl.permute(join_slices16(out, G, BK), (1, 0, 2)), (BK, 16 * G))
            rt = pr * (16 * G) + tl.arange(0, 16 * G)
            tl.store(CD + rk[:, None].to(tl.int64) * Mpad + rt[None, :], vals, mask=kmask & (rt < Mpad)[None, :])
        else:  # rows of xᵀ: the codes of column k, block after block
            words = words_along_slices(out[0], out[1])
            rw = pr * (2 * G) + tl.arange(0, 2 * G)
            tl.store(CD.to(tl.pointer_type(tl.int32)) + rk[:, None].to(tl.int64) * (Mpad // 8) + rw[None, :], words,
                     mask=kmask & (rw < Mpad // 8)[None, :])
            tl.store(CS + rk[None, :].to(tl.int64) * (Mpad // 16) + blk[:, None], e,
                     mask=(rk < K)[None, :] & (blk < Mpad // 16)[:, None])
    if ROW:
        rows = pr * (16 * G) + tl.arange(0, 16 * G)
        kb = pc * (BK // 16) + tl.arange(0, BK // 16)
        # bf16 until used: 48 instead of 56 registers (Four Over Six uses each element thrice: fp32)
        xs = _load16_cols(X, rows, kb, M, K, sxm, sxk, AS_LOADED=not FOUR_OVER_SIX)
        s = _encode_scale(AMAX, BEXP, rows // 16, nblk, GROUPED, FOUR_OVER_SIX)
        # staged rows skip the codes: quantize_slices16 forms q·e_b directly
        out, e = quantize_slices16(xs, s, STOCHASTIC_ROW, seed, rows[:, None] * (K // 16) + kb[None, :],
                                   STAGED=ROW_STAGED, FOUR_OVER_SIX=FOUR_OVER_SIX, SR_SCALE_UP=SR_BLOCK_SCALE_UP)
        rmask = (rows < M)[:, None]
        kmask = (kb < K // 16)[None, :]
        if ROW_STAGED:
            vals = join_slices16(out, 16 * G, BK // 16)
            tl.store(RD + rows[:, None, None].to(tl.int64) * K + kb[None, :, None] * 16 + tl.arange(0, 16)[None, None, :],
                     vals, mask=(rmask & kmask)[:, :, None])
        else:  # two words of 8 codes per block
            tl.store(RD.to(tl.pointer_type(tl.int32)) + rows[:, None, None].to(tl.int64) * (K // 8) + kb[None, :, None] * 2
                     + tl.arange(0, 2)[None, None, :], tl.join(out[0], out[1]), mask=(rmask & kmask)[:, :, None])
            tl.store(RS + rows[:, None].to(tl.int64) * (K // 16) + kb[None, :], e, mask=rmask & kmask)


@triton.jit
def _quantize_2d_kernel(W, N, K, swn, swk, AMAX, GS, D, S, DT, ST, BEXP, NSLOT, D_ROWS, D_EXPERT, TUNE_M,
                        EMIT_T: tl.constexpr, GROUPED: tl.constexpr, EMIT_STAGED: tl.constexpr, NSP2: tl.constexpr,
                        G: tl.constexpr, BK: tl.constexpr, FOUR_OVER_SIX: tl.constexpr = False,
                        COLS_FIRST: tl.constexpr = False):
    """16×16 blocks, nearest-even: D [N, K/2], S [N/16, K/16], GS the decode scales, and DT [K, N/2]
    with ST = Sᵀ, the codes and scales of Wᵀ (whose tiles are the transposed tiles of W). With
    GROUPED, W stacks experts along N and 16-row block b takes the tensor scale of slot BEXP[b].
    EMIT_STAGED: D gets the GEMM's staged fp16 values q·e_b of W instead of codes (S unused), row r of
    each D_ROWS-row expert at D + expert·D_EXPERT + r·K (D_EXPERT = D_ROWS·K: plain [N, K]; larger:
    into every expert's slice of a wider buffer, see quantize_expert_pair).
    FOUR_OVER_SIX: Four Over Six tile scales, the error summed over each tile's 256 elements (int32, exact).
    Programs are ordered by program_tile (COLS_FIRST)."""
    _store_decode_scales(GS, AMAX, NSLOT, NSP2, FOUR_OVER_SIX)
    pr, pc = program_tile(K, BK, COLS_FIRST)
    _quantize_2d_tile(W, pr * G, pc, N // 16, N, K, swn, swk, AMAX, BEXP, D, S, DT, ST, D_ROWS, D_EXPERT, EMIT_T,
                      GROUPED, EMIT_STAGED, G, BK, FOUR_OVER_SIX)


@triton.jit
def _quantize_2d_fused_kernel(W, K, swn, swk, AMAX, GS, D, S, DT, ST, NSLOT, D_ROWS, D_EXPERT,
                              EMIT_T: tl.constexpr, EMIT_STAGED: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
                              FOUR_OVER_SIX: tl.constexpr = False, LEAD: tl.constexpr = 1, SPAN: tl.constexpr = 1):
    """_quantize_2d_kernel (GROUPED) for NSLOT stacked experts of D_ROWS rows whose amaxes are reduced
    in the same launch, so that the second read of each expert comes from L2 rather than HBM. AMAX
    holds NSLOT amax slots and NSLOT tile counters, zero at launch. Program p takes tile p in the
    order of ordered_tiles: an amax tile folds |W| of SPAN quantization tiles into its expert's slot
    and counts itself done; a quantization tile loads its W, then waits until every amax tile of its
    expert is done. Those have lower program ids, which the GPU starts first (as stream-K GEMMs'
    fix-up waits rely on), and the CPU interpreter runs programs in order."""
    bpe = D_ROWS // 16
    ct = tl.cdiv(K, BK)
    tq = tl.cdiv(bpe, G) * ct
    ta = tl.cdiv(tq, SPAN)
    DONE = AMAX + NSLOT
    e, loc, quant = ordered_tiles(tl.program_id(0), ta, tq, NSLOT, LEAD)
    if quant:
        # the expert's first tile stores its decode scale, after a wait of its own: storing it after
        # the tile's wait instead measured 0.399 against 0.353 ms (64 experts of 1408 × 2048, H100)
        if loc == 0:
            wait_count(DONE + e, ta)
            tl.store(GS + e, _decode_scale(tl.load(AMAX + e), FOUR_OVER_SIX))
        _quantize_2d_tile(W, e * bpe + (loc // ct) * G, loc % ct, (e + 1) * bpe, NSLOT * D_ROWS, K, swn, swk,
                          AMAX + e, AMAX, D, S, DT, ST, D_ROWS, D_EXPERT, EMIT_T, False, EMIT_STAGED, G, BK,
                          FOUR_OVER_SIX, DONE + e, ta, True)
    else:
        m = tl.zeros((), tl.float32)
        # a rolled loop: unrolled (tl.static_range), Triton 3.6 compiled this kernel in 9.9 s, rolled in 4.8 s;
        # the kernel runs as fast (H100)
        for i in tl.range(SPAN):
            c = loc * SPAN + i  # a quantization tile's rows and columns, none past the expert's last
            blk = e * bpe + (c // ct) * G + tl.arange(0, G)
            rk = (c % ct) * BK + tl.arange(0, BK)
            ws = _load16(W, blk, rk, tl.where(c < tq, (e + 1) * D_ROWS, 0), K, swn, swk)  # fp32: see amax16's NaN
            m = tl.maximum(m, tl.max(tl.max(amax16(ws), axis=1), axis=0).to(tl.float32))
        tl.atomic_max(AMAX + e, m.to(tl.int32, bitcast=True), sem="relaxed")
        count_done(DONE + e)


@triton.jit
def ordered_tiles(t, ta, tq, E, LEAD: tl.constexpr):
    """Tile t (a program id) -> (expert e, tile within it, whether it quantizes) in the order A0 .. A(L-1) |
    A(L) Q0 | A(L+1) Q1 | ... | A(E-1) Q(E-1-L) | Q(E-L) .. Q(E-1), A(e) the ta amax tiles of
    expert e, Q(e) its tq quantization tiles and L = min(LEAD, E): each expert's amax tiles come
    L experts' tiles before its quantization tiles (whose reads then hit L2), and before them in
    this order (what the fused kernels' waits need)."""
    L = tl.minimum(E, LEAD)
    u = t - L * ta
    mid = (ta + tq) * (E - L)
    seg = u // (ta + tq)
    r = u % (ta + tq)
    tail = u - mid
    quant = (u >= 0) & ((u >= mid) | (r >= ta))
    e = tl.where(u < 0, t // ta, tl.where(u >= mid, E - L + tail // tq, tl.where(r >= ta, seg, seg + L)))
    loc = tl.where(u < 0, t % ta, tl.where(u >= mid, tail % tq, tl.where(r >= ta, r - ta, r)))
    return e, loc, quant


@triton.jit
def count_done(DONE):
    """Count one finished tile at DONE, after (in memory order, for every thread of the program) the
    atomics that published its result."""
    tl.debug_barrier()
    tl.atomic_add(DONE, 1, sem="release")


@triton.jit
def wait_count(DONE, n):
    """Spin until the counter at DONE reaches n; acquire, so that what the counted tiles published
    before counting themselves (count_done) is visible to the whole program afterwards."""
    c = tl.atomic_add(DONE, 0, sem="acquire")
    while c < n:
        c = tl.atomic_add(DONE, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _quantize_2d_tile(W, b0, t1, nblk, N, K, swn, swk, AMAX, BEXP, D, S, DT, ST, D_ROWS, D_EXPERT,
                      EMIT_T: tl.constexpr, GROUPED: tl.constexpr, EMIT_STAGED: tl.constexpr, G: tl.constexpr,
                      BK: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, DONE=None, n_done=0, WAIT: tl.constexpr = False):
    """One program's tile of _quantize_2d_kernel for W [N, K]: the G 16-row blocks from block b0 (those
    at or past block nblk are left to other tiles) and column tile t1 of BK columns; the tensor scale
    from AMAX as _encode_scale reads it. WAIT: only once the counter at DONE reaches n_done (W is
    loaded before the wait, so that the two latencies overlap)."""
    blk = b0 + tl.arange(0, G)
    rk = t1 * BK + tl.arange(0, BK)
    ws = _load16(W, blk, rk, nblk * 16, K, swn, swk, AS_LOADED=not FOUR_OVER_SIX)
    if WAIT:
        wait_count(DONE, n_done)
    s = _encode_scale(AMAX, BEXP, blk, nblk, GROUPED, FOUR_OVER_SIX)
    bamax = tl.max(tl.reshape(amax16(ws), (G, BK // 16, 16)), axis=2).to(tl.float32)
    if FOUR_OVER_SIX:
        e, r = _four_over_six_tiles(ws, bamax, s, G, BK)
    else:
        e, r = block_scales(bamax, s)  # [G, BK/16]
    rk2 = t1 * (BK // 2) + tl.arange(0, BK // 2)
    # per element: e_b (for the staged values) and the code mask of non-finite blocks (r is NaN there)
    e32 = tl.reshape(tl.broadcast_to(e4m3_value(e)[:, :, None], (G, BK // 16, 16)), (G, BK))
    keep = tl.reshape(tl.broadcast_to(tl.where(r == r, -1, 0)[:, :, None], (G, BK // 16, 16)), (G, BK))
    if EMIT_STAGED:  # where each 16-row block's first staged row goes (blocks never straddle experts)
        e_of = blk * 16 // D_ROWS
        d_row0 = e_of.to(tl.int64) * D_EXPERT + (blk * 16 - e_of * D_ROWS).to(tl.int64) * K
    # Wᵀ's code words of rows 0-7 and 8-15, filled as the codes come (8 live nibbles would cost registers)
    lo = tl.zeros((G, BK), tl.int32)
    hi = tl.zeros((G, BK), tl.int32)
    for i in tl.static_range(16):
        y = tl.reshape(tl.reshape(ws[i].to(tl.float32), (G, BK // 16, 16)) * r[:, :, None], (G, BK))
        c = e2m1_nibble(y)
        if i < 8:
            lo = add_nibble(lo, c, i)
        else:
            hi = add_nibble(hi, c, i - 8)
        row = (blk * 16 + i)[:, None]
        if EMIT_STAGED:
            tl.store(D + (d_row0 + i * K)[:, None] + rk[None, :], e2m1_staged(y, e32).to(tl.float16),
                     mask=(row < nblk * 16) & (rk < K)[None, :])
        else:
            tl.store(D + row.to(tl.int64) * (K // 2) + rk2[None, :], pack_pairs((c & keep).to(tl.uint8), G, BK),
                     mask=(row < nblk * 16) & (rk2 < K // 2)[None, :])
    rk16 = t1 * (BK // 16) + tl.arange(0, BK // 16)
    smask = (blk < nblk)[:, None] & (rk16 < K // 16)[None, :]
    if not EMIT_STAGED:
        tl.store(S + blk[:, None] * (K // 16) + rk16[None, :], e, mask=smask)
    if EMIT_T:
        tl.store(ST + rk16[None, :] * (N // 16) + blk[:, None], e, mask=smask)
        words = words_along_slices(lo & keep, hi & keep)  # Wᵀ's rows hold W's columns; non-finite tiles 0
        rw = b0 * 2 + tl.arange(0, 2 * G)
        tl.store(DT.to(tl.pointer_type(tl.int32)) + rk[:, None].to(tl.int64) * (N // 8) + rw[None, :], words,
                 mask=(rk < K)[:, None] & (rw < nblk * 2)[None, :])


@triton.jit
def _per_element(t, G: tl.constexpr, BK: tl.constexpr):
    """[G, BK/16] per-tile values broadcast to the [G, BK] elements of a row tile."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (G, BK // 16, 16)), (G, BK))


@triton.jit
def _four_over_six_tiles(ws, bamax, s, G: tl.constexpr, BK: tl.constexpr):
    """Four Over Six scales of 16×16 tiles (twin of four_over_six_scales on a tile's 256 elements):
    the 16 row tiles [G, BK] ``ws`` each add their D² per element, then each tile's 16 columns are summed."""
    e6, r6 = block_scales(bamax, s)
    e4, r4 = block_scales(bamax, s, TO_FOUR=True)
    p = _per_element(four_over_six_unit(bamax, s), G, BK)
    r6e, r4e = _per_element(r6, G, BK), _per_element(r4, G, BK)
    f6, f4 = _per_element(e4m3_value(e6), G, BK), _per_element(e4m3_value(e4), G, BK)
    err6 = four_over_six_d2(ws[0], s, r6e, f6, p)
    err4 = four_over_six_d2(ws[0], s, r4e, f4, p)
    for i in tl.static_range(1, 16):
        err6 += four_over_six_d2(ws[i], s, r6e, f6, p)
        err4 += four_over_six_d2(ws[i], s, r4e, f4, p)
    err6 = tl.sum(tl.reshape(err6, (G, BK // 16, 16)), axis=2)
    err4 = tl.sum(tl.reshape(err4, (G, BK // 16, 16)), axis=2)
    return pick_four_or_six(e6, r6, e4, r4, err6, err4)


def quantize_configs(tiles):
    """Autotuner configs from (G, BK, warps, COLS_FIRST) tuples."""
    return [triton.Config({"G": g, "BK": bk, "COLS_FIRST": cf}, num_warps=w) for g, bk, w, cf in tiles]


def _operand_configs():
    # the fastest of `benchmarks/quant_variants.py` on an H100 (2026-11-26), each
    # tile in its faster program order: 1×128 columns first for the rowwise operand alone (0.063 against
    # 0.066 ms), 4×128×4 for forward X, 2×64×2 for backward dY; 64 elements per thread in the last two
    return quantize_configs(((2, 64, 2, True), (2, 128, 4, False), (4, 128, 8, False), (1, 128, 1, True),
                     (4, 128, 4, True)))


def _weight_configs():
    # the fastest tiles of `benchmarks/weight_quant_bench.py --configs` on an H100 for the 16×16 weight
    # kernel as trained (W staged, Wᵀ codes), each in its faster program order; 4×128×4 in both, as
    # columns first is faster with W staged (0.095 against 0.097 ms) and slower with W as codes
    return quantize_configs(((2, 128, 4, False), (4, 128, 4, False), (4, 128, 4, True), (2, 128, 2, False),
                     (1, 256, 2, False)))


def _amax_configs():
    # the fastest tiles of `benchmarks/quant_variants.py --amax` (H200, relaxed atomics): 2-4 warps over
    # 64-128 rows for |x| and |RHT xᵀ|, one warp over 16-32 rows and 128-256 features for |x| alone;
    # column tiles first is as fast or faster for each (H100, 2026-11-26)
    return quantize_configs(((4, 128, 2, True), (8, 64, 4, True), (1, 256, 1, True), (2, 128, 1, True), (2, 128, 2, True)))


_quantize_autotuned = autotune(
    _operand_configs(),
    key=["TUNE_M", "K", "ROW", "COL", "RHT", "STOCHASTIC_ROW", "STOCHASTIC_COL", "GROUPED", "ROW_STAGED", "COL_STAGED",
         "FOUR_OVER_SIX", "SR_BLOCK_SCALE_UP"])(
    _quantize_kernel)
_quantize_2d_autotuned = autotune(_weight_configs(), key=["TUNE_M", "K", "EMIT_T", "EMIT_STAGED", "FOUR_OVER_SIX"])(
    _quantize_2d_kernel)
_amax_autotuned = autotune(_amax_configs(), key=["TUNE_M", "K", "ROW", "COL", "RHT"], reset_to_zero=["AMAX"])(
    _amax_kernel)


def _tuned(x: torch.Tensor) -> bool:
    """Autotune tiles on a GPU for large inputs; fixed tiles in the interpreter and for small ones."""
    return x.is_cuda and x.numel() >= 2**22


def launch_grid(rows: int, cols: int, G: int, BK: int, cols_first: bool) -> tuple[int, ...]:
    """The grid of a kernel tiled by program_tile over [rows, cols] in tiles of 16·G rows and BK columns."""
    nr, nc = cdiv(rows, 16 * G), cdiv(cols, BK)
    return (nr * nc,) if cols_first else (nr, nc)


def launch_tuned(kernel, tuned_kernel, x: torch.Tensor, rows: int, cols: int, *args, **flags) -> None:
    """Run kernel over [rows, cols] with autotuned tiles and program order (large CUDA inputs) or the
    fixed ones. The tuning is keyed on ``TUNE_M``, the rows rounded up to a power of two
    (launch.tune_bucket), so routed-token counts that change every step share one tuning."""
    flags["TUNE_M"] = tune_bucket(rows)
    if _tuned(x):
        launch(tuned_kernel, lambda meta: launch_grid(rows, cols, meta["G"], meta["BK"], meta["COLS_FIRST"]), *args,
               **flags)
    else:
        g, bk = (G_Q, BK_Q) if x.is_cuda else (G_I, BK_I)
        launch(kernel, launch_grid(rows, cols, g, bk, False), *args, **flags, G=g, BK=bk, num_warps=1)


#: Tiles of _quantize_2d_fused_kernel on a GPU, its expert lead and amax-tile span: the fastest of
#: `benchmarks/weight_quant_bench.py --experts 64 --n 1408 --k 2048 --configs ...` on an H100
#: (2026-11-26; faster than the two passes at 6-33 MB per expert too).
_FUSED_2D = {"G": 4, "BK": 128, "num_warps": 4, "LEAD": 1, "SPAN": 4}
#: Whether Triton's CPU interpreter takes that fused launch too. Off: the interpreter pays per program, and the
#: fused launch runs at least two per expert (an amax tile, a quantization tile) where the two passes (amaxes, then
#: the quantization) run a few in all; the bits are the same (tests/test_kernels.py runs the fused kernel with it on).
FUSED_2D_IN_INTERPRETER = False


# ----------------------------------------------------------------------------------------------- launchers

def _amax_buffer(x: torch.Tensor, amax: torch.Tensor | None, n: int) -> torch.Tensor:
    """int32 [n] holding fp32 bits of the amaxes to reduce into (0 = +0.0), or the given amax."""
    if amax is None:
        return torch.zeros(n, dtype=torch.int32, device=x.device)
    return _amax_bits(torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1).expand(n))


def _amax_bits(amaxes: torch.Tensor) -> torch.Tensor:
    """int32 fp32 bits of given fp32 amaxes, non-finite values as +inf (the kernels' convention)."""
    inf = float("inf")
    return torch.nan_to_num(amaxes.float(), nan=inf, posinf=inf, neginf=inf).contiguous().view(torch.int32)


def _given_amaxes(x: torch.Tensor, amax, amax_col, group_amaxes: torch.Tensor | None) -> torch.Tensor | None:
    """The amax buffer of quantize_operand_tensors when no amax is reduced from x: the given per-expert
    [2, E + 1] or the given row amax and column amax (the row one where no column amax is given: it
    is then the column operand's too, or unread). One or two small kernels instead of a zeroed buffer
    and a copy per amax. None when no amax is given."""
    if group_amaxes is not None:
        return _amax_bits(group_amaxes.reshape(-1))
    if amax_col is None:
        return None if amax is None else _amax_buffer(x, amax, 2)
    row = torch.as_tensor(amax if amax is not None else 0.0, dtype=torch.float32, device=x.device).reshape(1)
    return _amax_bits(torch.cat([row, torch.as_tensor(amax_col, dtype=torch.float32, device=x.device).reshape(1)]))


def signs_arg(signs: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The RHT signs as the kernels read them (contiguous, on the placeholder's device; fp32, or bf16/fp16 to
    round the transform's output to that dtype), or the placeholder when there are none (the kernel's RHT
    flag is then off and never reads it)."""
    if signs is None:
        return placeholder
    dtype = signs.dtype if signs.dtype in (torch.bfloat16, torch.float16) else torch.float32
    return signs.to(device=placeholder.device, dtype=dtype).contiguous()


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name}: expected a 2D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] % 16:
        raise ValueError(f"{name}: NVFP4 needs the contraction dim to be a multiple of 16, got shape {tuple(x.shape)}")
    if x.numel() >= 2**30:
        raise ValueError(f"{name}: {x.numel()} elements exceed the kernel's 2^30 element limit")


def amax_slots(x: torch.Tensor, groups: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(block-expert map, amax slots per operand): a dummy and 1 for one tensor scale; with ``groups``
    (offsets) one slot per expert plus one for the rows past the last group."""
    if groups is None:
        return _placeholder(x.device), 1
    if groups.dim() != 1 or groups.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped quantization: offsets must be a 1D integer tensor, got {tuple(groups.shape)} "
                         f"{groups.dtype}")
    groups = groups.to(x.device)
    if groups.is_cuda:  # one launch instead of block_experts' three kernels
        return block_experts_triton(groups.contiguous(), x.shape[0]), groups.numel() + 1
    return block_experts(groups, x.shape[0]), groups.numel() + 1


def quantize_operand_tensors(x2d: torch.Tensor, *, rowwise: bool = True, colwise: bool = False,
                             signs: torch.Tensor | None = None, stochastic_row: bool = False,
                             stochastic_col: bool = False, seed: torch.Tensor | None = None,
                             amax: torch.Tensor | None = None, amax_col: torch.Tensor | None = None,
                             groups: torch.Tensor | None = None, row_staged: bool = False, col_staged: bool = False,
                             four_over_six: bool = False, group_amaxes: torch.Tensor | None = None,
                             sr_block_scale: str = "nearest"):
    """``quantize_operand`` as plain tensors: (row codes, row scales, column codes, column scales,
    fp32 [gs_row, gs_col]); an operand not asked for comes back as empty tensors. With ``groups``
    (the cumulative expert offsets, multiples of 16) every expert's rows get a tensor scale of their
    own and the decode scales come back as fp32 [2, E + 1] (row, column; slot E: rows past the last
    expert). ``row_staged``: the row operand comes back as the GEMM's staged fp16 values q·e_b [M, K]
    (no global scale; exact) with empty scales, saving the GEMM's own staging pass; ``col_staged`` the
    same for the column operand, [K, M padded to 16]. ``four_over_six``: Four Over Six block and tensor scales.
    ``group_amaxes``: with ``groups``, fp32 [2, E + 1] per-expert (row, column) tensor amaxes to use (all-
    reduced across the ranks sharding the operand) instead of x2d's own. ``sr_block_scale``: "up" rounds the
    block scales of the stochastically rounded operands up (numerics/nvfp4.py), "nearest" to nearest."""
    _check_2d(x2d, "quantize_operand")
    check_sr_block_scale(sr_block_scale, stochastic_row or stochastic_col, "quantize_operand")
    M, K = x2d.shape
    Mpad = M + (-M) % 16
    dev = x2d.device
    if (stochastic_row or stochastic_col) and seed is None:
        raise ValueError("stochastic rounding needs a seed tensor")
    if groups is not None and (amax is not None or amax_col is not None):
        raise ValueError("quantize_operand: given amaxes and per-expert groups exclude each other")
    bexp, ns = amax_slots(x2d, groups)
    if group_amaxes is not None and (groups is None or tuple(group_amaxes.shape) != (2, ns)):
        raise ValueError(f"quantize_operand: group_amaxes must be fp32 [2, {ns}] with groups, got "
                         f"{tuple(group_amaxes.shape)}")
    gs = torch.empty(2 * ns, dtype=torch.float32, device=dev)  # the decode scales, written by the kernel
    # Without the RHT the column operand holds the same values as the rows: one amax serves both.
    same_amax = colwise and signs is None and amax_col is None and group_amaxes is None
    row_needed = amax is None and group_amaxes is None and (rowwise or same_amax)
    col_needed = colwise and signs is not None and amax_col is None and group_amaxes is None
    reduce = row_needed or col_needed
    buf = None if reduce else _given_amaxes(x2d, amax, amax_col, group_amaxes)
    if buf is None:  # int32 fp32 bits of the row amaxes, then the column ones, reduced here
        buf = torch.zeros(2 * ns, dtype=torch.int32, device=dev)
    signs_t = signs_arg(signs, buf)
    flags = dict(GROUPED=groups is not None)
    if reduce:
        if M > 0:
            launch_tuned(_amax_kernel, _amax_autotuned, x2d, M, K, x2d, M, K, x2d.stride(0), x2d.stride(1), buf, signs_t,
                    bexp, ns, ROW=row_needed, COL=col_needed, RHT=True, **flags)
        if amax is not None:  # given amaxes go in after the reduction (autotuning zeroes the buffer)
            buf[0:1] = _amax_buffer(x2d, amax, 1)
        if amax_col is not None:
            buf[1:2] = _amax_buffer(x2d, amax_col, 1)
        if same_amax:
            buf[ns:] = buf[:ns]
    def empty(dtype):  # a fresh one each: custom ops may not return one tensor twice
        return x2d.new_empty((0,), dtype=dtype)
    rd = torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if rowwise else empty(torch.uint8)
    rs = torch.empty((M, K // 16), dtype=torch.float8_e4m3fn, device=dev) if rowwise else empty(torch.float8_e4m3fn)
    if rowwise and row_staged:
        rd, rs = torch.empty((M, K), dtype=torch.float16, device=dev), empty(torch.float8_e4m3fn)
    cd = torch.empty((K, Mpad // 2), dtype=torch.uint8, device=dev) if colwise else empty(torch.uint8)
    cs = torch.empty((K, Mpad // 16), dtype=torch.float8_e4m3fn, device=dev) if colwise else empty(torch.float8_e4m3fn)
    if colwise and col_staged:
        cd, cs = torch.empty((K, Mpad), dtype=torch.float16, device=dev), empty(torch.float8_e4m3fn)
    if M > 0:
        launch_tuned(_quantize_kernel, _quantize_autotuned, x2d, Mpad, K,
                x2d, M, K, x2d.stride(0), x2d.stride(1), buf, gs, rd if rowwise else buf, rs if rowwise else buf,
                cd if colwise else buf, cs if colwise else buf, signs_t, seed if seed is not None else buf, Mpad,
                bexp, ns, ROW=rowwise, COL=colwise, RHT=signs is not None, STOCHASTIC_ROW=stochastic_row,
                STOCHASTIC_COL=stochastic_col, ROW_STAGED=rowwise and row_staged, COL_STAGED=colwise and col_staged,
                NSP2=next_pow2(2 * ns), FOUR_OVER_SIX=four_over_six, SR_BLOCK_SCALE_UP=sr_block_scale == "up",
                **flags)
    else:  # no program ran: the decode scales of an all-zero tensor
        gs.copy_(torch.reciprocal(global_encode_scale(buf.view(torch.float32), four_over_six)))
    return rd, rs, cd, cs, (gs.view(2, ns) if groups is not None else gs)


def operand_amax_tensors(x2d: torch.Tensor, colwise: bool, signs: torch.Tensor | None,
                         groups: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [max|x|, max|rht(x2dᵀ)|] (the column one equals the row one without ``signs``; 0 without
    ``colwise``), non-finite values giving +inf: the tensor amaxes quantize_operand would reduce, for a
    caller that all-reduces them across ranks first (distributed/). With ``groups`` (expert offsets)
    one pair per expert slot, as quantize_operand_tensors reduces them: fp32 [2, E + 1]."""
    _check_2d(x2d, "operand_amax")
    M, K = x2d.shape
    bexp, ns = amax_slots(x2d, groups)
    buf = torch.zeros(2 * ns, dtype=torch.int32, device=x2d.device)
    rht = colwise and signs is not None
    signs_t = signs_arg(signs if rht else None, buf)
    if M > 0:
        launch_tuned(_amax_kernel, _amax_autotuned, x2d, M, K, x2d, M, K, x2d.stride(0), x2d.stride(1), buf, signs_t,
                bexp, ns, ROW=True, COL=rht, RHT=True, GROUPED=groups is not None)
    if colwise and not rht:
        buf[ns:] = buf[:ns]
    out = buf.view(torch.float32)
    return out.view(2, ns) if groups is not None else out


def quantize_operand(x2d: torch.Tensor, *, rowwise: bool = True, colwise: bool = False,
                     signs: torch.Tensor | None = None, stochastic_row: bool = False, stochastic_col: bool = False,
                     seed: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                     amax_col: torch.Tensor | None = None, four_over_six: bool = False,
                     sr_block_scale: str = "nearest") -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """NVFP4 of x2d [M, K] with 1×16 blocks along K (``rowwise``) and of x2dᵀ with 16-element blocks
    along the tokens, after the RHT when ``signs`` is given, tokens zero-padded to a multiple of 16
    (``colwise``): both from one read of x2d. ``seed``: an int64 device tensor for Philox."""
    out = quantize_operand_tensors(x2d, rowwise=rowwise, colwise=colwise, signs=signs, stochastic_row=stochastic_row,
                                   stochastic_col=stochastic_col, seed=seed, amax=amax, amax_col=amax_col,
                                   four_over_six=four_over_six, sr_block_scale=sr_block_scale)
    return operand_pair(out, x2d.shape, rowwise, colwise)


def quantize_weight_2d_tensors(w: torch.Tensor, amax: torch.Tensor | None = None, emit_transpose: bool = True, *,
                               experts: int = 1, staged: bool = False, four_over_six: bool = False,
                               staged_into: tuple[torch.Tensor, int] | None = None):
    """``quantize_weight_2d`` as plain tensors: (codes, scales, codes of Wᵀ, scales of Wᵀ, fp32 decode
    scales [experts]); without ``emit_transpose`` the last-but-one two are empty. ``experts`` > 1: w
    stacks that many expert weights along its rows ([E·N, K]), each with its own tensor scale; the
    transpose is then that of the whole stack, [K, E·N]. ``staged``: W itself comes as the GEMM's
    staged fp16 values [N, K] (exact) with empty scales; Wᵀ stays codes (what backward keeps).
    ``staged_into`` (with ``staged``): (buffer, rows per expert in it): expert e's staged rows go to
    buffer rows e·rows.. instead of a new [N, K] tensor, which comes back as given.
    ``four_over_six``: Four Over Six tile and tensor scales."""
    _check_2d(w, "quantize_weight_2d")
    N, K = w.shape
    if N % (16 * experts):
        raise ValueError(f"quantize_weight_2d: 16x16 blocks need both dims to be multiples of 16, got "
                         f"{tuple(w.shape) if experts == 1 else (experts, N // experts, K)}")
    if amax is not None and amax.numel() != experts:
        raise ValueError(f"quantize_weight_2d: a given amax needs one value per expert ({experts}), got "
                         f"{tuple(amax.shape)}")
    dev = w.device
    grouped = experts > 1
    bexp = _expert_blocks(experts, N // 16 // experts, dev) if grouped else _placeholder(dev)
    # stacked experts reduce their amaxes in the quantizing launch (_quantize_2d_fused_kernel), whose
    # buffer also holds its tile counters
    fused = grouped and amax is None and N > 0 and (w.is_cuda or FUSED_2D_IN_INTERPRETER)
    buf = torch.zeros(2 * experts if fused else experts, dtype=torch.int32, device=dev)  # fp32 bits of the amaxes
    gs = torch.empty(experts, dtype=torch.float32, device=dev)
    if amax is None and N > 0 and not fused:
        launch_tuned(_amax_kernel, _amax_autotuned, w, N, K, w, N, K, w.stride(0), w.stride(1), buf, buf, bexp, experts,
                ROW=True, COL=False, RHT=False, GROUPED=grouped)
    elif amax is not None:
        buf.copy_(_amax_bits(torch.as_tensor(amax, dtype=torch.float32, device=dev).reshape(experts)))
    d_rows, d_expert = N // experts, (N // experts) * K
    if not staged:  # codes and scales of W (staged values need no scales: S stays empty)
        d = torch.empty((N, K // 2), dtype=torch.uint8, device=dev)
        s = torch.empty((N // 16, K // 16), dtype=torch.float8_e4m3fn, device=dev)
    elif staged_into is None:
        d, s = torch.empty((N, K), dtype=torch.float16, device=dev), _no_scales(dev)
    else:
        d, rows = staged_into
        if (d.dtype != torch.float16 or d.stride(1) != 1 or d.stride(0) != K or rows < N // experts
                or d.shape[0] < (experts - 1) * rows + N // experts):
            raise ValueError(f"quantize_weight_2d: staged_into must be a row-major fp16 buffer of {K} columns "
                             f"holding {experts} experts of at least {N // experts} rows every {rows} rows, got "
                             f"{tuple(d.shape)} {d.dtype}")
        s, d_expert = _no_scales(dev), rows * K
    dt = torch.empty((K, N // 2) if emit_transpose else (0,), dtype=torch.uint8, device=dev)
    st = torch.empty((K // 16, N // 16) if emit_transpose else (0,), dtype=torch.float8_e4m3fn, device=dev)
    if fused:
        g, bk, warps = (_FUSED_2D["G"], _FUSED_2D["BK"], _FUSED_2D["num_warps"]) if w.is_cuda else (G_I, BK_I, 1)
        lead, span = _FUSED_2D["LEAD"], _FUSED_2D["SPAN"]
        tq = cdiv(N // experts // 16, g) * cdiv(K, bk)
        programs = experts * (tq + cdiv(tq, span))  # every expert's quantization and amax tiles
        launch(_quantize_2d_fused_kernel, (programs,), w, K, w.stride(0), w.stride(1), buf, gs, d, s,
               dt if emit_transpose else d, st if emit_transpose else s, experts, d_rows, d_expert,
               EMIT_T=emit_transpose, EMIT_STAGED=staged, G=g, BK=bk, FOUR_OVER_SIX=four_over_six, LEAD=lead, SPAN=span,
               num_warps=warps)
    elif N > 0:
        launch_tuned(_quantize_2d_kernel, _quantize_2d_autotuned, w, N, K,
                w, N, K, w.stride(0), w.stride(1), buf, gs, d, s, dt if emit_transpose else d,
                st if emit_transpose else s, bexp, experts, d_rows, d_expert, EMIT_T=emit_transpose, GROUPED=grouped,
                EMIT_STAGED=staged, NSP2=next_pow2(experts), FOUR_OVER_SIX=four_over_six)
    else:
        gs.copy_(torch.reciprocal(global_encode_scale(buf.view(torch.float32), four_over_six)))
    return d, s, dt, st, gs


def _no_scales(dev) -> torch.Tensor:
    """The empty scale tensor of a staged operand (its fp16 values carry their block scales)."""
    return torch.empty((0,), dtype=torch.float8_e4m3fn, device=dev)


def expert_amax_tensors(w: torch.Tensor, experts: int) -> torch.Tensor:
    """fp32 [experts]: the tensor amax of each of ``experts`` expert weights stacked along w's rows (what
    quantize_weight_2d_tensors reduces; non-finite values give +inf), for a caller that all-reduces them."""
    _check_2d(w, "expert_amax")
    N, K = w.shape
    buf = torch.zeros(experts, dtype=torch.int32, device=w.device)
    if N % (16 * experts):
        raise ValueError(f"expert_amax: {experts} experts of 16-row blocks do not tile {tuple(w.shape)}")
    if N > 0:
        launch_tuned(_amax_kernel, _amax_autotuned, w, N, K, w, N, K, w.stride(0), w.stride(1), buf, buf,
                _expert_blocks(experts, N // 16 // experts, w.device), experts, ROW=True, COL=False, RHT=False,
                GROUPED=True)
    return buf.view(torch.float32)


def _placeholder(device: torch.device) -> torch.Tensor:
    """int32 [1] for a kernel's pointer argument that its flags leave unread: allocated, never written (no
    launch). A fresh one per call: a cached one, made during a CUDA-graph warm-up, would stay alive in the
    graphs' memory pool, which inductor's CUDA graph trees refuse (untracked live allocation)."""
    return torch.empty(1, dtype=torch.int32, device=device)


def _expert_blocks(experts: int, blocks_per_expert: int, device: torch.device) -> torch.Tensor:
    """int32 expert index of each 16-row block of E stacked expert weights. Made per call, not cached: one made
    during a CUDA-graph warm-up would stay alive in the graphs' pool, which CUDA graph trees refuse."""
    return torch.arange(experts, dtype=torch.int32, device=device).repeat_interleave(blocks_per_expert)


def quantize_weight_2d(w: torch.Tensor, amax: torch.Tensor | None = None, emit_transpose: bool = True, *,
                       four_over_six: bool = False) -> tuple[NVFP4Tensor, NVFP4Tensor | None]:
    """16×16-block NVFP4 of w [N, K] and, sharing its scales, of wᵀ (what dgrad reads)."""
    wq, wt = weight_pair(quantize_weight_2d_tensors(w, amax, emit_transpose, four_over_six=four_over_six), w.shape)
    return wq, (wt if emit_transpose else None)
