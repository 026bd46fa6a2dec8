"""Eager sibling Linears (wq, wk, wv; w1, w3) share one quantization of the X they all read.

Under torch.compile the siblings' X quantizations are identical custom-op calls, and AOTAutograd's CSE keeps
one of them (layer_state._share_signs gives every layer the same RHT sign tensor). An eager step runs each
Linear alone, so the last X quantized is remembered here and reused by the next sibling, with the same signs
tensor and settings. X is rounded to nearest, with no random draws, so the reused operands are the ones a
fresh quantization would give, bit for bit: one amax pass, one quantization and one saved copy of the Xᵀ
codes instead of one per sibling. In the backward the siblings' wgrads stage those saved Xᵀ codes once the
same way (shared_staging). TITAN_NVFP4_SHARE_X=0 turns both off (an A/B switch for benchmarks).

When X is reused (shared_x_operands): only where it is provably the tensor the first sibling read, within one
forward. A version counter sees in-place ops but not writes that bypass autograd (numpy on a from_numpy
tensor, ``.data``, DLPack, a reused input buffer refilled by a loader), so the object and its version are not
enough. Reused is an X that

  * autograd made in the forward now running: it, or the tensor it views, has a grad_fn. Such an activation is
    a new tensor every forward, so a remembered one never comes back in the next step; a leaf (an input batch,
    a buffer, a numpy array, anything a loop refills) is quantized afresh by every layer, and so is any X under
    no_grad (evaluation: no autograd provenance to prove it; compiled code shares by CSE there);
  * is the same object at the same version, with the same signs tensor and settings;
  * has not been read by the same layer before: a layer reading one X again is a new step or a repeat, and
    quantizes afresh.

What remains unseen is a write bypassing autograd into an activation between two sibling calls of one forward,
which autograd's own saved-tensor checks do not see either. The entry holds X weakly and is dropped when X is
freed, so it keeps no activation alive.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

#: whether eager siblings share (read at import)
ENABLED = os.environ.get("TITAN_NVFP4_SHARE_X", "1") != "0"
#: the last entry per purpose: "x" (X's forward operands), "stage" (the staged Xᵀ of wgrad)
_last: "dict[str, _Entry]" = {}


class _Entry:
    __slots__ = ("x_ref", "version", "signs", "key", "operands", "readers", "__weakref__")

    def __init__(self, slot: str, x: torch.Tensor, signs: torch.Tensor | None, key: tuple, operands,
                 reader: object) -> None:
        self.x_ref = weakref.ref(x, _forget(slot, weakref.ref(self)))
        self.version, self.signs, self.key, self.operands = x._version, signs, key, operands
        self.readers = {reader}


def _forget(slot: str, entry_ref: weakref.ref) -> Callable:
    def callback(_, last: dict = _last) -> None:  # bound now: at interpreter exit the module's globals are None
        if last.get(slot) is not None and last.get(slot) is entry_ref():
            del last[slot]
    return callback


def _shared(slot: str, x: torch.Tensor, signs: torch.Tensor | None, key: tuple, make: Callable[[], object],
            reader: object = None):
    """``make()``'s result, or the one it gave for the same ``x`` (object and version), ``signs`` and ``key`` to
    another ``reader`` (None: any caller may reuse it, as often as it likes)."""
    if not ENABLED:
        return make()
    e = _last.get(slot)
    if (e is not None and e.x_ref() is x and e.version == x._version and e.signs is signs and e.key == key
            and (reader is None or reader not in e.readers)):
        if reader is not None:
            e.readers.add(reader)
        return e.operands
    operands = make()
    _last[slot] = _Entry(slot, x, signs, key, operands, reader)
    return operands


def made_this_forward(x: torch.Tensor) -> bool:
    """Whether ``x`` is an activation autograd made in the forward now running: it, or the tensor it views, has a
    grad_fn (module docstring). A leaf, or any tensor under no_grad, is not."""
    base = x._base if x._base is not None else x
    return base.grad_fn is not None


def plain_eager() -> bool:
    """Whether this call runs plain eager, where sharing is safe: not traced by torch.compile (whose CSE shares
    in the graph) and under no dispatch mode (SAC, FlopCounter: a mode sees every call)."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def shared_x_operands(x: torch.Tensor, signs: torch.Tensor | None, key: tuple, quantize: Callable[[], tuple],
                      layer: object) -> tuple:
    """``quantize()``'s X operands, or those it gave another ``layer`` (a hashable id of the calling layer) for
    the same ``x`` (same object and version, made this forward: made_this_forward), the same ``signs`` tensor and
    an equal ``key`` (plain values: everything else the quantization reads)."""
    if not made_this_forward(x):
        return quantize()
    return _shared("x", x, signs, key, quantize, layer)


def shared_staging(codes: torch.Tensor, scales: torch.Tensor, key: tuple, stage: Callable[[], object]):
    """``stage()``'s staged operand, or the one it gave for the same saved ``codes`` tensor (object and version),
    ``scales`` tensor and ``key``: the wgrads of eager siblings, which saved one Xᵀ, stage it once. Held until
    another operand is staged or the codes are freed (the last sibling's backward done)."""
    return _shared("stage", codes, scales, key, stage)


def forget_shared_x() -> None:
    """Drop the remembered operands (tests; a caller that writes into an activation between sibling calls in
    ways its version does not record)."""
    _last.clear()


__all__ = ["forget_shared_x", "made_this_forward", "plain_eager", "shared_staging", "shared_x_operands"]
