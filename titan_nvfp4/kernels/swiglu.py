"""The SwiGLU between an MoE expert's W1/W3 and W2 GEMMs, fused with the per-expert amaxes of what it
produces, so the NVFP4 quantization of its outputs needs no amax pass of its own.

  forward   h = silu(h1) ⊙ h3, and the (row, RHT column) amaxes of h per expert    (W2's input)
  backward  dh1, dh3 from dh, h1, h3, and the (row, RHT column) amaxes of each   (W1's, W3's dY)

The amaxes are those ``quantize_grouped`` would reduce from the stored tensor (the same helper,
``reduce_amax16``, on the values as rounded to the output dtype). The elementwise math repeats eager
PyTorch's ``F.silu(h1) * h3`` and its autograd step by step, with the same roundings to the tensor
dtype: silu(h1) is rounded before the product, dh1 = round(round(dh·h3) · σ·(1 + h1·(1 − σ))),
dh3 = round(dh · round(silu(h1))), in fp32 with an IEEE exp and division, so on a GPU the result is
what the unfused ops compute (checked in tests/test_swiglu.py). Reference twin: ``swiglu_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .launch import autotune
from .nvfp4_jit import round_to
from .quantize import quantize_configs, launch_tuned, amax_slots, program_tile, reduce_amax16, signs_arg


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """exp(x) in fp32: libdevice's expf (what PyTorch's CUDA kernels call) on a GPU; tl.exp in the
    interpreter, which has no libdevice."""
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _tile(rows, rn, M, N, stride, WIDE: tl.constexpr):
    """(element offsets, mask) of rows × rn in an [M, N] tensor of row stride ``stride`` (int64 offsets if
    ``WIDE``)."""
    r = rows[:, None].to(tl.int64) if WIDE else rows[:, None]
    return r * stride + rn[None, :], (rows < M)[:, None] & (rn < N)[None, :]


@triton.jit
def _swiglu_fwd_kernel(H1, H3, OUT, M, N, SH, AMAX, SIGNS, BEXP, NSLOT, TUNE_M, COL: tl.constexpr,
                       RHT: tl.constexpr, PRECISE: tl.constexpr, WIDE: tl.constexpr, G: tl.constexpr,
                       BK: tl.constexpr, COLS_FIRST: tl.constexpr = False):
    """OUT = silu(H1) ⊙ H3 over 16·G rows and BK features (ordered by program_tile); its amaxes into
    AMAX (reduce_amax16).
    H1 and H3 have row stride SH (views of one GEMM's output), OUT is contiguous.
    ``PRECISE``: compiled (libdevice exp, hardware rounding), else the interpreter's twins."""
    pr, pc = program_tile(N, BK, COLS_FIRST)
    blk = pr * G + tl.arange(0, G)
    rn = pc * BK + tl.arange(0, BK)
    dt = OUT.dtype.element_ty
    hs = ()
    for i in tl.static_range(16):
        off, mask = _tile(blk * 16 + i, rn, M, N, N, WIDE)
        off_h, _ = _tile(blk * 16 + i, rn, M, N, SH, WIDE)
        a = tl.load(H1 + off_h, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(H3 + off_h, mask=mask, other=0.0).to(tl.float32)
        silu = round_to(tl.math.div_rn(a, 1.0 + _exp(-a, PRECISE)), dt, PRECISE)
        h = round_to(silu * b, dt, PRECISE)
        tl.store(OUT + off, h.to(dt), mask=mask)
        hs = hs + (h,)
    reduce_amax16(hs, blk, M, AMAX, SIGNS, BEXP, NSLOT, True, COL, RHT, True)


@triton.jit
def _swiglu_bwd_kernel(DH, H1, H3, D1, D3, M, N, SH, AMAX1, AMAX3, SIGNS, BEXP, NSLOT, TUNE_M, COL: tl.constexpr,
                       RHT: tl.constexpr, PRECISE: tl.constexpr, WIDE: tl.constexpr, G: tl.constexpr,
                       BK: tl.constexpr, COLS_FIRST: tl.constexpr = False):
    """D1, D3 = the gradients of H1, H3 of silu(H1) ⊙ H3 given DH; their amaxes into AMAX1, AMAX3.
    H1 and H3 have row stride SH; DH, D1 and D3 are contiguous. Programs as the forward's."""
    pr, pc = program_tile(N, BK, COLS_FIRST)
    blk = pr * G + tl.arange(0, G)
    rn = pc * BK + tl.arange(0, BK)
    dt = D1.dtype.element_ty
    g1 = ()
    g3 = ()
    for i in tl.static_range(16):
        off, mask = _tile(blk * 16 + i, rn, M, N, N, WIDE)
        off_h, _ = _tile(blk * 16 + i, rn, M, N, SH, WIDE)
        dh = tl.load(DH + off, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(H1 + off_h, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(H3 + off_h, mask=mask, other=0.0).to(tl.float32)
        e = 1.0 + _exp(-a, PRECISE)
        silu = round_to(tl.math.div_rn(a, e), dt, PRECISE)  # the forward's rounded silu(h1)
        sig = tl.math.div_rn(tl.full(e.shape, 1.0, tl.float32), e)
        d_silu = round_to(dh * b, dt, PRECISE)  # mul's gradient of silu(h1)
        d1 = round_to((d_silu * sig) * (1.0 + a * (1.0 - sig)), dt, PRECISE)  # silu_backward's formula
        d3 = round_to(dh * silu, dt, PRECISE)
        tl.store(D1 + off, d1.to(dt), mask=mask)
        tl.store(D3 + off, d3.to(dt), mask=mask)
        g1 = g1 + (d1,)
        g3 = g3 + (d3,)
    reduce_amax16(g1, blk, M, AMAX1, SIGNS, BEXP, NSLOT, True, COL, RHT, True)
    reduce_amax16(g3, blk, M, AMAX3, SIGNS, BEXP, NSLOT, True, COL, RHT, True)


def _fwd_configs():
    # 16 tiles [G, BK] are live at once: 1-4 elements per thread and tile keep them in registers; the
    # sweep of `bench_swiglu.py --sweep` (H100, 2026-11-26) found none faster than 2×128×2 warps
    return quantize_configs((g, bk, w, False) for g, bk, w in ((2, 64, 1), (2, 128, 2), (1, 128, 2), (2, 64, 4)))


def _bwd_configs():
    # 32 tiles are live (both gradients): at most 2 elements per thread and tile. Rows first in both
    # kernels: columns first measured 0.396 -> 0.450 ms forward at 2×128×2 and within 1% backward
    # (`benchmarks/bench_swiglu.py --sweep`, H100, 2026-11-26)
    return quantize_configs((g, bk, w, False) for g, bk, w in ((2, 64, 1), (2, 64, 2), (1, 128, 2), (2, 64, 4), (2, 128, 4)))


_fwd_autotuned = autotune(_fwd_configs(), key=["TUNE_M", "N", "COL", "RHT"], reset_to_zero=["AMAX"])(
    _swiglu_fwd_kernel)
_bwd_autotuned = autotune(_bwd_configs(), key=["TUNE_M", "N", "COL", "RHT"], reset_to_zero=["AMAX1", "AMAX3"])(
    _swiglu_bwd_kernel)


def _check(name: str, h1: torch.Tensor, h3: torch.Tensor, *ts: torch.Tensor) -> int:
    """The row stride of h1 and h3 (rows of one stride, elements contiguous: views of one GEMM output
    qualify); the other tensors must be contiguous."""
    shape, dtype, dev = h1.shape, h1.dtype, h1.device
    for t in (h1, h3, *ts):
        if t.dim() != 2 or t.shape != shape or t.dtype != dtype or t.device != dev or not t.is_floating_point():
            raise ValueError(f"{name}: expected 2D floating-point tensors of one shape, dtype and device, got "
                             f"{[(tuple(u.shape), u.dtype, u.device.type) for u in (h1, h3, *ts)]}")
    for t in ts:
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous dh, got strides {t.stride()}")
    if shape[0] > 1 and (h1.stride(1) != 1 or h3.stride(1) != 1 or h1.stride(0) != h3.stride(0)
                         or h1.stride(0) < shape[1]):
        raise ValueError(f"{name}: h1 and h3 need contiguous rows of one stride, got strides {h1.stride()} and "
                         f"{h3.stride()}")
    if shape[1] % 16:
        raise ValueError(f"{name}: the feature dim must be a multiple of 16, got {tuple(shape)}")
    return h1.stride(0) if shape[0] > 1 else shape[1]


def swiglu_amax_tensors(h1: torch.Tensor, h3: torch.Tensor, offsets: torch.Tensor, colwise: bool,
                        signs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = silu(h1) ⊙ h3 [T, N], fp32 [2, E + 1] per-expert (row, column) amaxes of h): the
    amaxes ``quantize_grouped(h, offsets, ...)`` would reduce; the column ones after the RHT with
    ``signs``, and 0 without ``colwise``. ``offsets``: cumulative token-group ends (multiples of 16)."""
    sh = _check("swiglu", h1, h3)
    M, N = h1.shape
    bexp, ns = amax_slots(h1, offsets)
    buf = torch.zeros(2 * ns, dtype=torch.int32, device=h1.device)
    out = torch.empty((M, N), dtype=h1.dtype, device=h1.device)
    if M > 0:
        launch_tuned(_swiglu_fwd_kernel, _fwd_autotuned, h1, M, N, h1, h3, out, M, N, sh, buf, signs_arg(signs, buf), bexp,
                ns, COL=colwise, RHT=signs is not None, PRECISE=h1.is_cuda, WIDE=M * sh >= 2**31)
    if colwise and signs is None:
        buf[ns:] = buf[:ns]
    return out, buf.view(torch.float32).view(2, ns)


def swiglu_backward_amax_tensors(dh: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor, offsets: torch.Tensor,
                                 colwise: bool, signs: torch.Tensor | None):
    """(dh1, dh3, amaxes of dh1, amaxes of dh3): the gradients of silu(h1) ⊙ h3 given dh, each with
    its per-expert (row, column) amaxes as swiglu_amax_tensors gives them for h."""
    sh = _check("swiglu backward", h1, h3, dh)
    M, N = h1.shape
    bexp, ns = amax_slots(h1, offsets)
    a1, a3 = (torch.zeros(2 * ns, dtype=torch.int32, device=h1.device) for _ in range(2))  # no aliasing: custom op
    d1, d3 = (torch.empty((M, N), dtype=h1.dtype, device=h1.device) for _ in range(2))
    if M > 0:
        launch_tuned(_swiglu_bwd_kernel, _bwd_autotuned, h1, M, N, dh, h1, h3, d1, d3, M, N, sh, a1, a3,
                signs_arg(signs, a1), bexp, ns, COL=colwise, RHT=signs is not None, PRECISE=h1.is_cuda,
                WIDE=M * sh >= 2**31)
    if colwise and signs is None:
        a1[ns:] = a1[:ns]
        a3[ns:] = a3[:ns]
    return d1, d3, a1.view(torch.float32).view(2, ns), a3.view(torch.float32).view(2, ns)


def swiglu_reference(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    """The eager ops the kernels fuse (their twin in tests): silu rounded to the dtype, then the product."""
    return torch.nn.functional.silu(h1) * h3


__all__ = ["swiglu_amax_tensors", "swiglu_backward_amax_tensors", "swiglu_reference"]
