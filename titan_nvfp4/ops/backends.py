"""Which implementation runs the NVFP4 quantization and GEMMs on a device (the `gemm_backend` knob).

  reference  pure PyTorch (titan_nvfp4/numerics); any device; the twin every kernel is tested against
  emulated   Triton kernels: quantization plus a 16-bit tensor-core GEMM on exactly dequantized codes;
             CUDA sm_80+ and ROCm (and the CPU under TRITON_INTERPRET=1, for tests)
  native     Triton quantization plus PyTorch's FP4 scaled matmul on Blackwell (sm_100+) tensor cores
  auto       native on sm_100+, emulated on other GPUs, reference on the CPU
"""

from __future__ import annotations

import importlib.util

import torch

from ..kernels.platform import capability, interpreting
from ..recipe.nvfp4_recipe import BACKEND_NAMES


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # a constant, so torch.compile traces no import


def triton_available() -> bool:
    return _HAS_TRITON


def _is_blackwell(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None and capability(device)[0] >= 10


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend that runs for knob value ``name`` on ``device``; a clear error where it cannot."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown NVFP4 gemm_backend {name!r}; expected one of {BACKEND_NAMES}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "is a CPU-only build" if torch.version.cuda is None and torch.version.hip is None else "finds no GPU"
        raise RuntimeError(f"NVFP4 gemm_backend {name!r} on device {device}: torch {torch.__version__} {why}")
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return "native" if _is_blackwell(device) else "emulated"
        return "reference"
    if name == "emulated":
        if not triton_available():
            raise RuntimeError("NVFP4 gemm_backend 'emulated' needs Triton, which is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"NVFP4 gemm_backend 'emulated' runs on CUDA/ROCm GPUs, not on {device} "
                               "(set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)")
    if name == "native" and not _is_blackwell(device):
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        raise RuntimeError(f"NVFP4 gemm_backend 'native' needs FP4 tensor cores (NVIDIA sm_100+), not {what}; "
                           "use 'emulated' or 'auto'")
    return name
