"""Optimizer-step schedules of the converters: the step count they keep in the model's state dict, and
the late switch of every NVFP4 layer to high precision (``bf16_after_fraction``) that it drives.

TorchTitan calls a converter's post-optimizer hook with the model only, and restores its own step
counter from the checkpoint out of the converter's reach. So the converter keeps its count in a small
submodule of the model (``StepCounter``, a persistent buffer ``steps``): it is saved and resumed with
the model, and the switch and the low-rank refresh happen at the same optimizer steps in a resumed run
as in an uninterrupted one. The NVFP4 modules read the switch from a shared ``PrecisionSchedule``, a
plain bool that changes once, so a compiled block recompiles once at the switch and never guards on
the step count.
"""

from __future__ import annotations

import torch
from torch import nn


class PrecisionSchedule:
    """Whether the NVFP4 modules sharing it compute in high precision now: from optimizer step
    ``switch_step`` on (None: never)."""

    def __init__(self, switch_step: int | None = None) -> None:
        self.switch_step = switch_step
        self.high_precision = False
        self.at_step(0)

    def at_step(self, steps: int) -> bool:
        """Set the state after ``steps`` optimizer steps; True when this call switched it on."""
        before = self.high_precision
        self.high_precision = self.switch_step is not None and steps >= self.switch_step
        return self.high_precision and not before


def switch_step(fraction: float, total_steps: int) -> int | None:
    """The optimizer step after which the last ``fraction`` of ``total_steps`` runs in high precision
    (0: never; 1: from the start)."""
    if not fraction:
        return None
    return total_steps - round(fraction * total_steps)


class StepCounter(nn.Module):
    """A converter's optimizer-step count, saved with the model (``<name>.steps``); ``schedule``
    follows it. Materializing a meta model starts it at 0; loading a checkpoint sets it (one host read
    at load time, none per step)."""

    def __init__(self, schedule: PrecisionSchedule | None = None, device=None) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64, device=device))
        self.schedule = schedule or PrecisionSchedule()
        self.count = 0

    def step(self) -> bool:
        """One more optimizer step; True when the schedule switched to high precision with it."""
        self.count += 1
        self.steps.fill_(self.count)
        return self.schedule.at_step(self.count)

    def _sync(self, count: int) -> None:
        self.count = count
        self.schedule.at_step(count)

    def _apply(self, fn, recurse: bool = True):
        was_meta = self.steps.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.steps.is_meta:  # TorchTitan's to_empty: a fresh run starts at step 0
            self.steps.zero_()
            self._sync(0)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if not self.steps.is_meta:
            self._sync(int(self.steps))

    def extra_repr(self) -> str:
        return f"count={self.count}, switch_step={self.schedule.switch_step}"


__all__ = ["PrecisionSchedule", "StepCounter", "switch_step"]
