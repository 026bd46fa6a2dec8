"""Optimizer-step schedules of the converters: the step count they keep, and the late switch of every
NVFP4 layer to high precision (``bf16_after_fraction``) that it drives.

TorchTitan calls a converter's post-optimizer hook with the model only. So the converter keeps its count on the
model as a plain attribute (``StepCounter``, not a submodule): the model's children and state-dict keys stay its
own, so an ``nn.Sequential`` still runs. On resume the count comes from TorchTitan's own checkpointed step
(integration/train_state.py sets it when the train_state loads), so the switch and the low-rank refresh happen at
the same optimizer steps in a resumed run as in an uninterrupted one. The NVFP4 modules read the switch from a
shared ``PrecisionSchedule``, plain bools that change once, so a compiled block recompiles once at the switch and
never guards on the step count. ``bf16_after_scope`` says which GEMMs switch: all three ("forward_backward"), or
the forward GEMM alone ("forward", NVIDIA arXiv 2509.25149), dgrad and wgrad staying NVFP4. The scope is the
running job's knob: a resumed run switches with its own scope.
"""

from __future__ import annotations

from torch import nn

from ..recipe.knobs import SWITCH_FORWARD_BACKWARD, SWITCH_SCOPES


#: the model attributes holding the NVFP4 Linears' and the experts' converters' StepCounters (no tensors, no modules)
LINEAR_STEPS, GROUPED_STEPS = "nvfp4_linear_steps", "nvfp4_grouped_steps"


class PrecisionSchedule:
    """Which GEMMs of the NVFP4 modules sharing it compute in high precision now: from optimizer step
    ``switch_step`` on (None: never), the forward GEMM, and the backward's too when ``scope`` is
    "forward_backward" (bf16_after_scope). ``high_precision``: every GEMM (the modules then run F.linear)."""

    def __init__(self, switch_step: int | None = None, scope: str = SWITCH_FORWARD_BACKWARD) -> None:
        if scope not in SWITCH_SCOPES:
            raise ValueError(f"PrecisionSchedule: scope must be one of {list(SWITCH_SCOPES)}, got {scope!r}")
        self.switch_step, self.scope = switch_step, scope
        self.high_precision_forward = self.high_precision_backward = self.high_precision = False
        self.at_step(0)

    def at_step(self, steps: int) -> bool:
        """Set the state after ``steps`` optimizer steps; True when this call switched it on."""
        before = self.high_precision_forward
        self.high_precision_forward = self.switch_step is not None and steps >= self.switch_step
        self.high_precision_backward = self.high_precision_forward and self.scope == SWITCH_FORWARD_BACKWARD
        self.high_precision = self.high_precision_backward  # the forward and the backward: every GEMM
        return self.high_precision_forward and not before


def switch_step(fraction: float, total_steps: int) -> int | None:
    """The optimizer step after which the last ``fraction`` of ``total_steps`` runs in high precision
    (0: never; 1: from the start)."""
    if not fraction:
        return None
    return total_steps - round(fraction * total_steps)


class StepCounter:
    """A converter's optimizer-step count; ``schedule`` follows it. No tensors (no state-dict entries):
    a resumed run gets its count through ``sync`` from TorchTitan's train_state step."""

    def __init__(self, schedule: PrecisionSchedule | None = None) -> None:
        self.schedule = schedule or PrecisionSchedule()
        self.count = 0

    def step(self) -> bool:
        """One more optimizer step; True when the schedule switched (its scope) to high precision with it."""
        self.count += 1
        return self.schedule.at_step(self.count)

    def sync(self, steps: int) -> None:
        """Set the count (a resumed run: the optimizer steps its checkpoint had taken)."""
        self.count = steps
        self.schedule.at_step(steps)

    def __repr__(self) -> str:
        return f"StepCounter(count={self.count}, switch_step={self.schedule.switch_step}, scope={self.schedule.scope})"


def attach_step_counter(part: nn.Module, name: str, modules: list[nn.Module], schedule: PrecisionSchedule) -> StepCounter:
    """Set a StepCounter following ``schedule`` as attribute ``name`` of ``part`` (a model, or a pipeline stage)
    and share the schedule with ``modules``. Set past ``nn.Module.__setattr__``: an attribute, never a child."""
    counter = StepCounter(schedule)
    object.__setattr__(part, name, counter)
    for m in modules:
        m.precision_schedule = schedule
    return counter


def step_counters(model: nn.Module | list[nn.Module], name: str) -> list[tuple[nn.Module, StepCounter]]:
    """(part, its StepCounter ``name``) for ``model`` or each model part holding one (pipeline stages
    hold a copy each)."""
    parts = model if isinstance(model, list) else [model]
    return [(p, c) for p in parts if isinstance(c := getattr(p, name, None), StepCounter)]


__all__ = ["GROUPED_STEPS", "LINEAR_STEPS", "PrecisionSchedule", "StepCounter", "attach_step_counter", "step_counters", "switch_step"]
