"""The per-step core shared by every trainer: what converted NVFP4 modules need between optimizer steps.

One ``SectionSteps`` serves one converted section (the dense Linears, or the routed experts) of a model's parts:
``attach`` gives the modules their step counter and late high-precision switch (bf16_after_fraction), their amax
windows (activation_amax_history) and telemetry (telemetry_every); ``after_optimizer_step`` rolls the windows,
counts the step, switches, re-decomposes the low-rank modules (lora_refresh_steps) and pre-reduces the NVFP4
all-gather's scales. TorchTitan 0.2's converters, 0.3's trainer and ``titan_nvfp4.convert`` call the same code, so a
knob with a schedule is wired here once. Imports no TorchTitan: callers hand in their module lists and a logger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from ..distributed.fsdp_all_gather import TRAFFIC, precompute_scales
from ..modules.amax_history import AmaxHistory, layers_with_history, register_buffers, roll
from ..modules.decomposed_linear import log_lora_dtype, log_refresh, redecompose, set_lora_dtype
from ..modules.osci_reset import OsciReset, check_supported, layers_with_osci_reset, osci_reset_step
from ..modules import outcontrol as oc
from ..modules.telemetry import Telemetry, drain_all
from ..recipe.knobs import SWITCH_FORWARD, LinearKnobs, RecipeKnobs
from .optimizer_states import shared_optimizer_states
from .schedule import (GROUPED_STEPS, LINEAR_STEPS, PrecisionSchedule, StepCounter, attach_step_counter,
                       step_counters, switch_step)
from .train_state import load_state_of_layers, state_of_layers

Parts = nn.Module | list[nn.Module]


def as_parts(model: Parts) -> list[nn.Module]:
    """A model or a list of model parts (pipeline stages) as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


class SectionSteps:
    """The per-step state of one converted section, read from its knobs (LinearKnobs: the dense Linears, else the
    routed experts); ``total_steps`` sizes bf16_after_fraction; ``nvfp4_all_gather``: the FSDP2 NVFP4 all-gather
    is on (the caller decides whether it applies)."""

    def __init__(self, knobs: RecipeKnobs, total_steps: int, log: logging.Logger | logging.LoggerAdapter, *,
                 nvfp4_all_gather: bool = False) -> None:
        self.dense = isinstance(knobs, LinearKnobs)
        self.counter_name = LINEAR_STEPS if self.dense else GROUPED_STEPS
        self.what = "Linear layers" if self.dense else "expert modules"
        self.log = log
        self.total_steps = total_steps
        self.fraction, self.scope = knobs.switch()
        self.telemetry_every = knobs.telemetry_every
        self.amax_history = knobs.activation_amax_history if self.dense else 0
        self.refresh_steps = knobs.lora_refresh_steps if self.dense else 0
        projecting = self.refresh_steps and knobs.lora_refresh_moments == "project"
        # registered now, before the first optimizer step, so the refresh finds the factors' moments
        self.state_of = shared_optimizer_states().state_of if projecting else None
        self.nvfp4_all_gather = nvfp4_all_gather
        self._gather_logged = False
        self.counters: list[StepCounter] = []
        self.osci_reset = self._osci_reset(knobs, total_steps) if self.dense else None
        recipe = knobs.build_recipe()
        self.outcontrol = (oc.OutControlWindow(recipe.outcontrol_start, recipe.outcontrol_steps)
                           if self.dense and recipe.outcontrol_fraction else None)
        self.outcontrol_fraction = recipe.outcontrol_fraction
        self._outcontrol_checked = False
        if self.fraction and not total_steps:
            raise ValueError(f"[{knobs.SECTION}] bf16_after_fraction = {self.fraction} needs the run's total number of "
                             "optimizer steps (training.steps; total_steps for titan_nvfp4.convert)")

    @property
    def counted(self) -> bool:
        """Whether the section's modules need a step counter (a switch, telemetry or a refresh follows it)."""
        return bool(self.fraction or self.telemetry_every or self.refresh_steps or self.osci_reset or self.outcontrol)

    @property
    def per_step(self) -> bool:
        """Whether ``after_optimizer_step`` has anything to do."""
        return bool(self.counted or self.amax_history or self.nvfp4_all_gather)

    def attach(self, model: Parts, modules: list[list[nn.Module]],
               on_telemetry: Callable[[], None] | None = None) -> list[StepCounter]:
        """Give ``modules`` (the converted modules of each part of ``model``) their per-step state; returns the
        parts' step counters (none when nothing follows the count). ``on_telemetry``: called once when telemetry
        is on (an integration adds the measurements to its metrics there)."""
        parts = as_parts(model)
        if len(parts) != len(modules):
            raise ValueError(f"attach: {len(parts)} model parts but {len(modules)} module lists")
        n = sum(map(len, modules))
        if self.amax_history:
            history = AmaxHistory(self.amax_history)
            for m in (m for ms in modules for m in ms):
                register_buffers(m, history)
            self.log.info(f"NVFP4: X of {n} Linear layers quantized with the max amax of the last "
                          f"{self.amax_history} optimizer steps (activation_amax_history)")
        if not self.counted:
            return []
        schedule = PrecisionSchedule(switch_step(self.fraction, self.total_steps), self.scope)
        counters = [attach_step_counter(p, self.counter_name, ms, schedule) for p, ms in zip(parts, modules)]
        self.counters = counters
        if self.fraction:
            self.log.info(f"NVFP4: {self.what} switch {self._switched()} after optimizer step {schedule.switch_step} "
                          f"(bf16_after_fraction = {self.fraction} of {self.total_steps} steps, bf16_after_scope = "
                          f"{self.scope}{'; dgrad and wgrad stay NVFP4' if self.scope == SWITCH_FORWARD else ''})")
        if self.refresh_steps:
            self.log.info(f"NVFP4: low-rank modules re-decomposed every {self.refresh_steps} optimizer steps "
                          "(lora_refresh_steps; the experts' too)" + (", their factors' Adam moments projected onto "
                          "the new split" if self.state_of is not None else ""))
        if self.osci_reset is not None:
            self._attach_osci_reset(modules)
        if self.outcontrol is not None:
            self._attach_outcontrol(modules)
        if self.telemetry_every:
            for counter, ms in zip(counters, modules):
                telemetry = Telemetry(self.telemetry_every, counter)
                for m in ms:
                    m.telemetry = telemetry
            if on_telemetry is not None:
                on_telemetry()
            names = "nvfp4/<layer>/<operand>/<stat>" if self.dense else "nvfp4/<experts>/<weight>/<operand>/<stat>"
            self.log.info(f"NVFP4: telemetry of {n} {self.what} every {self.telemetry_every} steps ({names} in the "
                          "metrics)")
        return counters

    def _switched(self) -> str:
        """What the bf16_after_fraction switch moves, for its log lines (bf16_after_scope)."""
        if self.scope == SWITCH_FORWARD:
            return "the forward GEMMs to high precision"
        return "to high precision"

    def after_optimizer_step(self, model: Parts) -> None:
        """After each optimizer step: with the NVFP4 all-gather, log its first step's traffic and reduce the gathered
        weights' tile amaxes for their next all-gathers; push the step's activation amaxes into the windows; count
        the step (the switch follows); every lora_refresh_steps steps re-decompose the low-rank modules (Linears
        and experts) before the scales are next read."""
        parts = as_parts(model)
        if self.amax_history:
            roll(layers_with_history(parts))
        for i, (part, counter) in enumerate(step_counters(parts, self.counter_name)):
            if counter.step() and i == 0:
                self.log.info(f"NVFP4: {self.what} switched {self._switched()} after optimizer step {counter.count} "
                              f"(bf16_after_scope = {self.scope})")
            if self.refresh_steps and counter.count % self.refresh_steps == 0:
                done = redecompose(part, self.state_of)
                if i == 0:
                    log_refresh(self.log, done, counter.count, self.state_of is not None)
        if self.osci_reset is not None:
            self._osci_reset_step(parts)
        if self.outcontrol is not None:
            self._outcontrol_step(parts)
        if self.nvfp4_all_gather:
            first = not self._gather_logged
            if first:
                self._gather_logged = True
                self.log.info(f"NVFP4: FSDP2 all-gather, first step on this rank: {TRAFFIC.summary(TRAFFIC.peek())}")
            n = sum(precompute_scales(p) for p in parts)
            if first:
                self.log.info(f"NVFP4: after each optimizer step the tile amaxes of {n} NVFP4-gathered weights are "
                              "all-reduced at once (one all-reduce per FSDP group), ahead of their next all-gathers")

    # -- OsciReset (osci_reset_every; modules/osci_reset.py) -------------------------------------------------------

    @staticmethod
    def _osci_reset(knobs: LinearKnobs, total_steps: int) -> OsciReset | None:
        """The section's OsciReset schedule, None when off; a start fraction needs the run's length."""
        recipe = knobs.build_recipe()
        if not recipe.osci_reset_every:
            return None
        f = recipe.osci_reset_start_fraction
        if f and not total_steps:
            raise ValueError(f"[{knobs.SECTION}] osci_reset_start_fraction = {f} needs the run's total number of "
                             "optimizer steps (training.steps; total_steps for titan_nvfp4.convert)")
        return OsciReset(recipe.osci_reset_every, recipe.osci_reset_window, recipe.osci_reset_threshold,
                         round(f * total_steps))

    def _attach_osci_reset(self, modules: list[list[nn.Module]]) -> None:
        o = self.osci_reset
        for m in (m for ms in modules for m in ms):
            check_supported(m)  # a layer's local_tp is known here when the model was parallelized first (0.3)
            m.osci_reset = o
        first = max(o.every, -(-o.start_step // o.every) * o.every)
        self.log.info(f"NVFP4: OsciReset of {sum(map(len, modules))} Linear layers: a window opens every {o.every} "
                      f"optimizer steps from step {first}, sums {o.window} steps and resets the weight elements whose "
                      f"FP4 value moved more than {o.threshold:g}x as far as their master weight (osci_reset_every)")

    # -- OutControl (outcontrol_fraction; modules/outcontrol.py) ----------------------------------------------------

    def _attach_outcontrol(self, modules: list[list[nn.Module]]) -> None:
        w = self.outcontrol
        layers = [m for ms in modules for m in ms if oc.has_outcontrol(m)]
        for m in layers:
            oc.check_supported(m)  # a layer's local_tp is known here when the model was parallelized first (0.3)
            m.outcontrol = w
        k = sum(m.outcontrol_index.shape[0] for m in layers)
        total = sum(m.in_features for ms in modules for m in ms)
        self.log.info(f"NVFP4: OutControl of {len(layers)} Linear layers: the forwards of optimizer steps "
                      f"{w.start + 1} to {w.end} sum each input channel's L2 norm, then {k} of their {total} input "
                      f"channels (outcontrol_fraction = {self.outcontrol_fraction}, rounded up to 32 per layer) run "
                      "in MXFP8")

    def _outcontrol_step(self, parts: list[nn.Module]) -> None:
        """Open or close the window; after its last step select every layer's channels (one all_reduce of their sums
        over the ranks); a run resumed past the window from a checkpoint without a selection is logged once."""
        counters = step_counters(parts, self.counter_name)
        if not counters:
            return
        count, w = counters[0][1].count, self.outcontrol
        if w.recording:  # this step's forwards were summed
            oc.end_window_step(oc.layers_with_outcontrol(parts))
        w.at_step(count)
        if count == w.end:
            for name, k, n in oc.select_channels(oc.layers_with_outcontrol(parts)):
                self.log.info(f"NVFP4: OutControl of {name}: {k} of {n} input channels in MXFP8 from optimizer step "
                              f"{count + 1} on (the largest L2 norms over steps {w.start + 1} to {w.end})")
        elif count > w.end and not self._outcontrol_checked:
            late = [m for m in oc.layers_with_outcontrol(parts) if not m._outcontrol_on]
            if late:
                self.log.warning(f"NVFP4: OutControl: {len(late)} Linear layers (e.g. {oc.layer_label(late[0])!r}) "
                                 f"have no channel selection though the window ended after optimizer step {w.end} (a "
                                 "checkpoint without one): they stay NVFP4 (outcontrol_fraction)")
        self._outcontrol_checked = self._outcontrol_checked or count >= w.end

    def _osci_reset_step(self, parts: list[nn.Module]) -> None:
        """The windows after this optimizer step (after a low-rank refresh: an open window's W_prev is then the
        weight a checkpoint of this step holds); logs what a reset step did."""
        for i, (part, counter) in enumerate(step_counters(parts, self.counter_name)):
            done = osci_reset_step(layers_with_osci_reset(part), counter.count)
            if done is not None and i == 0:
                share = f" ({100 * done.elements / done.total:.3g}%)" if done.total else ""
                self.log.info(f"NVFP4: OsciReset after optimizer step {counter.count}: {done.elements} of {done.total} "
                              f"weight elements of {done.layers} Linear layers set to their FP4 value{share} (this "
                              "rank's shards)")


def apply_lora_dtype(model: Parts, lora_dtype: str, log, *, one_dtype: bool = False, scope: str = "") -> int:
    """Run the low-rank branches of ``model`` in ``lora_dtype`` ("input": nothing to do); returns how many modules it
    set. ``one_dtype``: FSDP2 will shard the model, which takes one parameter dtype per module."""
    if lora_dtype == "input":
        return 0
    n = set_lora_dtype(as_parts(model), lora_dtype, one_dtype=one_dtype)
    if n:
        log_lora_dtype(log, n, scope)
    return n


class TrainingSteps:
    """The per-step object a training loop drives (``titan_nvfp4.convert`` returns one): call ``step()`` after every
    ``optimizer.step()``. Its ``state_dict`` (torch.distributed.checkpoint's Stateful protocol) holds the optimizer
    steps taken, the layers' stochastic-rounding call counts, amax windows, OsciReset margins and OutControl sums,
    so a resumed run continues bit for bit; ``telemetry()`` returns what telemetry_every measured since the last
    call."""

    def __init__(self, model: Parts, sections: list[SectionSteps]) -> None:
        self.parts = as_parts(model)
        self.sections = sections
        self.steps = 0

    def step(self) -> None:
        """One optimizer step done."""
        self.steps += 1
        for s in self.sections:
            s.after_optimizer_step(self.parts)

    def state_dict(self) -> dict:
        return {"steps": self.steps, **state_of_layers(self.parts)}

    def load_state_dict(self, state: dict) -> None:
        if "steps" not in state:
            raise ValueError(f"TrainingSteps.load_state_dict: no 'steps' entry (got keys {sorted(state)}): not a "
                             "state_dict of titan_nvfp4's TrainingSteps")
        self.steps = int(state["steps"])
        load_state_of_layers(self.parts, state, self.steps)

    @staticmethod
    def telemetry() -> dict[str, float]:
        """The measurements of telemetry_every since the last call (emptied): {nvfp4/<layer>/<operand>/<stat>: v}."""
        return drain_all()


__all__ = ["SectionSteps", "TrainingSteps", "apply_lora_dtype", "as_parts"]
