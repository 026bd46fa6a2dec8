"""Validation loss of a run's checkpoint on TorchTitan's own model, computed as the run's validator does: the figures
each export's loss (eval_hf) compares with.

    python -m titan_nvfp4.tools.eval_run CHECKPOINT --job.config_file JOB.toml --forward nvfp4|w4a16|bf16 [--steps N]
        [--device cuda] [--dtype bfloat16|float32] [--json OUT]

CHECKPOINT: a DCP checkpoint folder (outputs/<run>/checkpoint/step-N) or the folder holding them (its latest step),
as export_hf takes it. JOB.toml (and any further TorchTitan flags) must be the run's: the model is built from it as
the Trainer builds it and loaded with the checkpoint's weights (export_hf's job_model.py), and its [validation]
section names the data, read by TorchTitan's own validation dataloader, the loss the validator's (eval_hf's:
tools/validation_loss.py).

--forward nvfp4: the model as the job converts it, with the NVFP4 layers' state the checkpoint's train_state carries
  (activation amax windows, the step for bf16_after_fraction): the run's own forward, weights and activations in
  NVFP4. Its figure is the run's "validate step: N  loss: X" line at that step; the nvfp4 w4a4 export compares with it.
--forward bf16: the same weights in the job's model without the NVFP4 converters (plain nn.Linear; a lora_rank layer
  computes with the checkpoint's W = R + U·diag(σ)·V): the run's BF16 evaluation, for the bf16 export.
--forward w4a16: that plain model with each NVFP4 Linear holding the weight its forward multiplies, decoded in FP32
  from the codes and scales export_hf's nvfp4 export writes (tools/hf_weights.py forward_weights), activations
  unquantized: for the nvfp4 w4a16 export. Refused for lora_rank layers and MoE experts (no such export).

On a GPU the model runs with the job's NVFP4 GEMM backend under the run's autocast (--dtype bfloat16, the default
there: FP32 master weights, BF16 matmuls, as one GPU's run computes), eager; on the CPU with the reference backend,
in float32 by default. A checkpoint written under FSDP2 (whose forward computed with BF16 parameters) is evaluated
the same way, with a warning. --json OUT: the figures as JSON too, written atomically.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from pathlib import Path

import torch
from torch import nn

from .checkpoint_integrity import verified_or_fail
from .cli import fail, parser
from .validation_loss import (add_flags, check_args, describe, device_and_dtype, first_line, first_validation_batch,
                              refuse_torchtitan03, steps_of, validation_batches, validation_job, validation_loss,
                              write_json)

PROG = "python -m titan_nvfp4.tools.eval_run"
FORWARDS = ("nvfp4", "w4a16", "bf16")


def _args(argv: list[str]):
    ap = parser("titan_nvfp4.tools.eval_run", __doc__)
    ap.allow_abbrev = False  # TorchTitan's --job... flags are passed on, not matched to ours
    ap.add_argument("checkpoint", type=Path, help="a DCP checkpoint folder (step-N) or the checkpoint folder "
                                                  "holding them (its latest step is evaluated)")
    ap.add_argument("--forward", required=True, metavar="{" + ",".join(FORWARDS) + "}",
                    help="nvfp4: the run's forward; bf16: the same weights without NVFP4; w4a16: the forward's NVFP4 "
                         "weights, unquantized activations")
    add_flags(ap, "the model")
    ap.epilog = "Every other flag (--job.config_file JOB.toml, --model.flavor ...) goes to TorchTitan's job parser."
    args, rest = ap.parse_known_args(argv)
    return args, rest


def _check(args, rest: list[str]):
    """One-line failures for what can be checked before anything loads; the checkpoint's step folder."""
    from .job_model import find_step

    refuse_torchtitan03(PROG, "eval_run")
    if args.forward not in FORWARDS:
        fail(PROG, f"--forward {args.forward!r}: choose one of {', '.join(FORWARDS)}")
    try:
        step = find_step(args.checkpoint)
    except ValueError as e:
        fail(PROG, str(e))
    check_args(PROG, args, rest, [args.checkpoint])
    verified_or_fail(PROG, step.path)
    return step


def _switch_step(model: nn.Module) -> int | None:
    """The optimizer step from which the job's NVFP4 modules compute in high precision (bf16_after_fraction)."""
    from ..training.schedule import GROUPED_STEPS, LINEAR_STEPS

    steps = [c.schedule.switch_step for c in (getattr(model, n, None) for n in (LINEAR_STEPS, GROUPED_STEPS))
             if c is not None and c.schedule is not None and c.schedule.switch_step is not None]
    return min(steps) if steps else None


def _plain_job(cfg):
    """The job without our NVFP4 converters: its model has plain nn.Linear layers (and TorchTitan's experts)."""
    from ..recipe.knobs import GroupedKnobs, LinearKnobs

    plain = copy.deepcopy(cfg)
    plain.model.converters = [c for c in cfg.model.converters if c not in (LinearKnobs.SECTION, GroupedKnobs.SECTION)]
    return plain


def nvfp4_model(cfg, step):
    """(the run's model: converted as the job converts it, with the checkpoint's weights and train_state; what the
    checkpoint told about its weights)."""
    from ..training.train_state import HISTORY_KEY
    from .job_model import build_model, load_layer_state, load_weights

    model, _, _ = build_model(cfg)
    loaded = load_weights(model, step.path)
    at, lacking = load_layer_state(model, step.path, step.step)
    switch = _switch_step(model)
    if switch is not None and at is None:
        raise ValueError(f"the job computes in BF16 from step {switch} on (bf16_after_fraction) and {step.path} has "
                         "neither a train_state step nor a step-N name: give the step-N folder so its step is known")
    if HISTORY_KEY in lacking:
        print(f"eval_run: warning: {step.path} carries no activation amax windows (activation_amax_history): each "
              "NVFP4 input is quantized with its own amax, not with the run's window", file=sys.stderr)
    return model, loaded


def bf16_model(cfg, step):
    """(the checkpoint's weights in the job's model without the NVFP4 converters (a low-rank Linear's checkpoint
    ``weight`` entry is its W = R + U·diag(σ)·V), what the checkpoint told about its weights)."""
    from ..recipe.knobs import GroupedKnobs
    from .job_model import build_model, load_weights

    rank = cfg.quantize.grouped_mm.nvfp4.lora_rank if GroupedKnobs.SECTION in cfg.model.converters else 0
    if rank:
        raise ValueError(f"--forward bf16: the job's MoE experts are low-rank ([{GroupedKnobs.SECTION}] lora_rank = "
                         f"{rank}): eval_run does not fold their branch into plain experts yet; use --forward nvfp4")
    model, _, _ = build_model(_plain_job(cfg))
    return model, load_weights(model, step.path)


def w4a16_model(cfg, step):
    """(the plain model (bf16_model's) whose NVFP4 Linears hold the weights their forward multiplies, as the nvfp4
    export writes them (hf_weights.forward_weights, quantized in the dtype export_hf's auto takes), what the
    checkpoint told about its weights)."""
    from .hf_weights import classify, forward_weight_dtype, forward_weights
    from .job_model import build_model, load_weights

    converted, _, _ = build_model(cfg)
    loaded = load_weights(converted, step.path)
    layers = classify(converted)
    if layers.lowrank:
        raise ValueError(f"--forward w4a16: layer {layers.lowrank[0]!r} is low-rank ([quantize.linear.nvfp4] "
                         f"lora_rank, {len(layers.lowrank)} layers): its forward adds U·diag(σ)·V to NVFP4(R), not "
                         "one NVFP4 weight (export_hf's nvfp4 export refuses it too); use --forward nvfp4 or bf16")
    if layers.split:
        raise ValueError(f"--forward w4a16: layer {layers.split[0]!r} runs its OutControl-selected input channels in "
                         f"MXFP8 beside NVFP4 ([quantize.linear.nvfp4] outcontrol_fraction, {len(layers.split)} "
                         "layers), not one NVFP4 weight (export_hf's nvfp4 export refuses it too); use --forward nvfp4 "
                         "or bf16")
    if layers.other:
        kind = type(converted.get_submodule(layers.other[0])).__name__
        raise ValueError(f"--forward w4a16: {layers.other[0]!r} ({kind}) holds MoE experts, which export_hf's nvfp4 "
                         "export does not hold: use --forward nvfp4 or bf16")
    if not layers.nvfp4:
        raise ValueError(f"--forward w4a16: the job's model has no NVFP4 layers ([model] converters = "
                         f"{list(cfg.model.converters)}): use --forward bf16")
    switch = _switch_step(converted)
    if switch is not None and (step.step is None or step.step >= switch):
        raise ValueError(f"--forward w4a16: the run computes in BF16 from step {switch} on (bf16_after_fraction) and "
                         f"{step.path} is " + ("not named step-N" if step.step is None else f"at step {step.step}")
                         + ": its forward does not multiply NVFP4 weights there; use --forward bf16")
    dtype, narrower = forward_weight_dtype(layers, loaded.fsdp, cfg.training.mixed_precision_param, loaded.dtypes)
    if narrower:
        raise ValueError(f"--forward w4a16: {step.path} stores {narrower[0]}.weight in "
                         f"{loaded.dtypes[narrower[0] + '.weight']}, but the run's forward quantized {dtype} weights "
                         "(checkpoint.export_dtype?): its NVFP4 weights cannot be rebuilt")
    weights = forward_weights(layers, dtype)
    model, _, _ = build_model(_plain_job(cfg))
    state = converted.state_dict()
    state.update({f"{name}.weight": w for name, w in weights.items()})
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    return model, loaded


MODELS = {"nvfp4": nvfp4_model, "bf16": bf16_model, "w4a16": w4a16_model}


def titan_forward(model: nn.Module, tokenizer, device: torch.device, dtype: torch.dtype):
    """``ids -> logits`` of a TorchTitan model as the validator calls it: with the model's attention masks when it
    makes them (flex, varlen), under the run's autocast when ``dtype`` is not float32."""
    amp = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext

    def forward(ids: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if hasattr(model, "get_attention_masks"):
            try:
                kwargs["attention_masks"] = model.get_attention_masks(input_batch=ids, tokenizer=tokenizer,
                                                                      extra_inputs={})
            except TypeError:  # TorchTitan's answer for SDPA: no masks
                pass
        with amp():
            return model(ids, **kwargs)

    return forward


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _args(argv)
    step = _check(args, rest)
    device, dtype = device_and_dtype(PROG, args)
    try:
        cfg, tokenizer = validation_job(rest, backend=None if device.type == "cuda" else "reference")
        steps = steps_of(cfg, args.steps)
        first_validation_batch(cfg, tokenizer, steps)  # the data can be read, before the model loads
        model, loaded = MODELS[args.forward](cfg, step)
        if loaded.fsdp:
            print(f"eval_run: warning: {step.path} was written under FSDP2, whose forward computed with "
                  f"{cfg.training.mixed_precision_param} parameters; eval_run computes with the FP32 weights (under "
                  "autocast with --dtype bfloat16): near the run's figure, not the same rounding", file=sys.stderr)
        model = model.to(device).eval()
        out = validation_loss(titan_forward(model, tokenizer, device, dtype), validation_batches(cfg, tokenizer, steps),
                              steps, device)
    except ValueError as e:
        fail(PROG, first_line(e))
    at = f"step {step.step} of {step.path.parent}" if step.step is not None else str(step.path)
    if not math.isfinite(out["loss"]):
        fail(PROG, f"the validation loss of {at} (--forward {args.forward}) is {out['loss']}")
    out = {**describe(out, cfg, device, dtype), "checkpoint": str(step.path), "step": step.step,
           "forward": args.forward}
    write_json(PROG, args.json, out)
    print(f"validation loss {out['loss']:.5f} over {out['batches']} batches ({out['tokens']:,} tokens) of "
          f"{out['dataset']}: {at}, forward {args.forward} ({out['dtype']}, {out['device']})")


if __name__ == "__main__":
    main()
