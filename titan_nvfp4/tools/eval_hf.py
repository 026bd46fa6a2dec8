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

import math
import sys
from pathlib import Path

import torch

from .cli import fail, parser
from .validation_loss import (add_flags, check_args, describe, device_and_dtype, first_line, first_validation_batch,
                              refuse_torchtitan03, steps_of, validation_batches, validation_job, validation_loss,
                              write_json)

PROG = "python -m titan_nvfp4.tools.eval_hf"


def _args(argv: list[str]):
    ap = parser("titan_nvfp4.tools.eval_hf", __doc__)
    ap.allow_abbrev = False  # TorchTitan's --job... flags are passed on, not matched to ours
    ap.add_argument("hf_dir", type=Path, help="the Hugging Face model folder export_hf wrote")
    add_flags(ap, "transformers")
    args, rest = ap.parse_known_args(argv)
    return args, rest


def _check(args, rest: list[str]) -> None:
    refuse_torchtitan03(PROG, "eval_hf")
    if not args.hf_dir.is_dir() or not (args.hf_dir / "config.json").is_file():
        fail(PROG, f"{args.hf_dir} is not a Hugging Face model folder (no config.json): give the folder export_hf "
                   "wrote")
    check_args(PROG, args, rest, [args.hf_dir])


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _args(argv)
    _check(args, rest)
    device, dtype = device_and_dtype(PROG, args)
    try:
        cfg, tokenizer = validation_job(rest)
        steps = steps_of(cfg, args.steps)
        first = first_validation_batch(cfg, tokenizer, steps)
        model = _model(args.hf_dir, device, dtype, first)
        out = validation_loss(lambda ids: model(input_ids=ids).logits, validation_batches(cfg, tokenizer, steps),
                              steps, device)
    except ValueError as e:
        fail(PROG, first_line(e))
    if not math.isfinite(out["loss"]):
        fail(PROG, f"the validation loss of {args.hf_dir} is {out['loss']}: the exported weights are not usable")
    out = {**describe(out, cfg, device, dtype), "hf_dir": str(args.hf_dir)}
    line = (f"validation loss {out['loss']:.5f} over {out['batches']} batches ({out['tokens']:,} tokens) of "
            f"{out['dataset']}: {args.hf_dir} ({out['dtype']}, {out['device']})")
    write_json(PROG, args.json, out)
    print(line)


if __name__ == "__main__":
    main()
