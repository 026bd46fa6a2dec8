"""Dispatch from the autograd functions to an implementation (reference today, kernels later)."""

from .gemm import BACKEND_NAMES, nvfp4_gemm, register_backend, resolve_backend
from .quantize import quantize_rowwise, quantize_wgrad_operand

__all__ = [
    "BACKEND_NAMES",
    "nvfp4_gemm",
    "quantize_rowwise",
    "quantize_wgrad_operand",
    "register_backend",
    "resolve_backend",
]
