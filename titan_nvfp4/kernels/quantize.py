"""Triton NVFP4 quantization kernels (sm_80+, ROCm, and the CPU interpreter under TRITON_INTERPRET=1).

Two passes over the input: ``_amax_kernel`` reduces the tensor amax of x and, for the wgrad operand,
of the Hadamard-transformed xᵀ; ``_quantize_kernel`` then emits, from one read of x, the rowwise
1×16 operand (forward / dgrad) and the transposed operand with 16-element blocks along dim 0 (wgrad),
nearest-even or stochastic (Philox). ``_quantize_2d_kernel`` emits 16×16-block weights together with
the codes of Wᵀ. Reference twin: titan_nvfp4/numerics/nvfp4.py (checked in tests/test_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.nvfp4 import NVFP4Tensor, global_encode_scale
from .nvfp4_jit import global_encode_scale as _jit_global_scale
from .nvfp4_jit import nan_to_inf_abs, pack_pairs, quantize_rows16, rht16_rows, block_scales, e2m1_rne

BM_Q = 64  # tokens per program (a multiple of 16: whole RHT/wgrad blocks)
BK_Q = 64  # features per program


@triton.jit
def _amax_kernel(X, M, K, sxm, sxk, AMAX, SIGNS, ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr):
    """AMAX[0] |= max|x| and AMAX[1] |= max|rht(xᵀ)| (fp32 bits in int32; non-finite -> +inf)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    a = tl.max(tl.max(nan_to_inf_abs(x), axis=1), axis=0)
    if ROW:
        tl.atomic_max(AMAX, a.to(tl.int32, bitcast=True))
    if COL:
        if RHT:
            signs = tl.load(SIGNS + tl.arange(0, 16))
            y = rht16_rows(tl.reshape(tl.trans(x), (BK * BM // 16, 16)), signs, BK * BM // 16)
            a = tl.max(tl.max(nan_to_inf_abs(y), axis=1), axis=0)
        tl.atomic_max(AMAX + 1, a.to(tl.int32, bitcast=True))


@triton.jit
def _quantize_kernel(X, M, K, sxm, sxk, AMAX, RD, RS, CD, CS, SIGNS, SEED, Mpad,
                     ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
                     SR_ROW: tl.constexpr, SR_COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Row operand: RD [M, K/2], RS [M, K/16]. Column operand of xᵀ (tokens zero-padded to Mpad):
    CD [K, Mpad/2], CS [K, Mpad/16]. Philox offsets: row element (m, k) -> m·K + k, column element
    (k, m) -> M·K + k·Mpad + m, so the two roundings draw independent numbers from one seed."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    seed = tl.load(SEED)  # a dummy pointer when neither rounding is stochastic
    rk2 = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    rk16 = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    if ROW:
        s = _jit_global_scale(tl.load(AMAX).to(tl.float32, bitcast=True))
        offs = rm[:, None] * K + rk[None, :]
        packed, e = quantize_rows16(x, s, BM, BK, SR_ROW, seed, offs)
        row = rm[:, None].to(tl.int64)
        tl.store(RD + row * (K // 2) + rk2[None, :], packed, mask=(rm < M)[:, None] & (rk2 < K // 2)[None, :])
        tl.store(RS + row * (K // 16) + rk16[None, :], e, mask=(rm < M)[:, None] & (rk16 < K // 16)[None, :])
    if COL:
        y = tl.trans(x)  # [BK, BM]
        if RHT:
            signs = tl.load(SIGNS + tl.arange(0, 16))
            y = tl.reshape(rht16_rows(tl.reshape(y, (BK * BM // 16, 16)), signs, BK * BM // 16), (BK, BM))
        s = _jit_global_scale(tl.load(AMAX + 1).to(tl.float32, bitcast=True))
        offs = M * K + rk[:, None] * Mpad + rm[None, :]
        packed, e = quantize_rows16(y, s, BK, BM, SR_COL, seed, offs)
        rm2 = tl.program_id(0) * (BM // 2) + tl.arange(0, BM // 2)
        rm16 = tl.program_id(0) * (BM // 16) + tl.arange(0, BM // 16)
        col = rk[:, None].to(tl.int64)
        tl.store(CD + col * (Mpad // 2) + rm2[None, :], packed, mask=(rk < K)[:, None] & (rm2 < Mpad // 2)[None, :])
        tl.store(CS + col * (Mpad // 16) + rm16[None, :], e, mask=(rk < K)[:, None] & (rm16 < Mpad // 16)[None, :])


@triton.jit
def _quantize_2d_kernel(W, N, K, swn, swk, AMAX, D, S, DT, EMIT_T: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """16×16 blocks, nearest-even: D [N, K/2], S [N/16, K/16], and DT [K, N/2], the codes of Wᵀ
    (the tiles of Wᵀ are the transposed tiles of W, so they share S)."""
    rn = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(W + rn[:, None].to(tl.int64) * swn + rk[None, :] * swk, mask=mask, other=0.0).to(tl.float32)
    s = _jit_global_scale(tl.load(AMAX).to(tl.float32, bitcast=True))
    tiles = tl.reshape(w, (BM // 16, 16, BK // 16, 16))
    bamax = tl.max(tl.max(nan_to_inf_abs(tiles), axis=3), axis=1)
    e, r = block_scales(bamax, s)
    codes = e2m1_rne(tl.reshape(tiles * r[:, None, :, None], (BM, BK)))
    rk2 = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(D + rn[:, None].to(tl.int64) * (K // 2) + rk2[None, :], pack_pairs(codes, BM, BK),
             mask=(rn < N)[:, None] & (rk2 < K // 2)[None, :])
    rn16 = tl.program_id(0) * (BM // 16) + tl.arange(0, BM // 16)
    rk16 = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    tl.store(S + rn16[:, None] * (K // 16) + rk16[None, :], e, mask=(rn16 < N // 16)[:, None] & (rk16 < K // 16)[None, :])
    if EMIT_T:
        rn2 = tl.program_id(0) * (BM // 2) + tl.arange(0, BM // 2)
        tl.store(DT + rk[:, None].to(tl.int64) * (N // 2) + rn2[None, :], pack_pairs(tl.trans(codes), BK, BM),
                 mask=(rk < K)[:, None] & (rn2 < N // 2)[None, :])


def _quant_configs():
    return [triton.Config({"BM": bm, "BK": bk}, num_warps=w)
            for bm, bk, w in ((64, 64, 4), (64, 64, 8), (64, 128, 4), (128, 64, 8), (32, 128, 4), (128, 128, 8), (32, 64, 2))]


_quantize_autotuned = triton.autotune(_quant_configs(), key=["M", "K", "ROW", "COL", "RHT", "SR_ROW", "SR_COL"])(_quantize_kernel)
_quantize_2d_autotuned = triton.autotune(_quant_configs(), key=["N", "K", "EMIT_T"])(_quantize_2d_kernel)


def _tuned(x: torch.Tensor) -> bool:
    """Autotune tiles on a GPU for large inputs; fixed tiles in the interpreter and for small ones."""
    return x.is_cuda and x.numel() >= 2**22


# ----------------------------------------------------------------------------------------------- launchers

def _amax_buffer(x: torch.Tensor, amax: torch.Tensor | None, n: int) -> torch.Tensor:
    """int32 [n] holding fp32 bits of the amaxes to reduce into (0 = +0.0), or the given amax."""
    if amax is None:
        return torch.zeros(n, dtype=torch.int32, device=x.device)
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1)
    a = torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))  # kernel convention
    return a.expand(n).contiguous().view(torch.int32)


def _decode_scale(amax_bits: torch.Tensor) -> torch.Tensor:
    """1/S from the fp32 amax bits, exactly as the reference computes it (0-d fp32)."""
    amax = amax_bits.view(torch.float32).reshape(())
    return torch.reciprocal(global_encode_scale(amax))


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name}: expected a 2D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] % 16:
        raise ValueError(f"{name}: NVFP4 needs the contraction dim to be a multiple of 16, got shape {tuple(x.shape)}")
    if x.numel() >= 2**30:
        raise ValueError(f"{name}: {x.numel()} elements exceed the kernel's 2^30 element limit")


def quantize_operand(x2d: torch.Tensor, *, rowwise: bool = True, colwise: bool = False,
                     signs: torch.Tensor | None = None, stochastic_row: bool = False, stochastic_col: bool = False,
                     seed: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                     amax_col: torch.Tensor | None = None) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """NVFP4 of x2d [M, K] with 1×16 blocks along K (``rowwise``) and of x2dᵀ with 16-element blocks
    along the tokens, after the RHT when ``signs`` is given, tokens zero-padded to a multiple of 16
    (``colwise``): both from one read of x2d. ``seed``: an int64 device tensor for Philox."""
    _check_2d(x2d, "quantize_operand")
    M, K = x2d.shape
    Mpad = M + (-M) % 16
    dev = x2d.device
    if (stochastic_row or stochastic_col) and seed is None:
        raise ValueError("stochastic rounding needs a seed tensor")
    amax_bits = torch.zeros(2, dtype=torch.int32, device=dev)  # fp32 bits of the two amaxes
    if amax is not None:
        amax_bits[0:1] = _amax_buffer(x2d, amax, 1)
    if amax_col is not None:
        amax_bits[1:2] = _amax_buffer(x2d, amax_col, 1)
    # Without the RHT the column operand holds the same values as the rows: one amax serves both.
    row_needed = amax is None and (rowwise or (colwise and signs is None and amax_col is None))
    col_needed = colwise and signs is not None and amax_col is None
    grid = (triton.cdiv(max(M, 1), BM_Q), triton.cdiv(K, BK_Q))
    signs_t = signs.to(device=dev, dtype=torch.float32).contiguous() if signs is not None else amax_bits
    if (row_needed or col_needed) and M > 0:
        _amax_kernel[grid](x2d, M, K, x2d.stride(0), x2d.stride(1), amax_bits, signs_t,
                           ROW=row_needed, COL=col_needed, RHT=True, BM=BM_Q, BK=BK_Q)
    if colwise and signs is None and amax_col is None:
        amax_bits[1:2] = amax_bits[0:1]
    rd = torch.empty((M, K // 2), dtype=torch.uint8, device=dev) if rowwise else amax_bits
    rs = torch.empty((M, K // 16), dtype=torch.float8_e4m3fn, device=dev) if rowwise else amax_bits
    cd = torch.zeros((K, Mpad // 2), dtype=torch.uint8, device=dev) if colwise else amax_bits
    cs = torch.zeros((K, Mpad // 16), dtype=torch.float8_e4m3fn, device=dev) if colwise else amax_bits
    if M > 0:
        args = (x2d, M, K, x2d.stride(0), x2d.stride(1), amax_bits, rd, rs, cd, cs, signs_t,
                seed if seed is not None else amax_bits, Mpad)
        flags = dict(ROW=rowwise, COL=colwise, RHT=signs is not None, SR_ROW=stochastic_row, SR_COL=stochastic_col)
        if _tuned(x2d):
            _quantize_autotuned[lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(K, meta["BK"]))](*args, **flags)
        else:
            _quantize_kernel[grid](*args, **flags, BM=BM_Q, BK=BK_Q)
    row = col = None
    if rowwise:
        row = NVFP4Tensor(rd, rs, _decode_scale(amax_bits[0]), x2d.shape, (1, 16))
    if colwise:
        col = NVFP4Tensor(cd, cs, _decode_scale(amax_bits[1]), torch.Size((K, Mpad)), (1, 16))
    return row, col


def quantize_weight_2d(w: torch.Tensor, amax: torch.Tensor | None = None,
                       emit_transpose: bool = True) -> tuple[NVFP4Tensor, NVFP4Tensor | None]:
    """16×16-block NVFP4 of w [N, K] and, sharing its scales, of wᵀ (what dgrad reads)."""
    _check_2d(w, "quantize_weight_2d")
    N, K = w.shape
    if N % 16:
        raise ValueError(f"quantize_weight_2d: 16x16 blocks need both dims to be multiples of 16, got {tuple(w.shape)}")
    amax_bits = _amax_buffer(w, amax, 1)
    grid = (triton.cdiv(N, BM_Q), triton.cdiv(K, BK_Q))
    if amax is None and N > 0:
        _amax_kernel[grid](w, N, K, w.stride(0), w.stride(1), amax_bits, amax_bits,
                           ROW=True, COL=False, RHT=False, BM=BM_Q, BK=BK_Q)
    d = torch.empty((N, K // 2), dtype=torch.uint8, device=w.device)
    s = torch.empty((N // 16, K // 16), dtype=torch.float8_e4m3fn, device=w.device)
    dt = torch.empty((K, N // 2), dtype=torch.uint8, device=w.device) if emit_transpose else d
    if N > 0:
        args = (w, N, K, w.stride(0), w.stride(1), amax_bits, d, s, dt)
        if _tuned(w):
            _quantize_2d_autotuned[lambda meta: (triton.cdiv(N, meta["BM"]), triton.cdiv(K, meta["BK"]))](
                *args, EMIT_T=emit_transpose)
        else:
            _quantize_2d_kernel[grid](*args, EMIT_T=emit_transpose, BM=BM_Q, BK=BK_Q)
    gs = _decode_scale(amax_bits[0])
    wq = NVFP4Tensor(d, s, gs, w.shape, (16, 16))
    wt = NVFP4Tensor(dt, s.t().contiguous(), gs, torch.Size((K, N)), (16, 16)) if emit_transpose else None
    return wq, wt
