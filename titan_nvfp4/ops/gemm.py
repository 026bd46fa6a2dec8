"""NVFP4 GEMM dispatch: out = (A_q · B_qᵀ) · (gs_A · gs_B) [+ bias], both operands NVFP4Tensors
whose storage rows hold the contraction dim.

Backends: "reference" (plain PyTorch, any device) today; the Triton-emulated (sm_80–sm_90, ROCm)
and native (sm_100+) backends register here and are picked by :func:`resolve_backend`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..numerics.nvfp4 import NVFP4Tensor

GemmFn = Callable[[NVFP4Tensor, NVFP4Tensor, torch.dtype, "torch.Tensor | None"], torch.Tensor]

_BACKENDS: dict[str, GemmFn] = {}
#: Names accepted by the `gemm_backend` knob ("auto" picks per device).
BACKEND_NAMES = ("auto", "reference")


def register_backend(name: str, fn: GemmFn) -> None:
    """Make a GEMM implementation selectable by name."""
    _BACKENDS[name] = fn


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend that runs for knob value ``name`` on ``device``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown NVFP4 gemm_backend {name!r}; expected one of {BACKEND_NAMES}")
    if name == "auto":
        return "reference"
    return name


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


def gemm_reference(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What an FP4 tensor core computes: exact products of q·e_b, fp32 sums, global scales on the
    fp32 accumulator, then bias, then one rounding to out_dtype."""
    acc = _matmul_fp32_accumulate(a.scaled_codes(torch.float32), b.scaled_codes(torch.float32))
    out = acc * (a.global_scale.float() * b.global_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


register_backend("reference", gemm_reference)


def nvfp4_gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """out[m, n] = Σ_k A[m, k] B[n, k] over the NVFP4 storages of a and b."""
    if a.storage_shape[1] != b.storage_shape[1]:
        raise ValueError(f"NVFP4 GEMM contraction mismatch: {a.storage_shape} vs {b.storage_shape}")
    return _BACKENDS[resolve_backend(backend, a.data.device)](a, b, out_dtype, bias)
