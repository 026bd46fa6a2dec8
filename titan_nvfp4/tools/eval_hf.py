"""Validation loss of an exported Hugging Face model on its run's held-out data, computed as the run's validator does.

    python -m titan_nvfp4.tools.eval_hf HF_DIR --job.config_file JOB.toml [--steps N] [--device cuda] [--json OUT]

HF_DIR: a folder export_hf wrote (BF16 or NVFP4; transformers loads it, compressed-tensors decompressing NVFP4
weights and, for a w4a4 export, quantizing the Linears' inputs as its scheme says). JOB.toml (and any further
TorchTitan flags) must be the run's: its [validation] section names the data (dataset, local_batch_size, seq_len,
steps) and [model] hf_assets_path the tokenizer. The batches are read by TorchTitan's own validation dataloader,
from the start of the split, as every validation round of a run does (titan_nvfp4's torchtitan_fixes), and the loss
is the validator's: per batch, the summed token cross-entropy of fp32 logits over the batch's valid tokens, averaged
over the batches. So the figure compares with the run's "validate step: N  loss: X" lines (TorchTitan 0.2).

--dtype: the dtype transformers computes in (default bfloat16 on a GPU, as the run's autocast; float32 on the CPU).
--json OUT: the figures as JSON too, written atomically.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from .atomic import write_text
from .cli import fail, parser, require_output, writing
from .export_job import first_batches
from .job_model import check_flags, parse_job

PROG = "python -m titan_nvfp4.tools.eval_hf"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
IGNORE_INDEX = -100  # TorchTitan's (torchtitan.components.loss.IGNORE_INDEX)


def _args(argv: list[str]):
    ap = parser("titan_nvfp4.tools.eval_hf", __doc__)
    ap.allow_abbrev = False  # TorchTitan's --job... flags are passed on, not matched to ours
    ap.add_argument("hf_dir", type=Path, help="the Hugging Face model folder export_hf wrote")
    ap.add_argument("--steps", type=int, default=None,
                    help="validation batches to read (default: the job's [validation] steps; -1: the whole split)")
    ap.add_argument("--device", default=None, help="where transformers runs (default: cuda if present, else cpu)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="the compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args, rest = ap.parse_known_args(argv)
    return args, rest


def _check(args, rest: list[str]) -> None:
    from ..integration_common.torchtitan_version import installed_generation, version_string

    if installed_generation() in (None, "0.3"):  # a source checkout may report another version: let it try
        fail(PROG, f"eval_hf reads TorchTitan 0.2 job files and validation data; torchtitan {version_string()} is "
                   "installed (0.3's config registry is not supported by eval_hf yet)")
    if not args.hf_dir.is_dir() or not (args.hf_dir / "config.json").is_file():
        fail(PROG, f"{args.hf_dir} is not a Hugging Face model folder (no config.json): give the folder export_hf wrote")
    problem = check_flags(rest)
    if problem:
        fail(PROG, problem)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith("--")]
    if unknown:
        fail(PROG, f"unrecognized argument {unknown[0]!r}")
    if args.steps is not None and (args.steps == 0 or args.steps < -1):
        fail(PROG, f"--steps {args.steps}: give a positive number of batches, or -1 for the whole split")
    if args.json is not None:
        require_output(PROG, args.json, "--json file", [args.hf_dir])


def _job(rest: list[str]):
    """The run's JobConfig (TorchTitan's ConfigManager over the job file and flags), its custom import done (which
    registers or builds the run's datasets), and TorchTitan's tokenizer of its hf_assets_path."""
    import importlib

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from .hf_folder import tokenizer_files

    try:
        cfg = parse_job(rest)
    except SystemExit:
        fail(PROG, f"TorchTitan refused the job flags {' '.join(rest)}")
    if not cfg.validation.enable:
        raise ValueError("the job has no validation ([validation] enable = false): its run logged no validation loss "
                         "to compare with; pass --validation.enable (and the run's [validation] settings) to evaluate "
                         "on its validation dataset anyway")
    if cfg.experimental.custom_import:
        importlib.import_module(cfg.experimental.custom_import)
    assets = Path(cfg.model.hf_assets_path)
    tokenizer_files(assets)  # a ValueError naming the folder when it has no tokenizer
    return cfg, HuggingFaceTokenizer(str(assets))


def _batches(cfg, tokenizer, steps: int):
    """TorchTitan's validation dataloader of the job (one process), from the start of the split."""
    from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

    return build_text_validation_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=cfg,
                                            infinite=steps != -1)


def _first_batch(cfg, tokenizer, steps: int) -> torch.Tensor:
    """The token ids of the split's first batch; a ValueError naming the dataset when it cannot be read."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    name = cfg.validation.dataset
    if name not in DATASETS and not cfg.validation.dataset_path:
        raise ValueError(f"[validation] dataset {name!r} is not registered with TorchTitan (known: "
                         f"{', '.join(sorted(DATASETS))}); the job's [experimental] custom_import registers its own")
    what = f"[validation] dataset {cfg.validation.dataset!r}" + (
        f" ({cfg.validation.dataset_path})" if cfg.validation.dataset_path else "")
    return next(first_batches(lambda: _batches(cfg, tokenizer, steps), what, 1, purpose="validation"))


def _model(hf_dir: Path, device: torch.device, dtype: torch.dtype, first: torch.Tensor):
    """The folder as a user loads it (its config's dtype; compressed-tensors decompresses an NVFP4 export at the
    first forward, run here on ``first``), then cast to ``dtype`` by nn.Module's own cast (transformers refuses
    .to(dtype) on a quantized model), so that an NVFP4 model's activation quantization runs in ``dtype`` too."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).to(device).eval()
    except (OSError, ValueError, ImportError) as e:
        text = str(e).strip().splitlines()
        raise ValueError(f"transformers cannot load {hf_dir}: {text[0] if text else type(e).__name__}") from None
    if getattr(model.config, "quantization_config", None) is not None:
        with torch.no_grad():
            model(input_ids=first[:1].to(device))
    return torch.nn.Module.to(model, dtype)


@torch.no_grad()
def evaluate(model, batches, steps: int, device: torch.device) -> dict:
    """The validator's loss of ``model`` (a transformers causal LM) over the first ``steps`` batches (-1: all)."""
    losses, tokens, n = [], 0, 0
    for inputs, labels in batches:
        if steps != -1 and n >= steps:
            break
        ids, labels = inputs["input"].to(device), labels.to(device)
        logits = model(input_ids=ids).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                                                     reduction="sum", ignore_index=IGNORE_INDEX)
        valid = (labels != IGNORE_INDEX).sum()
        losses.append(loss_sum / valid.float())
        tokens += int(valid)
        n += 1
    if not n:
        raise ValueError("the validation split gave no batch")
    return {"loss": (torch.stack(losses).sum() / n).item(), "batches": n, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _args(argv)
    _check(args, rest)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(PROG, f"--device {args.device}: this torch ({torch.__version__}) finds no GPU")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    try:
        cfg, tokenizer = _job(rest)
        steps = cfg.validation.steps if args.steps is None else args.steps
        first = _first_batch(cfg, tokenizer, steps)
        model = _model(args.hf_dir, device, dtype, first)
        out = evaluate(model, _batches(cfg, tokenizer, steps), steps, device)
    except ValueError as e:
        fail(PROG, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if not math.isfinite(out["loss"]):
        fail(PROG, f"the validation loss of {args.hf_dir} is {out['loss']}: the exported weights are not usable")
    out.update(hf_dir=str(args.hf_dir), dataset=cfg.validation.dataset, local_batch_size=cfg.validation.local_batch_size,
               seq_len=cfg.validation.seq_len, device=str(device), dtype=str(dtype).removeprefix("torch."))
    line = (f"validation loss {out['loss']:.5f} over {out['batches']} batches ({out['tokens']:,} tokens) of "
            f"{out['dataset']}: {args.hf_dir} ({out['dtype']}, {out['device']})")
    if args.json is not None:
        with writing(PROG, args.json, "--json file"):
            write_text(args.json, json.dumps(out, indent=1) + "\n", "--json")
    print(line)


if __name__ == "__main__":
    main()
