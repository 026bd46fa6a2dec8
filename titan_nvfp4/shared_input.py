"""Sibling NVFP4 Linears that read the same X (attention's wq, wk, wv; a SwiGLU FFN's w1, w3) quantize it once.

X's forward quantization (tensor amax, 1×16 rows for the forward GEMM, the RHT'd Xᵀ that wgrad reads) depends
only on X, the RHT signs (one tensor shared by all layers: numerics/rht.py) and the recipe, so a sibling can
reuse the last layer's result bit for bit, and its backward then reads the same saved Xᵀ (saved once, not
per layer). In eager mode this module keeps that last result in one slot, keyed on the tensor X itself (a
weak reference, so a new tensor at a freed address never matches) and its version counter (an in-place
change invalidates it). Compiled graphs get the same from AOTAutograd's common-subexpression elimination,
so the slot stays out of them. The slot holds the staged X until the next layer with another input, the
next backward, or ``clear``. ``TITAN_NVFP4_SHARE_INPUT=0`` turns it off.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .ops.library import runs_directly

#: whether eager sibling layers share X's quantization (read at import; tests flip it)
enabled = os.environ.get("TITAN_NVFP4_SHARE_INPUT", "1") != "0"


@dataclass
class _Slot:
    x: weakref.ref
    version: int
    key: tuple
    signs: torch.Tensor | None  # held so that the id in ``key`` stays this tensor's
    value: Any


_slot: _Slot | None = None
#: [hits, stores] since import: what the tests and benchmarks read
counts = [0, 0]


def applies(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may use the slot: enabled, eager, no dispatch or function mode, a plain tensor
    with a version counter (not an inference-mode one)."""
    if not enabled or torch.compiler.is_compiling():  # first: dynamo need not trace what follows
        return False
    return type(x) is torch.Tensor and not x.is_inference() and runs_directly((x,))


def key(x2d: torch.Tensor, signs: torch.Tensor | None, *fields) -> tuple:
    """What besides X's identity decides its quantization: the 2D view's layout, the signs tensor, and the
    caller's recipe ``fields`` (need_col, backend, Four Over Six, ...)."""
    return (tuple(x2d.shape), x2d.stride(), x2d.storage_offset(), x2d.dtype, id(signs), *fields)


def lookup(x: torch.Tensor, k: tuple) -> Any:
    """The value stored for this very tensor ``x`` at its current version under key ``k``, else None."""
    s = _slot
    if s is None or s.x() is not x or s.version != x._version or s.key != k:
        return None
    counts[0] += 1
    return s.value


def store(x: torch.Tensor, k: tuple, signs: torch.Tensor | None, value: Any) -> None:
    """Keep ``value`` as the quantization of ``x`` (replacing the slot's previous one)."""
    global _slot
    _slot = _Slot(weakref.ref(x), x._version, k, signs, value)
    counts[1] += 1


def clear() -> None:
    """Drop the slot (its staged X): at each backward, and for callers that end a forward."""
    global _slot
    _slot = None
