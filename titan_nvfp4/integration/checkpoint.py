"""TorchTitan's CheckpointManager with low-rank layers and the NVFP4 train_state (docs/checkpoints.md).

Two patches of torchtitan.components.checkpoint, applied by torchtitan_fixes.apply():

* ``ModelWrapper.state_dict`` re-reads the model's state dict when it holds low-rank layers. TorchTitan
  caches it once at start-up; a cached ``weight`` of a low-rank layer would be the W computed then (its
  state dict computes W = R + U·diag(σ)·V, decomposed_linear.py), not the trained one.
* ``CheckpointManager.dcp_load`` compares what the job asks for with the checkpoint's metadata before
  DCP loads, where DCP itself would stop at the first missing key or shape without saying why:

  - low-rank layers here, none in the checkpoint (a BF16 or lora_rank = 0 run): a model-only load
    (initial_load_path with initial_load_model_only, or a step-0 checkpoint) loads W and decomposes it;
    a full resume is refused by name (the factors have no optimizer state to resume);
  - low-rank layers in the checkpoint, plain NVFP4 layers here: a model-only load loads W; a full
    resume is refused by name (its SR counts are per GEMM of the low-rank layer);
  - a checkpoint without OutControl's channel selection (``<layer>.outcontrol_index`` / ``outcontrol_done``:
    a run without outcontrol_fraction, a BF16 run) loads without it: the layers stay unselected; so does a
    Hugging Face checkpoint;
  - a checkpoint of a run without NVFP4 layers (or without some of them) resumes with zero SR counts
    for the layers it lacks; one without activation amax windows resumes with empty windows; one without
    OsciReset margins (a run without osci_reset_every) resumes with none: a window open at its step restarts;
    so do OutControl's window sums (a run without outcontrol_fraction, or written before they were saved).
"""

from __future__ import annotations

import os

from torch import nn
from torchtitan.tools.logging import logger

from ..modules.decomposed_linear import RESIDUAL, LowRankState
from .train_state import HISTORY_KEY, KEY
from ..training.train_state import OSCI_KEY, OUTCONTROL_KEY

_TRAIN_STATE, _OPTIMIZER = "train_state", "optimizer"
#: the model state-dict entries of OutControl's selection (modules/outcontrol.py)
OUTCONTROL_KEYS = (".outcontrol_index", ".outcontrol_done")
_RES = "lora_" + RESIDUAL
_LINEAR = "[quantize.linear.nvfp4] lora_rank"


def has_lowrank(parts: list[nn.Module]) -> bool:
    """Whether any model part holds a decomposed module (DecomposedLinear, experts with a lora_rank)."""
    return any(isinstance(m, LowRankState) and "lora_decomposed" in m._buffers for p in parts for m in p.modules())


def saved_keys(checkpoint_id: str) -> dict[str, object] | None:
    """{flattened key: metadata} of a DCP checkpoint folder; None where it cannot be read here."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(checkpoint_id):
        return None
    try:
        return dict(FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    except Exception:  # not a DCP folder: DCP's own error follows
        return None


def _factor_keys(prefix: str) -> list[str]:
    """The entries a low-rank weight adds, from its factor prefix (``<linear>.`` or ``<experts>.w1_``)."""
    from ..tools.export_dense import weight_key_of  # here: imported at package import, `python -m` would warn

    module = weight_key_of(prefix).rpartition(".")[0]
    return [prefix + n for n in ("lora_u", "lora_sigma", "lora_v", _RES)] + [f"{module}.lora_decomposed"]


def _size(meta) -> tuple | None:
    size = getattr(meta, "size", None)
    return tuple(size) if size is not None else None


class _TrainStateRequest:
    """The job's train_state (a Stateful) asking DCP only for the NVFP4 entries the checkpoint holds."""

    def __init__(self, inner, drop: set[str]) -> None:
        self.inner, self.drop = inner, drop

    def state_dict(self):
        out = dict(self.inner.state_dict())
        for group in (KEY, HISTORY_KEY, OSCI_KEY, OUTCONTROL_KEY):
            if group in out:
                kept = {k: v for k, v in out[group].items() if f"{_TRAIN_STATE}.{group}.{k}" not in self.drop}
                if kept:
                    out[group] = kept
                else:
                    del out[group]
        return out

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


def adapt_request(state: dict, saved: dict[str, object], checkpoint_id: str) -> dict:
    """``state`` (what a TorchTitan job loads: model keys flat, then optimizer, train_state, ...) without
    what the checkpoint lacks by design, or a ValueError naming the knob (module docstring)."""
    full = _OPTIMIZER in state
    out = dict(state)
    # low-rank layers here that the checkpoint saved without their branch
    absent = [k[: -len(_RES)] for k in state if k.endswith(_RES) and k not in saved]
    if absent:
        p = absent[0]
        if p + "lora_u" in saved:
            raise ValueError(f"checkpoint {checkpoint_id} has {p}lora_u but no {p}{_RES}: it was written by titan-nvfp4 "
                             "before the residual was saved apart; fold it with `python -m "
                             f"titan_nvfp4.tools.export_dense {checkpoint_id} dense.pt` and load its weights")
        if full:
            raise ValueError(
                f"checkpoint {checkpoint_id} has no low-rank factors ({p}lora_u): it was saved without lora_rank, "
                f"and this run has {_LINEAR} > 0 (or the experts'), whose factors have no optimizer state to resume. "
                "Resume it with lora_rank = 0, or start a new run from its weights (checkpoint.initial_load_path = "
                "this folder, checkpoint.initial_load_model_only = true): they are decomposed at load")
        for p in absent:
            for k in _factor_keys(p):
                out.pop(k, None)
        logger.info(f"NVFP4: checkpoint {checkpoint_id} has no low-rank factors: {len(absent)} loaded weights are "
                    "decomposed at load")
    # OutControl's selection (model buffers) that the checkpoint lacks: the layers stay unselected
    unselected = [k for k in state if k.endswith(OUTCONTROL_KEYS) and k not in saved]
    for k in unselected:
        out.pop(k)
    if unselected:
        logger.info(f"NVFP4: checkpoint {checkpoint_id} has no OutControl channel selection for "
                    f"{len(unselected) // 2} layers (e.g. {unselected[0]!r}): they load unselected")
    # low-rank layers in the checkpoint, plain here: the model loads W; the SR counts differ per layer
    trainer = state.get(_TRAIN_STATE)
    request = trainer.state_dict() if trainer is not None and hasattr(trainer, "state_dict") else {}
    drop = set()
    for layer, count in (request.get(KEY) or {}).items():
        key = f"{_TRAIN_STATE}.{KEY}.{layer}"
        if key not in saved:
            drop.add(key)  # a layer the checkpoint ran without NVFP4: its SR streams start at zero
        elif _size(saved[key]) != tuple(count.shape):
            ours, theirs = count.numel(), _size(saved[key])[0]
            raise ValueError(
                f"checkpoint {checkpoint_id} was saved with another {_LINEAR}: layer {layer!r} has {theirs} SR "
                f"streams there, {ours} here (a low-rank layer has 3). Resume it with the lora_rank it was saved "
                "with, or start a new run from its weights (checkpoint.initial_load_path = this folder, "
                "checkpoint.initial_load_model_only = true; a low-rank checkpoint's weights load as W = R + "
                "U·diag(σ)·V)")
    histories = request.get(HISTORY_KEY) or {}
    windows = [f"{_TRAIN_STATE}.{HISTORY_KEY}.{layer}" for layer in histories]
    missing = [k for k in windows if k not in saved]
    for (layer, h), key in zip(histories.items(), windows):
        if key in saved and _size(saved[key]) != tuple(h.shape):
            raise ValueError(f"checkpoint {checkpoint_id} has {_size(saved[key])[0]} steps of activation amax "
                             f"window for {layer!r}, this run's activation_amax_history = {h.shape[0]}: resume with "
                             f"activation_amax_history = {_size(saved[key])[0]} (or 0)")
    if missing and len(missing) < len(windows):
        raise ValueError(f"checkpoint {checkpoint_id} has activation amax windows for {len(windows) - len(missing)} "
                         f"of this run's {len(windows)} layers (none for {missing[0].split('.', 2)[2]!r}): "
                         "[quantize.linear.nvfp4] activation_amax_history or the converted layers changed")
    if missing:
        logger.info(f"NVFP4: checkpoint {checkpoint_id} has no activation amax windows: they start empty "
                    "(activation_amax_history)")
    drop.update(missing)
    # OsciReset margins of a run without osci_reset_every: none (resume_windows logs an open window that restarts)
    margins = {f"{_TRAIN_STATE}.{OSCI_KEY}.{layer}" for layer in request.get(OSCI_KEY) or {}} - set(saved)
    # OutControl window sums of a run without outcontrol_fraction: none (load_outcontrol_norms logs a window that
    # restarts)
    margins |= {f"{_TRAIN_STATE}.{OUTCONTROL_KEY}.{layer}" for layer in request.get(OUTCONTROL_KEY) or {}} - set(saved)
    if drop or margins:
        if len(drop) > len(missing):
            logger.info(f"NVFP4: checkpoint {checkpoint_id} has no SR counts for {len(drop) - len(missing)} NVFP4 "
                        "layers: their stochastic-rounding streams start at zero")
        out[_TRAIN_STATE] = _TrainStateRequest(trainer, drop | margins)
    return out


def install() -> None:
    """Patch TorchTitan's ModelWrapper.state_dict and CheckpointManager.dcp_load (idempotent)."""
    from torchtitan.components import checkpoint as tt

    if getattr(tt.CheckpointManager, "_nvfp4_checkpoint", False):
        return
    model_state_dict, dcp_load = tt.ModelWrapper.state_dict, tt.CheckpointManager.dcp_load

    def state_dict(self):
        if has_lowrank(self.model):  # the saved W follows the trained R and factors
            self.cache_state_dict = self._get_state_dict()
        return model_state_dict(self)

    def checked_dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        saved = None if from_hf else saved_keys(checkpoint_id)
        if from_hf:  # Hugging Face names exist for weights only: OutControl's selection is not asked for
            state_dict = {k: v for k, v in state_dict.items() if not k.endswith(OUTCONTROL_KEYS)}
        if saved is not None:
            state_dict = adapt_request(state_dict, saved, checkpoint_id)
        return dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)

    tt.ModelWrapper.state_dict = state_dict
    tt.CheckpointManager.dcp_load = checked_dcp_load
    tt.CheckpointManager._nvfp4_checkpoint = True


__all__ = ["OUTCONTROL_KEYS", "adapt_request", "has_lowrank", "install", "saved_keys"]
