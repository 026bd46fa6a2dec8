"""Emulated NVFP4 GEMM in Triton: out = (A · Bᵀ) · (gs_A · gs_B) [+ bias], for GPUs without FP4 tensor
cores (sm_80–sm_90, ROCm) and for the CPU interpreter.

Both operands arrive packed (two E2M1 codes per byte, 1×16 or 16×16 E4M3 block scales). Each K step
loads bytes and scales, builds exact fp16 values in registers and feeds the 16-bit tensor cores:

  * the code's 3 magnitude bits shifted into fp16's exponent/mantissa give q·2⁻¹⁴ exactly (E2M1 is
    fp16 with its exponent bias off by 14), so q·e_b·2⁻¹⁴ is one fp16 multiply, exact because
    q·e_b has at most 5 significant bits and its smallest step, 2⁻¹⁰, times 2⁻¹⁴ is fp16's 2⁻²⁴;
  * low and high nibbles are two K-permuted half-tiles multiplied separately (any permutation of
    K shared by both operands leaves A·Bᵀ unchanged), so no interleave is needed;
  * the fp32 accumulator holds 2⁻²⁸·Σ q_a e_a q_b e_b; the epilogue multiplies by 2²⁸ (exact) and by
    gs_A·gs_B, adds the bias in fp32 and rounds once to the output dtype, as the reference does.

Reference twin: titan_nvfp4/ops/gemm.py:gemm_reference (checked in tests/test_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.nvfp4 import NVFP4Tensor


def _configs():
    out = []
    for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 64, 4, 4),
                             (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 128, 128, 4, 4),
                             (128, 128, 256, 8, 2), (128, 256, 64, 8, 3), (256, 128, 64, 8, 4),
                             (128, 128, 128, 4, 3), (64, 256, 128, 8, 3)):
        out.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s))
    return out


@triton.jit
def _fp16_operand(packed, scale16, R: tl.constexpr, BK: tl.constexpr):
    """[R, BK/2] bytes and [R, BK/16] fp16 scales -> (low-nibble, high-nibble) fp16 tiles [R, BK/2]
    holding q·e_b·2⁻¹⁴ exactly."""
    b = packed.to(tl.uint16)
    lo = (((b & 0x7) << 9) | ((b & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    s = tl.reshape(tl.broadcast_to(scale16[:, :, None], (R, BK // 16, 8)), (R, BK // 2))
    return lo * s, hi * s


@triton.jit
def _nvfp4_gemm_body(A, SA, B, SB, GSA, GSB, BIAS, C, M, N, K,
                     sam, sbn, ssam, ssak, ssbn, ssbk, scm, scn,
                     A_SCALE_DIV: tl.constexpr, B_SCALE_DIV: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rb = tl.arange(0, BK // 2)
    rs = tl.arange(0, BK // 16)
    mask_m = rm < M
    mask_n = rn < N
    a_ptr = A + rm[:, None].to(tl.int64) * sam + rb[None, :]
    b_ptr = B + rn[:, None].to(tl.int64) * sbn + rb[None, :]
    sa_ptr = SA + (rm // A_SCALE_DIV)[:, None].to(tl.int64) * ssam + rs[None, :] * ssak
    sb_ptr = SB + (rn // B_SCALE_DIV)[:, None].to(tl.int64) * ssbn + rs[None, :] * ssbk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kb = k0 // 2 + rb
        ks = k0 // 16 + rs
        a_raw = tl.load(a_ptr, mask=mask_m[:, None] & (kb < K // 2)[None, :], other=0)
        b_raw = tl.load(b_ptr, mask=mask_n[:, None] & (kb < K // 2)[None, :], other=0)
        sa = tl.load(sa_ptr, mask=mask_m[:, None] & (ks < K // 16)[None, :], other=0.0).to(tl.float16)
        sb = tl.load(sb_ptr, mask=mask_n[:, None] & (ks < K // 16)[None, :], other=0.0).to(tl.float16)
        a_lo, a_hi = _fp16_operand(a_raw, sa, BM, BK)
        b_lo, b_hi = _fp16_operand(b_raw, sb, BN, BK)
        acc = tl.dot(a_lo, tl.trans(b_lo), acc)
        acc = tl.dot(a_hi, tl.trans(b_hi), acc)
        a_ptr += BK // 2
        b_ptr += BK // 2
        sa_ptr += (BK // 16) * ssak
        sb_ptr += (BK // 16) * ssbk

    gs = tl.load(GSA) * tl.load(GSB)
    out = (acc * 268435456.0) * gs  # 2^28 undoes the 2^-14 of each operand exactly
    if HAS_BIAS:
        out = out + tl.load(BIAS + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptr = C + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
    tl.store(c_ptr, out.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_nvfp4_gemm_autotuned = triton.autotune(configs=_configs(), key=["M", "N", "K", "A_SCALE_DIV", "B_SCALE_DIV"])(
    _nvfp4_gemm_body)

#: Fixed tiles for the CPU interpreter and small problems (autotuning there would only cost time).
SMALL_TILES = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 4}


def _scale_div(t: NVFP4Tensor) -> int:
    return 16 if tuple(t.block_shape) == (16, 16) else 1


def nvfp4_gemm_triton(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None, autotune: bool | None = None) -> torch.Tensor:
    """out [M, N] = Σ_k A[m, k] B[n, k] over the storages of a and b (contraction along their rows)."""
    M, K = a.storage_shape
    N, Kb = b.storage_shape
    if K != Kb:
        raise ValueError(f"NVFP4 GEMM contraction mismatch: {a.storage_shape} vs {b.storage_shape}")
    for t, name in ((a, "A"), (b, "B")):
        if t.data.stride(1) != 1:
            raise ValueError(f"NVFP4 GEMM operand {name}: packed codes must be contiguous along K")
    out = torch.empty((M, N), dtype=out_dtype, device=a.data.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.copy_((bias.to(out_dtype).expand(M, N) if bias is not None else torch.zeros_like(out)))
        return out
    bias_t = bias.contiguous() if bias is not None else out
    gsa = a.global_scale.reshape(1).float()
    gsb = b.global_scale.reshape(1).float()
    args = (a.data, a.scale, b.data, b.scale, gsa, gsb, bias_t, out, M, N, K,
            a.data.stride(0), b.data.stride(0), a.scale.stride(0), a.scale.stride(1),
            b.scale.stride(0), b.scale.stride(1), out.stride(0), out.stride(1))
    kw = dict(A_SCALE_DIV=_scale_div(a), B_SCALE_DIV=_scale_div(b), HAS_BIAS=bias is not None)
    if autotune is None:
        autotune = a.data.is_cuda and M * N >= 128 * 128
    if autotune:
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        _nvfp4_gemm_autotuned[grid](*args, **kw)
    else:
        grid = (triton.cdiv(M, SMALL_TILES["BM"]) * triton.cdiv(N, SMALL_TILES["BN"]),)
        _nvfp4_gemm_body[grid](*args, **kw, **SMALL_TILES)
    return out
