"""A run's validation loss as TorchTitan 0.2's validator computes it, for the tools that evaluate a model of the run:
eval_hf (an exported folder, through transformers) and eval_run (the run's checkpoint, through TorchTitan's model).

The batches are the job's ``[validation]`` section, read by TorchTitan's own validation dataloader (one process, from
the start of the split, as every validation round of a run reads it: titan_nvfp4's torchtitan_fixes). The loss is the
validator's: per batch, the summed token cross-entropy of fp32 logits over the batch's valid tokens, averaged over the
batches. The model is any callable ``ids -> logits``. Also the two tools' shared flags (--steps, --device, --dtype,
--json), their checks (and the refusal of TorchTitan 0.3), and the JSON write.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .atomic import write_text
from .cli import fail, require_output, writing
from .export_job import first_batches
from .job_model import check_flags, parse_job

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
IGNORE_INDEX = -100  # TorchTitan's (torchtitan.components.loss.IGNORE_INDEX)


def add_flags(ap: argparse.ArgumentParser, where: str) -> None:
    """--steps, --device, --dtype and --json; ``where`` says what computes (for the help)."""
    ap.add_argument("--steps", type=int, default=None,
                    help="validation batches to read (default: the job's [validation] steps; -1: the whole split)")
    ap.add_argument("--device", default=None, help=f"where {where} runs (default: cuda if present, else cpu)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="the compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")


def refuse_torchtitan03(prog: str, tool: str) -> None:
    """``fail`` under TorchTitan 0.3 (or none): the tools read 0.2 job files and validation data."""
    from ..integration_common.torchtitan_version import installed_generation, version_string

    if installed_generation() in (None, "0.3"):  # a source checkout may report another version: let it try
        fail(prog, f"{tool} reads TorchTitan 0.2 job files and validation data; torchtitan {version_string()} is "
                   f"installed (0.3's config registry is not supported by {tool} yet)")


def check_args(prog: str, args, rest: list[str], inputs: list[Path]) -> None:
    """``fail`` for what add_flags' flags and the job flags ``rest`` get wrong before anything loads: no job file, a
    short flag TorchTitan would not take, --steps 0, a --json file that cannot be written or is one of ``inputs``."""
    problem = check_flags(rest)
    if problem:
        fail(prog, problem)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith("--")]
    if unknown:
        fail(prog, f"unrecognized argument {unknown[0]!r}")
    if args.steps is not None and (args.steps == 0 or args.steps < -1):
        fail(prog, f"--steps {args.steps}: give a positive number of batches, or -1 for the whole split")
    if args.json is not None:
        require_output(prog, args.json, "--json file", inputs)


def device_and_dtype(prog: str, args) -> tuple[torch.device, torch.dtype]:
    """--device (default cuda if present) and --dtype (default bfloat16 on a GPU, as the run's autocast, else
    float32)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(prog, f"--device {args.device}: this torch ({torch.__version__}) finds no GPU")
    return device, DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]


def validation_job(overrides: list[str], backend: str | None = "reference"):
    """The run's JobConfig (TorchTitan's ConfigManager over the job file and flags; the NVFP4 GEMM backend set to
    ``backend``, None: the job's), its custom import done (which registers or builds the run's datasets), and
    TorchTitan's tokenizer of its hf_assets_path. ValueErrors name the flags, the missing [validation] or the
    tokenizer folder."""
    import importlib

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from .hf_folder import tokenizer_files

    try:
        cfg = parse_job(overrides, backend)
    except SystemExit:
        raise ValueError(f"TorchTitan refused the job flags {' '.join(overrides)}") from None
    if not cfg.validation.enable:
        raise ValueError("the job has no validation ([validation] enable = false): its run logged no validation loss "
                         "to compare with; pass --validation.enable (and the run's [validation] settings) to evaluate "
                         "on its validation dataset anyway")
    if cfg.experimental.custom_import:
        importlib.import_module(cfg.experimental.custom_import)
    assets = Path(cfg.model.hf_assets_path)
    tokenizer_files(assets)  # a ValueError naming the folder when it has no tokenizer
    return cfg, HuggingFaceTokenizer(str(assets))


def steps_of(cfg, steps: int | None) -> int:
    """The batches to read: ``steps`` (--steps) if given, else the job's [validation] steps."""
    return cfg.validation.steps if steps is None else steps


def validation_batches(cfg, tokenizer, steps: int):
    """TorchTitan's validation dataloader of the job (one process), from the start of the split."""
    from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

    return build_text_validation_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=cfg,
                                            infinite=steps != -1)


def first_validation_batch(cfg, tokenizer, steps: int) -> torch.Tensor:
    """The token ids of the split's first batch; a ValueError naming the dataset when it cannot be read."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    name = cfg.validation.dataset
    if name not in DATASETS and not cfg.validation.dataset_path:
        raise ValueError(f"[validation] dataset {name!r} is not registered with TorchTitan (known: "
                         f"{', '.join(sorted(DATASETS))}); the job's [experimental] custom_import registers its own")
    what = f"[validation] dataset {cfg.validation.dataset!r}" + (
        f" ({cfg.validation.dataset_path})" if cfg.validation.dataset_path else "")
    return next(first_batches(lambda: validation_batches(cfg, tokenizer, steps), what, 1, purpose="validation"))


@torch.no_grad()
def validation_loss(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterable, steps: int,
                    device: torch.device) -> dict:
    """The validator's loss of ``forward`` (token ids [B, S] on ``device`` -> logits [B, S, V]) over the first
    ``steps`` batches (-1: all): {loss, batches, tokens}."""
    losses, tokens, n = [], 0, 0
    for inputs, labels in batches:
        if steps != -1 and n >= steps:
            break
        ids, labels = inputs["input"].to(device), labels.to(device)
        logits = forward(ids)
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                                                     reduction="sum", ignore_index=IGNORE_INDEX)
        valid = (labels != IGNORE_INDEX).sum()
        losses.append(loss_sum / valid.float())
        tokens += int(valid)
        n += 1
    if not n:
        raise ValueError("the validation split gave no batch")
    return {"loss": (torch.stack(losses).sum() / n).item(), "batches": n, "tokens": tokens}


def describe(out: dict, cfg, device: torch.device, dtype: torch.dtype) -> dict:
    """``out`` with the data and the computation it was measured on."""
    return {**out, "dataset": cfg.validation.dataset, "local_batch_size": cfg.validation.local_batch_size,
            "seq_len": cfg.validation.seq_len, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}


def write_json(prog: str, path: Path | None, out: dict) -> None:
    """The figures to --json ``path`` (atomically), when given."""
    if path is not None:
        with writing(prog, path, "--json file"):
            write_text(path, json.dumps(out, indent=1) + "\n", "--json")


def first_line(e: Exception) -> str:
    """An exception's first line, for ``fail``."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["DTYPES", "IGNORE_INDEX", "add_flags", "check_args", "describe", "device_and_dtype", "first_line",
           "first_validation_batch", "refuse_torchtitan03", "steps_of", "validation_batches", "validation_job",
           "validation_loss", "write_json"]
