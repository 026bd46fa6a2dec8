"""Dispatch from the autograd functions to an implementation: reference, emulated or native."""

from .backends import BACKEND_NAMES, resolve_backend
from .gemm import mxfp8_gemm, nvfp4_gemm, register_backend, staged_for_gemms
from .quantize import (
    ms_eden_operand_amax,
    mxfp8_operands,
    operand_amax,
    quantize_activation,
    quantize_gradient,
    quantize_ms_eden_operand,
    quantize_rowwise,
    quantize_weight,
    quantize_wgrad_operand,
)

__all__ = [
    "BACKEND_NAMES",
    "ms_eden_operand_amax",
    "mxfp8_gemm",
    "mxfp8_operands",
    "nvfp4_gemm",
    "operand_amax",
    "quantize_activation",
    "quantize_gradient",
    "quantize_ms_eden_operand",
    "quantize_rowwise",
    "quantize_weight",
    "quantize_wgrad_operand",
    "register_backend",
    "resolve_backend",
    "staged_for_gemms",
]
