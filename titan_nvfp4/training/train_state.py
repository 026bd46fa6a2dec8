"""The stochastic-rounding call counts in TorchTitan's checkpointed ``train_state``, and the restored
step handed to the converters' step counters (schedule.py).

Every NVFP4 layer draws its SR seeds from a device counter (base, backward calls so far). A resumed run
reproduces the uninterrupted one bit for bit only if those call counts come back with the checkpoint.
Keeping them in the model's state dict would change its keys, which would break loading BF16 and
Hugging Face checkpoints into an NVFP4 model. So they travel in TorchTitan's ``train_state`` (the
Trainer's own ``state_dict``, which TorchTitan saves and restores next to ``step``) as
``nvfp4_sr_calls``: {layer fqn: int64 [streams]}, one entry per NVFP4 layer of this rank's model parts.
Ranks that hold the same layer hold the same counts (every rank runs each of its layers equally
often), so DCP's deduplication keeps one copy; pipeline stages hold disjoint fqns. DCP loads what the
running job's train_state asks for, so an NVFP4 job resumes only from checkpoints that carry the counts
(those written with this in place); model-only loads (seed checkpoints, BF16 or HF weights) are not
affected. The activation amax windows of ``activation_amax_history`` (amax_history.py) travel the same
way as ``nvfp4_amax_history``: {layer fqn: fp32 [N, 2]}, identical on every rank. OsciReset's margins
(osci_reset.py, ``osci_reset_every``) as ``nvfp4_osci_margin``: {layer fqn: fp32 shaped like the weight, a DTensor
placed like it when it is one}, present whenever the knob is on, so that the job's train_state asks DCP for them
at every resume; the windows' W_prev is the restored weight itself. OutControl's channel selection
(outcontrol.py) rides in the model's state dict instead (persistent buffers); a load re-reads it here. Its window's
per-channel sums (the same on every rank) travel as ``nvfp4_outcontrol_norms``: {layer fqn: fp32 [in_features]},
present whenever the knob is on.

``install(trainer_cls)`` extends any class with TorchTitan's Trainer checkpoint interface (``state_dict``,
``load_state_dict``, ``model_parts``, ``step``): 0.2's Trainer (integration/train_state.py installs it on the
running one) and 0.3's NVFP4Trainer (integration_v03/trainer.py). Imports no TorchTitan.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..modules.amax_history import layers_with_history
from ..modules.osci_reset import margin_of, resume_windows
from ..modules.outcontrol import has_outcontrol, sync_outcontrol
from ..distributed.tensor_parallel import local
from ..modules.layer_state import NVFP4LayerState
from .schedule import GROUPED_STEPS, LINEAR_STEPS, step_counters

KEY = "nvfp4_sr_calls"
HISTORY_KEY = "nvfp4_amax_history"  # activation_amax_history windows, same reasoning
OSCI_KEY = "nvfp4_osci_margin"  # osci_reset_every margins (the live tensors: DCP loads into them in place)
OUTCONTROL_KEY = "nvfp4_outcontrol_norms"  # outcontrol_fraction: the window's sums so far
_WRAPPERS = ("._checkpoint_wrapped_module", "_checkpoint_wrapped_module.", "._orig_mod", "_orig_mod.")


def _fqn(name: str) -> str:
    """A layer's name without activation-checkpoint and compile wrappers (the same in every run)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def nvfp4_layers(model_parts: list[nn.Module]) -> dict[str, NVFP4LayerState]:
    return {_fqn(n): m for part in model_parts for n, m in part.named_modules() if isinstance(m, NVFP4LayerState)}


def sr_calls(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{fqn: int64 [streams]} backward-call counts of every NVFP4 layer (on the CPU: one sync, at save)."""
    return {fqn: local(m.sr_counter)[..., 1].reshape(-1).cpu().clone() for fqn, m in nvfp4_layers(model_parts).items()}


def load_sr_calls(model_parts: list[nn.Module], calls: dict[str, torch.Tensor]) -> None:
    """Put saved call counts back into the layers' counters (layers the checkpoint lacks keep theirs)."""
    layers = nvfp4_layers(model_parts)
    with torch.no_grad():
        for fqn, count in calls.items():
            if fqn in layers:
                c = local(layers[fqn].sr_counter)
                c[..., 1].copy_(count.reshape(c[..., 1].shape))


def amax_histories(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{fqn: fp32 [N, 2]} activation amax windows (amax_history.py; the same on every rank) of the layers
    that keep one."""
    return {fqn: local(m.x_amax_history).cpu().clone() for fqn, m in nvfp4_layers(model_parts).items()
            if m._buffers.get("x_amax_history") is not None}


def load_amax_histories(model_parts: list[nn.Module], histories: dict[str, torch.Tensor]) -> None:
    """Put saved windows back (a window of another length is refused by name)."""
    layers = nvfp4_layers(model_parts)
    with torch.no_grad():
        for fqn, h in histories.items():
            if fqn in layers and layers[fqn]._buffers.get("x_amax_history") is not None:
                mine = local(layers[fqn].x_amax_history)
                if mine.shape != h.shape:
                    raise ValueError(f"checkpoint's {HISTORY_KEY}[{fqn!r}] has {h.shape[0]} steps, this run's "
                                     f"activation_amax_history = {mine.shape[0]}")
                mine.copy_(h)


def empty_amax_histories(model_parts: list[nn.Module]) -> None:
    """Windows a checkpoint did not carry start empty, as at step 0 (the next step uses X's own amax)."""
    with torch.no_grad():
        for m in layers_with_history(model_parts):
            local(m.x_amax_history).zero_()
            m.amax_history.ready = False


def osci_layers(model_parts: list[nn.Module]) -> dict[str, NVFP4LayerState]:
    """{fqn: layer} of the layers with OsciReset on."""
    return {fqn: m for fqn, m in nvfp4_layers(model_parts).items() if m.osci_reset is not None}


def osci_margins(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{fqn: the layer's OsciReset margin} (created as zeros where a layer has none yet; on meta, none)."""
    return {fqn: margin_of(m) for fqn, m in osci_layers(model_parts).items() if not m.weight.is_meta}


def load_osci_margins(model_parts: list[nn.Module], margins: dict[str, torch.Tensor], step: int) -> None:
    """Put saved margins back and reopen the windows open after ``step``; a window whose margin the state lacks
    restarts from here (logged)."""
    lost = resume_windows(osci_layers(model_parts), margins, step)
    if lost:
        logging.getLogger("titan_nvfp4").warning(
            f"NVFP4: the checkpoint of step {step} has no OsciReset margin for {len(lost)} layers (e.g. {lost[0]!r}) "
            "inside an open window: their windows restart, summing the steps from here on (osci_reset_every)")


def outcontrol_layers(model_parts: list[nn.Module]) -> dict[str, NVFP4LayerState]:
    """{fqn: layer} of the materialized layers with OutControl on."""
    return {fqn: m for fqn, m in nvfp4_layers(model_parts).items()
            if has_outcontrol(m) and not m.outcontrol_done.is_meta}


def outcontrol_norms(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{fqn: fp32 [in_features]} the OutControl window's per-channel sums so far (alike on every rank)."""
    return {fqn: local(m.outcontrol_norms).cpu().clone() for fqn, m in outcontrol_layers(model_parts).items()}


def load_outcontrol_norms(model_parts: list[nn.Module], norms: dict[str, torch.Tensor], step: int) -> None:
    """Put saved window sums back; a run resumed inside the window from a state without them restarts its sums from
    here (logged)."""
    layers = outcontrol_layers(model_parts)
    with torch.no_grad():
        for fqn, m in layers.items():
            local(m.outcontrol_step).zero_()
            if fqn in norms:
                mine = local(m.outcontrol_norms)
                if mine.shape != norms[fqn].shape:
                    raise ValueError(f"checkpoint's {OUTCONTROL_KEY}[{fqn!r}] has {norms[fqn].numel()} channels, the "
                                     f"layer {mine.numel()}")
                mine.copy_(norms[fqn])
    lost = [fqn for fqn, m in layers.items() if fqn not in norms and not m._outcontrol_on
            and (w := getattr(m, "outcontrol", None)) is not None and w.start < step < w.end]
    if lost:
        logging.getLogger("titan_nvfp4").warning(
            f"NVFP4: the checkpoint of step {step} has no OutControl sums for {len(lost)} layers (e.g. {lost[0]!r}) "
            "inside their window: the sums restart, and the selection sums the window's remaining steps only "
            "(outcontrol_fraction)")


def sync_step_counters(model_parts: list[nn.Module], step: int) -> None:
    """Set the converters' step counters (schedule.py) and amax histories to the restored optimizer step."""
    for name in (LINEAR_STEPS, GROUPED_STEPS):
        for _, counter in step_counters(model_parts, name):
            counter.sync(step)
    for part in model_parts:
        for m in part.modules():
            if getattr(m, "amax_history", None) is not None:
                m.amax_history.at_step(step)
            if getattr(m, "outcontrol", None) is not None:
                m.outcontrol.at_step(step)


def state_of_layers(model_parts: list[nn.Module]) -> dict:
    """What a checkpoint must carry for the NVFP4 layers beside the model's state dict: the SR call counts (KEY)
    and, for layers that keep one, the amax windows (HISTORY_KEY), OsciReset margins (OSCI_KEY) and OutControl
    window sums (OUTCONTROL_KEY); {} for a model without NVFP4 layers."""
    out = {}
    calls = sr_calls(model_parts)
    if calls:
        out[KEY] = calls
    histories = amax_histories(model_parts)
    if histories:
        out[HISTORY_KEY] = histories
    margins = osci_margins(model_parts)
    if margins:
        out[OSCI_KEY] = margins
    norms = outcontrol_norms(model_parts)
    if norms:
        out[OUTCONTROL_KEY] = norms
    return out


def load_state_of_layers(model_parts: list[nn.Module], state: dict, step: int) -> None:
    """Restore ``state`` (state_of_layers' dict, entries optional) and set the step counters and amax histories to
    the restored optimizer ``step``; windows the state does not carry start empty, as at step 0; OsciReset windows
    open after ``step`` reopen (osci_reset.py resume_windows)."""
    calls, histories = state.get(KEY), state.get(HISTORY_KEY)
    if calls:
        load_sr_calls(model_parts, calls)
    if histories:
        load_amax_histories(model_parts, histories)
    sync_step_counters(model_parts, step)
    if not histories:  # a checkpoint without windows (integration/checkpoint.py)
        empty_amax_histories(model_parts)
    load_osci_margins(model_parts, state.get(OSCI_KEY) or {}, step)
    sync_outcontrol(model_parts)  # a DCP load put the selection into the buffers in place
    load_outcontrol_norms(model_parts, state.get(OUTCONTROL_KEY) or {}, step)


def install(trainer_cls) -> None:
    """Extend ``trainer_cls.state_dict`` / ``load_state_dict`` (TorchTitan's Trainer) with KEY, HISTORY_KEY, OSCI_KEY
    and OUTCONTROL_KEY (idempotent)."""
    if getattr(trainer_cls, "_nvfp4_train_state", False):
        return
    original_state_dict, original_load = trainer_cls.state_dict, trainer_cls.load_state_dict

    def state_dict(self):
        out = original_state_dict(self)
        out.update(state_of_layers(getattr(self, "model_parts", [])))
        return out

    def load_state_dict(self, state_dict):
        rest = {k: v for k, v in state_dict.items() if k not in (KEY, HISTORY_KEY, OSCI_KEY, OUTCONTROL_KEY)}
        original_load(self, rest)
        load_state_of_layers(getattr(self, "model_parts", []), state_dict, int(getattr(self, "step", 0)))

    trainer_cls.state_dict, trainer_cls.load_state_dict = state_dict, load_state_dict
    trainer_cls._nvfp4_train_state = True


__all__ = ["HISTORY_KEY", "KEY", "OSCI_KEY", "OUTCONTROL_KEY", "amax_histories", "empty_amax_histories", "install",
           "load_amax_histories", "load_osci_margins", "load_outcontrol_norms", "load_sr_calls", "load_state_of_layers",
           "nvfp4_layers", "osci_layers", "osci_margins", "outcontrol_layers", "outcontrol_norms", "sr_calls",
           "state_of_layers", "sync_step_counters"]
