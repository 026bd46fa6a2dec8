"""Emulated grouped NVFP4 GEMMs of MoE experts in Triton: one launch for all experts, the expert
offsets read on the device (no host sync), per-expert global scales and bias in the epilogue.

  grouped_gemm_rows    out[rows of e] = A[rows of e] · B_eᵀ      fprop and dgrad: tokens along M
  grouped_gemm_tokens  out[e] = A[:, tokens of e] · B[:, tokens of e]ᵀ   wgrad: tokens along K

Operands are staged fp16 values q·e_b, exact, as in gemm.py (``stage`` turns an NVFP4 storage into
them; the quantization kernel can also emit them directly). ``offsets`` [E] are the cumulative
token counts (TorchTitan's), multiples of 16 so that no 16-token block straddles two experts.
Rows past offsets[-1] belong to no expert: grouped_gemm_rows writes zeros there (the tiles of a
pseudo-expert E), so no memset is needed. The B operand of expert e starts at row e·b_row_step and
column e·b_col_step of the stacked B: (N, 0) for W [E·N, K], (0, N) for the 16×16 Wᵀ [K, E·N].

On sm_90 (and in the interpreter) grouped_gemm_rows runs a persistent kernel: one program per SM walks
the tiles of all experts, their count read from the offsets on the device, through TMA descriptors
built on the device (ROWS_KERNEL; 1–1.5% faster than one tile per program on an H100, ``benchmarks/bench_grouped_gemms.py``).

Reference twin: the per-expert loop of grouped_function.py over ops/gemm.py:gemm_reference
(tests/test_grouped.py checks them bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import StagedOperand
from .platform import interpreting
from .gemm import (dequantize_fp16, ensure_scratch_allocator, fixed_tiles, persistent_programs, set_b_block, swizzle_tile,
                   tma_descriptor, tma_storable, tma_supported, tma_tiles_fit)
from .launch import autotune, cdiv, launch, next_pow2
from .nvfp4_jit import round_to


def _configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s, pre_hook=set_b_block)
            for bm, bn, bk, w, s in ((128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 128, 8, 3),
                                     (64, 256, 64, 4, 4))]


@triton.jit
def _expert_tiles(OFFS, E, T, BM: tl.constexpr, tiles_n, EP: tl.constexpr):
    """The tile table over expert slots i < EP: (i, first row, end row, tiles ⌈rows/BM⌉·tiles_n, their
    running sum), where expert e owns that many consecutive tiles and slot E is the tail [offsets[-1], T)."""
    i = tl.arange(0, EP)
    ends = tl.where(i < E, tl.load(OFFS + i, mask=i < E, other=0), T)
    starts = tl.where(i <= E, tl.load(OFFS + i - 1, mask=(i > 0) & (i <= E), other=0), T)
    ntiles = tl.cdiv(ends - starts, BM) * tiles_n
    return i, starts, ends, ntiles, tl.cumsum(ntiles, 0)


@triton.jit
def _tile_owner(tile, i, starts, ends, ntiles, cum):
    """(e, first row, end row, tile index within e) of linear tile ``tile`` in the table of _expert_tiles;
    e > E: past the last tile."""
    e = tl.sum((cum <= tile).to(tl.int32), 0)
    first = tl.sum(tl.where(i == e, cum - ntiles, 0), 0)
    start = tl.sum(tl.where(i == e, starts, 0), 0)
    end = tl.sum(tl.where(i == e, ends, 0), 0)
    return e, start, end, tile - first


@triton.jit
def _rows_epilogue(acc, e, E, m0, end, pid_n, N, GSA, GSB, BIAS, C, CIN, scm, N_SPLIT, GSB_HI,
                   HAS_BIAS: tl.constexpr, ACC: tl.constexpr, NATIVE: tl.constexpr, SPLIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    """Expert e's tile · GSA[e]·GSB[e] (+ BIAS[e]), zeros for the tail pseudo-expert E, stored for the
    rows before ``end`` and the columns before N. ``ACC``: C = CIN + that tile as rounded to C's dtype,
    summed in fp32 and rounded (nearest-even) again: what adding two separate outputs would give.
    ``SPLIT``: B stacks two weights per expert, columns from N_SPLIT on take GSB[GSB_HI + e]."""
    ec = tl.minimum(e, E - 1)
    rm = m0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if SPLIT:
        out = acc * (tl.load(GSA + e) * tl.load(GSB + ec + tl.where(rn >= N_SPLIT, GSB_HI, 0)))[None, :]
    else:
        out = acc * (tl.load(GSA + e) * tl.load(GSB + ec))
    if HAS_BIAS:
        out = out + tl.load(BIAS + ec * N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = tl.where(e < E, out, 0.0)
    offs = rm[:, None].to(tl.int64) * scm + rn[None, :]
    mask = (rm < end)[:, None] & (rn < N)[None, :]
    dt = C.dtype.element_ty
    if ACC:
        prev = tl.load(CIN + offs, mask=mask, other=0.0).to(tl.float32)
        out = round_to(prev + out.to(dt).to(tl.float32), dt, NATIVE)
    tl.store(C + offs, out.to(dt), mask=mask)


@triton.jit
def _grouped_rows_kernel(A, a_desc, B, b_desc, OFFS, GSA, GSB, BIAS, C, CIN, E, T, N, K, B_ROW_STEP, B_COL_STEP,
                         sam, sbn, scm, N_SPLIT, GSB_HI, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                         NATIVE: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, EP: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """C [T, N] = A [T, K] · B_eᵀ per expert row range, · GSA[e]·GSB[e] (+ BIAS[e]); zeros past the
    last expert. A's tile rows past an expert's end are computed and not stored; B_e's tile columns
    past K (dgrad, B = Wᵀ) read the next expert's weights against A's zero-filled columns."""
    tiles_n = tl.cdiv(N, BN)
    i, starts, ends, ntiles, cum = _expert_tiles(OFFS, E, T, BM, tiles_n, EP)
    e, start, end, local = _tile_owner(tl.program_id(0), i, starts, ends, ntiles, cum)
    if e <= E:
        pid_m, pid_n = swizzle_tile(local, tl.cdiv(end - start, BM), tiles_n, GROUP_M)
        m0 = start + pid_m * BM
        rm = m0 + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        b_row0 = e * B_ROW_STEP
        b_col0 = e * B_COL_STEP
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(e < E, K, 0)  # the tail pseudo-expert only writes zeros
        for k0 in range(0, k_end, BK):
            if TMA:
                a = a_desc.load([m0, k0])
                b = b_desc.load([b_row0 + pid_n * BN, b_col0 + k0])
            else:
                kmask = (k0 + rk < K)[None, :]
                a = tl.load(A + rm[:, None].to(tl.int64) * sam + (k0 + rk)[None, :],
                            mask=(rm < end)[:, None] & kmask, other=0.0)
                b = tl.load(B + (b_row0 + rn)[:, None].to(tl.int64) * sbn + (b_col0 + k0 + rk)[None, :],
                            mask=(rn < N)[:, None] & kmask, other=0.0)
            acc = tl.dot(a, b.T, acc)
        _rows_epilogue(acc, e, E, m0, end, pid_n, N, GSA, GSB, BIAS, C, CIN, scm, N_SPLIT, GSB_HI, HAS_BIAS, ACC,
                       NATIVE, SPLIT, BM, BN)


@triton.jit
def _grouped_rows_persistent_kernel(A, B, OFFS, GSA, GSB, BIAS, C, CIN, E, T, N, K, B_ROWS, B_COLS, B_ROW_STEP,
                                    B_COL_STEP, sam, sbn, scm, N_SPLIT, GSB_HI, HAS_BIAS: tl.constexpr,
                                    ACC: tl.constexpr, NATIVE: tl.constexpr, SPLIT: tl.constexpr, EP: tl.constexpr,
                                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                                    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr):
    """_grouped_rows_kernel as a persistent kernel (sm_90, staged operands): one program per SM walks
    the tiles of all experts (the count read from the offsets on the device), A and the stacked B
    through TMA descriptors built on the device. FLATTEN fuses the tile and K loops so that the next
    tile's loads overlap this tile's epilogue (benchmarks/bench_grouped.py compares both)."""
    a_desc = tl.make_tensor_descriptor(A, shape=[T, K], strides=[sam, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[B_ROWS, B_COLS], strides=[sbn, 1], block_shape=[BN, BK])
    tiles_n = tl.cdiv(N, BN)
    i, starts, ends, ntiles, cum = _expert_tiles(OFFS, E, T, BM, tiles_n, EP)
    for tile in tl.range(tl.program_id(0), tl.sum(ntiles, 0), NUM_PROGRAMS, flatten=FLATTEN):
        e, start, end, local = _tile_owner(tile, i, starts, ends, ntiles, cum)
        pid_m, pid_n = swizzle_tile(local, tl.cdiv(end - start, BM), tiles_n, GROUP_M)
        m0 = start + pid_m * BM
        b_row0 = e * B_ROW_STEP + pid_n * BN
        b_col0 = e * B_COL_STEP
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(e < E, K, 0)  # the tail pseudo-expert only writes zeros
        for k0 in range(0, k_end, BK):
            a = a_desc.load([m0, k0])
            b = b_desc.load([b_row0, b_col0 + k0])
            acc = tl.dot(a, b.T, acc)
        _rows_epilogue(acc, e, E, m0, end, pid_n, N, GSA, GSB, BIAS, C, CIN, scm, N_SPLIT, GSB_HI, HAS_BIAS, ACC,
                       NATIVE, SPLIT, BM, BN)


def _persistent_configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8}, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((128, 256, 8, 3), (128, 128, 4, 4), (128, 128, 8, 4))]


@triton.jit
def _grouped_tokens_kernel(A, a_desc, B, b_desc, OFFS, GSA, GSB, C, M, N, sam, sbn, scm, scn, TMA: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """C[e] = A[:, tokens of e] · B[:, tokens of e]ᵀ · GSA[e]·GSB[e] at C + e·M·N + i·scm + j·scn;
    A [M, T], B [N, T]. The last, partial step of an expert zeroes A's columns past its end (the next
    expert's tokens); an empty expert writes zeros."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    e = tl.program_id(0) // (tiles_m * tiles_n)
    pid_m, pid_n = swizzle_tile(tl.program_id(0) % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    end = tl.load(OFFS + e)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    full_end = start + ((end - start) // BK) * BK
    for k0 in range(start, full_end, BK):
        if TMA:
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([pid_n * BN, k0])
        else:
            a = tl.load(A + rm[:, None].to(tl.int64) * sam + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
            b = tl.load(B + rn[:, None].to(tl.int64) * sbn + (k0 + rk)[None, :], mask=(rn < N)[:, None], other=0.0)
        acc = tl.dot(a, b.T, acc)
    if full_end < end:
        kmask = (full_end + rk < end)[None, :]
        if TMA:
            a = a_desc.load([pid_m * BM, full_end])
            b = b_desc.load([pid_n * BN, full_end])
        else:
            a = tl.load(A + rm[:, None].to(tl.int64) * sam + (full_end + rk)[None, :], mask=(rm < M)[:, None] & kmask,
                        other=0.0)
            b = tl.load(B + rn[:, None].to(tl.int64) * sbn + (full_end + rk)[None, :], mask=(rn < N)[:, None] & kmask,
                        other=0.0)
        acc = tl.dot(tl.where(kmask, a, tl.zeros_like(a)), b.T, acc)
    out = acc * (tl.load(GSA + e) * tl.load(GSB + e))
    tl.store(C + e.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * scm + rn[None, :].to(tl.int64) * scn,
             out.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


_FIT = {"early_config_prune": tma_tiles_fit}
_rows_autotuned = autotune(_configs(), key=["E", "N", "K", "B_ROW_STEP", "B_COL_STEP", "TMA", "ACC"],
                           prune_configs_by=_FIT)(_grouped_rows_kernel)
_tokens_autotuned = autotune(_configs(), key=["M", "N", "TMA"], prune_configs_by=_FIT)(_grouped_tokens_kernel)
_rows_persistent_autotuned = autotune(_persistent_configs(), key=["E", "N", "K", "B_ROW_STEP", "B_COL_STEP",
                                                                        "FLATTEN", "ACC"])(_grouped_rows_persistent_kernel)

#: The rows GEMM's kernel on sm_90 with TMA: "persistent" (flattened loops), "persistent_nested", or
#: "tiles" (one tile per program); benchmarks/bench_grouped.py --rows-kernel compares them.
ROWS_KERNEL = "persistent"


#: Whether grouped_gemm_tokens may swap its operands where that pads fewer tiles (benchmarks compare).
SWAP_WGRAD = True


def _padded(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _autotune(x: torch.Tensor, work: int) -> bool:
    return x.is_cuda and not interpreting() and work >= 2**22


def stage(t: NVFP4Tensor | StagedOperand) -> torch.Tensor:
    """fp16 q·e_b of an NVFP4 storage, or of an operand the quantization kernel already staged."""
    return t.values if isinstance(t, StagedOperand) else dequantize_fp16(t)


def grouped_gemm_rows(a16: torch.Tensor, b16: torch.Tensor, offsets: torch.Tensor, gs_a: torch.Tensor,
                      gs_b: torch.Tensor, n_out: int, b_row_step: int, b_col_step: int, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None, add_to: torch.Tensor | None = None,
                      n_split: int = 0) -> torch.Tensor:
    """out [T, n_out]: row range r of expert e is A[r] · B_eᵀ · gs_a[e]·gs_b[e] (+ bias[e]) over the
    staged a16 [T, K] and b16, where B_e is the [n_out, K] window of b16 at (e·b_row_step,
    e·b_col_step); zeros past the last expert. gs_a [≥E+1], gs_b [≥E]: per-expert decode scales.
    ``add_to`` [T, n_out] of out_dtype: out is add_to + that product, as two outputs added in
    out_dtype (the dgrads of W1 and W3 summed in the epilogue, without a pass of their own).
    ``n_split`` > 0: B_e stacks two weights (W1_e over W3_e, one GEMM for both), gs_b is [2, ≥E] and
    the output columns from n_split on take gs_b[1]."""
    T, K = a16.shape
    E = offsets.numel()
    if n_split and (bias is not None or gs_b.dim() != 2 or gs_b.shape[0] != 2 or not 0 < n_split < n_out):
        raise ValueError(f"grouped GEMM: two stacked weights need gs_b [2, E], no bias and 0 < n_split < {n_out}, "
                         f"got gs_b {tuple(gs_b.shape)}, n_split {n_split}")
    if add_to is not None and (add_to.shape != (T, n_out) or add_to.dtype != out_dtype or not add_to.is_contiguous()):
        raise ValueError(f"grouped GEMM: add_to must be a contiguous [{T}, {n_out}] {out_dtype} tensor, got "
                         f"{tuple(add_to.shape)} {add_to.dtype}")
    out = torch.empty((T, n_out), dtype=out_dtype, device=a16.device)
    if T == 0 or n_out == 0:
        return out
    tma = tma_supported(a16) and not interpreting()
    gsb_hi = gs_b.shape[-1] if n_split else 0
    gs_a, gs_b = gs_a.float().contiguous(), gs_b.float().contiguous()
    bias_arg = bias if bias is not None else out
    add_arg = add_to if add_to is not None else out
    if ROWS_KERNEL != "tiles" and (tma or interpreting()) and tma_storable(a16) and tma_storable(b16):
        progs = persistent_programs(a16)
        ensure_scratch_allocator(a16)
        args = (a16, b16, offsets, gs_a, gs_b, bias_arg, out, add_arg, E, T, n_out, K, b16.shape[0], b16.shape[1],
                b_row_step, b_col_step, a16.stride(0), b16.stride(0), out.stride(0), n_split, gsb_hi)
        kw = dict(HAS_BIAS=bias is not None, ACC=add_to is not None, NATIVE=not interpreting(),
                  EP=next_pow2(E + 1), NUM_PROGRAMS=progs, FLATTEN=ROWS_KERNEL == "persistent",
                  SPLIT=n_split > 0)
        if _autotune(a16, T * n_out):
            launch(_rows_persistent_autotuned, (progs,), *args, **kw)
        else:
            launch(_grouped_rows_persistent_kernel, (progs,), *args, **kw, **fixed_tiles(a16))
        return out
    a_arg, b_arg = (tma_descriptor(a16), tma_descriptor(b16)) if tma else (a16, b16)
    args = (a16, a_arg, b16, b_arg, offsets, gs_a, gs_b, bias_arg, out, add_arg, E, T, n_out, K, b_row_step,
            b_col_step, a16.stride(0), b16.stride(0), out.stride(0), n_split, gsb_hi)
    kw = dict(HAS_BIAS=bias is not None, ACC=add_to is not None, NATIVE=not interpreting(), TMA=tma,
              EP=next_pow2(E + 1), SPLIT=n_split > 0)
    if _autotune(a16, T * n_out):
        grid = lambda meta: ((cdiv(T, meta["BM"]) + E + 1) * cdiv(n_out, meta["BN"]),)  # noqa: E731
        launch(_rows_autotuned, grid, *args, **kw)
    else:
        t = fixed_tiles(a16)
        grid = ((cdiv(T, t["BM"]) + E + 1) * cdiv(n_out, t["BN"]),)
        launch(_grouped_rows_kernel, grid, *args, **kw, **t)
    return out


def grouped_gemm_tokens(a16: torch.Tensor, b16: torch.Tensor, offsets: torch.Tensor, gs_a: torch.Tensor,
                        gs_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out [E, M, N] with out[e] = A[:, tokens of e] · B[:, tokens of e]ᵀ · gs_a[e]·gs_b[e] over the
    staged a16 [M, T] and b16 [N, T] (16-element blocks along the tokens). Where N tiles worse than M
    (hidden 1408 is 5.5 tiles of 256 but 11 of 128: W2's wgrad), the kernel runs with the operands
    swapped and stores its tiles transposed: the same products and sums, less padding."""
    M, T = a16.shape
    N, Tb = b16.shape
    if T != Tb:
        raise ValueError(f"grouped wgrad GEMM: token dims differ, {tuple(a16.shape)} vs {tuple(b16.shape)}")
    E = offsets.numel()
    out = torch.empty((E, M, N), dtype=out_dtype, device=a16.device)
    if E == 0 or M == 0 or N == 0:
        return out
    tma = tma_supported(a16) and not interpreting()
    gs_a, gs_b = gs_a.float().contiguous(), gs_b.float().contiguous()
    strides = (N, 1)
    if SWAP_WGRAD and _padded(N, 128) * _padded(M, 256) < _padded(M, 128) * _padded(N, 256):
        a16, b16, gs_a, gs_b, M, N, strides = b16, a16, gs_b, gs_a, N, M, (1, N)  # out[e, i, j] at i·N + j
    a_arg, b_arg = (tma_descriptor(a16), tma_descriptor(b16)) if tma else (a16, b16)
    args = (a16, a_arg, b16, b_arg, offsets, gs_a, gs_b, out, M, N, a16.stride(0), b16.stride(0), *strides)
    if _autotune(a16, E * M * N):
        grid = lambda meta: (E * cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]),)  # noqa: E731
        launch(_tokens_autotuned, grid, *args, TMA=tma)
    else:
        t = fixed_tiles(a16)
        launch(_grouped_tokens_kernel, (E * cdiv(M, t["BM"]) * cdiv(N, t["BN"]),), *args, TMA=tma, **t)
    return out


__all__ = ["grouped_gemm_rows", "grouped_gemm_tokens", "stage"]
