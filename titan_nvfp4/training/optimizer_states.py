"""The optimizer state of a parameter, found from the model side: the low-rank refresh runs in a hook that
TorchTitan gives the model only, yet ``lora_refresh_moments = "project"`` rewrites the factors' Adam moments.
A global optimizer step hook (torch.optim's own API) notes every optimizer that steps; a parameter's state is
looked up in those."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class OptimizerStates:
    """Remembers the optimizers that have stepped (weakly) and finds a parameter's state among them."""

    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer, args, kwargs) -> None:
        self._optimizers.add(optimizer)

    def state_of(self, param: torch.Tensor) -> dict | None:
        """The state dict the optimizer that steps ``param`` keeps for it; None before its first step."""
        for opt in list(self._optimizers):
            state = opt.state.get(param)
            if state:
                return state
        return None


_shared: OptimizerStates | None = None


def shared_optimizer_states() -> OptimizerStates:
    """One process-wide OptimizerStates (its hook installed on first use)."""
    global _shared
    if _shared is None:
        _shared = OptimizerStates()
    return _shared


__all__ = ["OptimizerStates", "shared_optimizer_states"]
