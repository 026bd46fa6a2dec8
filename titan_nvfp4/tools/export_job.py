"""What export_hf needs of a run, whichever TorchTitan generation wrote it: the Job each generation's adapter
(job_model.py for 0.2's TOML job files, job_model_v03.py for 0.3's config registry) builds from its command-line
flags and checkpoint, so that the export itself (export_hf.py, hf_weights.py, compressed_nvfp4.py) is shared."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class Job:
    """A run's model, built as its trainer builds it and holding one checkpoint's weights.

    ``name``: TorchTitan's model name; ``adapter``: TorchTitan's state-dict adapter of the model; ``hf_config``:
    config.json's dict (no quantization_config); ``assets``: the tokenizer folder; ``fsdp``: whether the checkpoint
    was written under FSDP2 (its forward then quantized ``mixed_precision_param`` weights); ``dtypes``: the dtype
    each model key is stored in; ``converters``: the job's NVFP4 sections, for messages; ``bf16_after_fraction``
    and ``activation_amax_history``: the Linear section's knobs; ``knob``: how the user spells that section
    (e.g. "[quantize.linear.nvfp4]"); ``calibration``: the token ids of the first N batches of the job's data."""

    name: str
    model: nn.Module
    adapter: object
    hf_config: dict
    assets: Path
    bos_id: int | None
    eos_id: int | None
    fsdp: bool
    dtypes: dict[str, torch.dtype]
    mixed_precision_param: str
    converters: str
    bf16_after_fraction: float | None
    activation_amax_history: int
    knob: str
    calibration: Callable[[int], Iterator[torch.Tensor]]


__all__ = ["Job"]


def first_batches(build_loader: Callable[[], Iterable], what: str, count: int,
                  purpose: str = "calibration") -> Iterator[torch.Tensor]:
    """The token ids of the first ``count`` batches of the loader ``build_loader`` makes (each generation's adapter
    builds it as its trainer does); a ValueError naming ``purpose`` and ``what`` (the data) when it cannot be read
    or runs short."""
    try:
        batches = iter(build_loader())
        first = [next(batches) for _ in range(count)]
    except StopIteration:
        raise ValueError(f"{purpose}: {what} has fewer than {count} batches") from None
    except Exception as e:  # datasets' and TorchTitan's own errors: one line naming the data
        text = str(e).strip().splitlines()
        raise ValueError(f"{purpose}: cannot read {what}: {type(e).__name__}"
                         + (f": {text[0]}" if text else "")) from None
    for inputs, _labels in first:
        yield inputs["input"] if isinstance(inputs, dict) else inputs


def flag_value(rest: list[str], flag: str) -> str | None:
    """The value of ``flag`` in the command-line flags ``rest`` ("--flag value" or "--flag=value"; "" when it ends the
    list), None when absent: each generation's adapter reads its run's naming flags with it."""
    for i, a in enumerate(rest):
        if a == flag:
            return rest[i + 1] if i + 1 < len(rest) else ""
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
