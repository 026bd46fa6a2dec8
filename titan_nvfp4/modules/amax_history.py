"""Activation tensor scales from an amax history (``activation_amax_history = N``), the delayed scaling
of FP8 training recipes applied to X's NVFP4 tensor scale.

By default X is quantized with its own amax. With a history, a converted Linear quantizes X with the
largest amax of the last N optimizer steps, and the current amax only goes into the record:

* within one optimizer step every forward of a layer (microbatches, the activation-checkpoint
  recompute) uses the same scale and max-reduces its amax into a pending slot;
* the converter's post-optimizer hook all-reduces (max) the pending slots of every layer over all ranks
  in one collective, pushes them into each layer's window and clears them, so every rank (data and
  tensor parallel alike) holds the same history and quantizes with the same scale;
* the first step (empty history) uses the current amax, as without a history.

An element above the history's amax saturates: its block scale clips to 448 and its code to ±6
(numerics/nvfp4.py). Forwards without grad (evaluation) use the history and record nothing. A
non-finite X still poisons its output (its block scale is NaN) but never enters the history.
The windows ride in TorchTitan's train_state (integration/train_state.py), so a resumed run uses the
scales of the uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.tensor_parallel import local


class AmaxHistory:
    """The window length N shared by a converter's layers, and whether a step has been recorded (a
    plain bool that flips once: a compiled block recompiles once, never per step)."""

    def __init__(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"amax history length must be a positive integer, got {length!r}")
        self.length = length
        self.ready = False

    def at_step(self, steps: int) -> None:
        """The state after ``steps`` optimizer steps (a resumed run: the checkpoint's step)."""
        self.ready = steps > 0


def register_buffers(module: torch.nn.Module, history: AmaxHistory) -> None:
    """Give ``module`` its window ``x_amax_history`` fp32 [N, 2] (row amax, column amax of RHT(X)ᵀ; newest
    first) and the step's ``x_amax_pending`` [2], non-persistent (the model's state-dict keys stay
    TorchTitan's); zero-filled by NVFP4LayerState when materialized."""
    device = module.weight.device
    module.amax_history = history
    module.register_buffer("x_amax_history", torch.zeros(history.length, 2, device=device), persistent=False)
    module.register_buffer("x_amax_pending", torch.zeros(2, device=device), persistent=False)


def activation_amax(module: torch.nn.Module, current: torch.Tensor) -> torch.Tensor | None:
    """Record ``current`` (operand_amax's fp32 [row, column]) into the pending slot when grad is enabled
    (training), and return the amaxes to quantize X with: the window's max, or None while it is empty
    (the caller then takes X's own amax)."""
    pending = local(module.x_amax_pending)
    if torch.is_grad_enabled():
        finite = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
        torch.maximum(pending, finite, out=pending)
    if not module.amax_history.ready:
        return None
    return local(module.x_amax_history).amax(dim=0)


def roll(layers: list[torch.nn.Module]) -> None:
    """After an optimizer step: max-reduce every layer's pending amaxes over all ranks (one collective),
    push them into the windows (oldest row dropped) and clear them."""
    if not layers:
        return
    pending = torch.stack([local(m.x_amax_pending) for m in layers])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for m, p in zip(layers, pending):
            h = local(m.x_amax_history)
            h.copy_(torch.cat([p[None], h[:-1]]))
            local(m.x_amax_pending).zero_()
    for m in layers:
        m.amax_history.ready = True


def layers_with_history(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    parts = model if isinstance(model, list) else [model]
    return [m for part in parts for m in part.modules() if "x_amax_history" in m._buffers]


__all__ = ["AmaxHistory", "activation_amax", "layers_with_history", "register_buffers", "roll"]
