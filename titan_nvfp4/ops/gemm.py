"""NVFP4 GEMM dispatch: out = (A_q · B_qᵀ) · (gs_A · gs_B) [+ bias], both operands NVFP4Tensors
whose storage rows hold the contraction dim.

Backends (see backends.py): "reference" (plain PyTorch, any device), "emulated" (Triton, sm_80+ and
ROCm) and "native" (FP4 tensor cores, sm_100+); the kernels load only when their backend is used.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..numerics.formats import e8m0_to_float
from ..numerics.mxfp8 import MX_BLOCK, MXFP8Tensor
from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import check_bias
from . import library
from .backends import resolve_backend

GemmFn = Callable[[NVFP4Tensor, NVFP4Tensor, torch.dtype, "torch.Tensor | None"], torch.Tensor]

_BACKENDS: dict[str, GemmFn] = {}


def register_backend(name: str, fn: GemmFn) -> None:
    """Make a GEMM implementation selectable by name."""
    _BACKENDS[name] = fn


def _matmul_fp32_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ bᵀ with exactly-representable 16-bit operands and fp32 accumulation, fp32 out."""
    if a.is_cuda:
        try:  # bf16 tensor cores with an fp32 result: no rounding before the global scales
            return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round the operands
        try:
            return a.float() @ b.float().t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a.float() @ b.float().t()


def mxfp8_gemm(a: MXFP8Tensor | torch.Tensor, b: MXFP8Tensor | torch.Tensor, out_dtype: torch.dtype, *,
               addend: torch.Tensor | None = None, backend: str = "reference") -> torch.Tensor:
    """a [M, C] · b [N, C]ᵀ of two MXFP8 operands (1×32 blocks along C, ops.quantize.mxfp8_operands; or
    their staged values), as an MXFP8 tensor core computes it: exact products, fp32 sums, one rounding
    to out_dtype. On a GPU the operands are dequantized to BF16 (an E4M3 element times a power of two is
    exact in BF16 unless the block's amax is below 448·2⁻¹²⁷, where BF16 subnormals drop low bits) for a
    BF16 tensor-core GEMM with fp32 accumulation; elsewhere to fp32. ``addend`` [M, N]: added to the fp32
    sums before the one rounding, the result in its dtype (out_dtype unused); on a GPU with a kernel
    ``backend``, one Triton kernel (kernels/mxfp8_addmm.py)."""
    a, b = _mx_dequantize(a), _mx_dequantize(b)
    if addend is None:
        return _matmul_fp32_accumulate(a, b).to(out_dtype)
    if addend.is_cuda and backend in ("emulated", "native"):
        return library.mxfp8_addmm(a.to(torch.bfloat16), b.to(torch.bfloat16), addend)
    return (_matmul_fp32_accumulate(a, b) + addend.float()).to(addend.dtype)


def _mx_dequantize(t: MXFP8Tensor | torch.Tensor) -> torch.Tensor:
    if not isinstance(t, MXFP8Tensor):
        return t  # already staged
    dtype = torch.bfloat16 if t.data.is_cuda else torch.float32
    rows, cols = t.data.shape
    scale = e8m0_to_float(t.scale).to(dtype).unsqueeze(-1)
    return (t.data.view(rows, cols // MX_BLOCK, MX_BLOCK).to(dtype) * scale).view(rows, cols)


def gemm_reference(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What an FP4 tensor core computes: exact products of q·e_b, fp32 sums, global scales on the
    fp32 accumulator, then bias, then one rounding to out_dtype."""
    check_bias(bias, b.storage_shape[0], a.data.device)
    acc = _matmul_fp32_accumulate(a.scaled_codes(torch.float32), b.scaled_codes(torch.float32))
    out = acc * (a.global_scale.float() * b.global_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _library_gemm(backend: str) -> GemmFn:
    def run(a: NVFP4Tensor | library.StagedOperand, b: NVFP4Tensor | library.StagedOperand, out_dtype: torch.dtype,
            bias: torch.Tensor | None = None):
        return _gemm_op(a, b, out_dtype, bias, backend)
    return run


def _op_args(t: NVFP4Tensor | library.StagedOperand) -> tuple:
    """(data, scale, global scale, tiles) of an operand for the gemm op; a staged operand (emulated
    backend only) passes its fp16 values and empty scales (made from the global scale, not from the values:
    a graph that needs the placeholder before the values must not stage them for it)."""
    if isinstance(t, library.StagedOperand):
        return t.values, t.global_scale.new_empty((0,), dtype=torch.float8_e4m3fn), t.global_scale, False
    return t.data, t.scale, t.global_scale, _tiles(t)


def _gemm_op(a: NVFP4Tensor | library.StagedOperand, b: NVFP4Tensor | library.StagedOperand, out_dtype: torch.dtype,
             bias: torch.Tensor | None, backend: str, round_to: torch.dtype | None = None) -> torch.Tensor:
    """The gemm op on two operands: their tensors positionally, every option by name."""
    (a_data, a_scale, a_gs, a_tiles), (b_data, b_scale, b_gs, b_tiles) = _op_args(a), _op_args(b)
    return library.gemm(a_data, a_scale, a_gs, b_data, b_scale, b_gs, bias, a_tiles=a_tiles, b_tiles=b_tiles,
                        out_dtype=out_dtype, backend=backend, round_to=round_to)


def staged_for_gemms(t: NVFP4Tensor, backend: str) -> NVFP4Tensor | library.StagedOperand:
    """On the emulated backend, ``t``'s codes staged as the GEMM's fp16 values by one op call, for a saved
    operand that several GEMMs may read: sibling layers' wgrads on one X (wq, wk, wv) then stage its Xᵀ once
    under torch.compile (CSE), where each GEMM would stage it in chunks of its own. The bits are the same
    as a GEMM staging it (the staging is exact). Other backends read the codes as they are."""
    if backend != "emulated":
        return t
    return library.StagedOperand(library.stage(t.data, t.scale, tiles=_tiles(t)), t.global_scale)


def _tiles(t: NVFP4Tensor) -> bool:
    """16×16 scale blocks (one scale row per 16 storage rows) rather than one per storage row."""
    return tuple(t.block_shape) == (16, 16)


register_backend("reference", gemm_reference)
register_backend("emulated", _library_gemm("emulated"))
register_backend("native", _library_gemm("native"))


def nvfp4_gemm(
    a: NVFP4Tensor | library.StagedOperand,
    b: NVFP4Tensor | library.StagedOperand,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """out[m, n] = Σ_k A[m, k] B[n, k] over the NVFP4 storages of a and b (either may come staged,
    see library.StagedOperand, on the emulated backend). ``round_to``: a 16-bit dtype whose rounding the
    values of a wider ``out_dtype`` take first, as a 16-bit result widened (the emulated GEMM does it in its
    store; the other backends compute in ``round_to`` and widen)."""
    if a.storage_shape[1] != b.storage_shape[1]:
        raise ValueError(f"NVFP4 GEMM contraction mismatch: {a.storage_shape} vs {b.storage_shape}")
    check_bias(bias, b.storage_shape[0], (a.values if isinstance(a, library.StagedOperand) else a.data).device)
    if backend not in _BACKENDS:  # "auto": resolve here for direct callers
        backend = resolve_backend(backend, a.data.device)
    if round_to is None or round_to == out_dtype:
        return _BACKENDS[backend](a, b, out_dtype, bias)
    if backend == "emulated":
        return _gemm_op(a, b, out_dtype, bias, backend, round_to)
    return _BACKENDS[backend](a, b, round_to, bias).to(out_dtype)
