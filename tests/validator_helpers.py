"""TorchTitan 0.2's own Validator in one CPU process, as the validation tests run it against a model."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.validate import Validator


def cpu_validator(cfg, tokenizer) -> tuple[Validator, list[float]]:
    """(TorchTitan's Validator over ``cfg``'s [validation] data, unsharded, the list its logged losses go to)."""
    logged = []
    metrics = SimpleNamespace(ntokens_since_last_log=0, log_validation=lambda loss, step: logged.append(loss))
    dims = SimpleNamespace(dp_enabled=False, cp_enabled=False, pp_enabled=False, dp_cp_enabled=False)
    validator = Validator(job_config=cfg, dp_world_size=1, dp_rank=0, tokenizer=tokenizer, parallel_dims=dims,
                          loss_fn=cross_entropy_loss, validation_context=contextlib.nullcontext,
                          maybe_enable_amp=contextlib.nullcontext(), metrics_processor=metrics)
    return validator, logged


def validate_on_cpu(validator: Validator, model, step: int) -> None:
    """One validation round of ``model`` (TorchTitan's validator moves batches to its device type: the CPU here)."""
    from torchtitan.tools import utils

    mp = pytest.MonkeyPatch()
    mp.setattr(utils, "device_type", "cpu")
    try:
        validator.validate([model], step)
    finally:
        mp.undo()
