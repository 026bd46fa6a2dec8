"""What the machine offers the kernels: Triton's CPU interpreter, a GPU's compute capability. A leaf module
(torch only), so that kernels, ops and modules alike ask it."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per device (every NVFP4 call resolves its backend). Under
    torch.compile the plain query: Dynamo folds it to a constant, and warns about tracing through lru_cache."""
    index = _index(device)
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(index)
    return _capability(index)


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (what Triton checks a launch against), asked once
    per device."""
    return _shared_memory(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    import triton  # here only: the module stays importable without Triton

    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
