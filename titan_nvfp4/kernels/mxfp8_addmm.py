"""Triton MXFP8 GEMM onto an addend (OutControl's forward): out = C + A·Bᵀ, A [M, K] and B [N, K] staged MXFP8
operands (each E4M3 element times its block's power of two, exact in BF16: ops/gemm.py), C [M, N] the NVFP4 part's
output. Exact products and fp32 sums on the tensor cores (``tl.dot`` of BF16 into fp32; fp32 operands, as the
interpreter gets them, multiply in IEEE fp32), C added to the fp32 sums, one rounding to C's dtype.

One read of C and one write of the output, where a GEMM with an fp32 output, its cast and a separate sum move the
[M, N] tensor six times (16 bytes an element against 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import grouped_tile
from .launch import autotune, cdiv, launch, tune_bucket
from .nvfp4_jit import round_to
from .platform import interpreting


@triton.jit
def _mxfp8_addmm_kernel(A, B, C, OUT, M, N, K, sam, sbn, scm, som, TUNE_M,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        INTERPRET: tl.constexpr = False):
    """OUT[M, N] = C + A[M, K] · B[N, K]ᵀ (fp32 sums, one rounding); masked edges. ``INTERPRET``: Triton's CPU
    interpreter, whose BF16 dot multiplies wrongly and whose float-to-BF16 conversion truncates: the operands go to
    fp32 before the dot (the products are exact either way) and the result rounds by its bits."""
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * sam + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(B + rn[:, None] * sbn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        if INTERPRET:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision="ieee")
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    c = tl.load(C + rm[:, None] * scm + rn[None, :], mask=mask, other=0.0)
    out = round_to(acc + c.to(tl.float32), OUT.dtype.element_ty, not INTERPRET)
    tl.store(OUT + rm[:, None] * som + rn[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _configs():
    # K is OutControl's selected channels (a few hundred): output-bound tiles, one or two K steps
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                                     (128, 128, 32, 4, 4))]


_mxfp8_addmm_autotuned = autotune(_configs(), key=["TUNE_M", "N", "K"])(_mxfp8_addmm_kernel)

#: tiles of a launch that is not autotuned (the interpreter, small products)
FIXED_TILES = {"BM": 64, "BN": 64, "BK": 32, "GROUP_M": 4}


def mxfp8_addmm_tensor(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c + a · bᵀ in c's dtype (a new tensor): a [M, K] and b [N, K] of one floating dtype (BF16 staged MXFP8 values
    on a GPU), c [M, N]; rows contiguous in their last dim."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or tuple(c.shape) != (m, n) or a.dtype != b.dtype:
        raise ValueError(f"mxfp8_addmm: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype} and c "
                         f"{tuple(c.shape)} do not fit (a [M, K], b [N, K] of one dtype, c [M, N])")
    a, b, c = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b, c))
    out = torch.empty_like(c, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    args = (a, b, c, out, m, n, k, a.stride(0), b.stride(0), c.stride(0), out.stride(0), tune_bucket(m))
    if a.is_cuda and m * n >= 2**22:
        grid = lambda meta: (cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]),)  # noqa: E731
        launch(_mxfp8_addmm_autotuned, grid, *args)
    else:
        launch(_mxfp8_addmm_kernel, (cdiv(m, FIXED_TILES["BM"]) * cdiv(n, FIXED_TILES["BN"]),), *args,
               INTERPRET=interpreting(), **FIXED_TILES)
    return out


__all__ = ["FIXED_TILES", "mxfp8_addmm_tensor"]
