"""Export a TorchTitan checkpoint as a Hugging Face model folder, in BF16 or in compressed-tensors' NVFP4.

    python -m titan_nvfp4.tools.export_hf CHECKPOINT --job.config_file JOB.toml --format bf16 --out DIR
    python -m titan_nvfp4.tools.export_hf CHECKPOINT --job.config_file JOB.toml --format nvfp4 --out DIR
    python -m titan_nvfp4.tools.export_hf CHECKPOINT --module MODULE --config NAME --format nvfp4 --out DIR  (0.3)

CHECKPOINT: a DCP checkpoint folder (outputs/<run>/checkpoint/step-N) or the folder holding them (its latest
step). The job file (and any further TorchTitan flags, e.g. --model.flavor) must be the run's: the model is
built from it on the CPU and converted with its converters, then the checkpoint's weights are loaded into it.
DIR, a new or empty folder, receives config.json, model-*.safetensors with model.safetensors.index.json, the
tokenizer files of the job's [model] hf_assets_path, and generation_config.json; it is written beside DIR and
moved into place when complete, so a failed export leaves no folder. Weights are renamed by TorchTitan's own
state-dict adapter of the model (Llama3 here; others are refused by name). docs/export.md has the details.

--format bf16: every weight in BF16; a lora_rank layer exports W = R + U·diag(σ)·V, the checkpoint's `weight`.
--format nvfp4: each NVFP4 Linear as the forward quantizes it from this checkpoint on (codes, E4M3 scales, FP32
tensor scale; 16x16 tile scales repeated per row) in compressed-tensors' nvfp4-pack-quantized layout, the
other weights in BF16 (the BF16 Linears listed in quantization_config.ignore). Refused for lora_rank layers
(their forward adds a branch the layout cannot hold) and after bf16_after_fraction's switch.
--scheme w4a16 (default): NVFP4 weights, 16-bit activations. --scheme w4a4: compressed-tensors' NVFP4 scheme,
NVFP4 weights and inputs; each Linear's input_global_scale S = 6·448/amax with the amax of the run's activation
amax history (activation_amax_history) in the checkpoint, or, with --calibration-batches N (required when the
checkpoint has none), the largest input seen over the first N batches of the job's dataset.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from .atomic import atomic_dir, refuse_output_over_input
from .checkpoint_integrity import verified_or_fail
from .cli import fail, parser, writing

PROG = "python -m titan_nvfp4.tools.export_hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCHEMES = ["w4a16", "w4a4"]


def _args(argv: list[str]):
    ap = parser("titan_nvfp4.tools.export_hf", __doc__)
    ap.allow_abbrev = False  # TorchTitan's --job... flags are passed on, not matched to ours
    ap.add_argument("checkpoint", type=Path, help="a DCP checkpoint folder (step-N) or the checkpoint folder "
                                                  "holding them (its latest step is exported)")
    ap.add_argument("--format", required=True, choices=["bf16", "nvfp4"],
                    help="bf16: dense BF16 weights; nvfp4: the NVFP4 Linears in compressed-tensors' layout")
    ap.add_argument("--scheme", choices=SCHEMES, default=None,
                    help="with --format nvfp4: w4a16, NVFP4 weights and 16-bit activations (the default); w4a4, "
                         "NVFP4 weights and input activations (compressed-tensors' NVFP4 scheme)")
    ap.add_argument("--calibration-batches", type=int, default=None, metavar="N",
                    help="with --scheme w4a4: the input tensor scales from the largest input each Linear sees over "
                         "the first N batches of the job's dataset (default: the run's amax history)")
    ap.add_argument("--out", type=Path, required=True, help="the Hugging Face model folder to write (new or empty)")
    ap.add_argument("--weight-dtype", choices=["auto", *DTYPES], default="auto",
                    help="with --format nvfp4: the dtype the forward quantized the weights in; auto: the job's "
                         "training.mixed_precision_param if the checkpoint was written under FSDP2, else float32")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB; e.g. 500MB)")
    ap.epilog = "Every other flag (--job.config_file JOB.toml, --model.flavor ...) goes to TorchTitan's job parser."
    args, rest = ap.parse_known_args(argv)
    return ap, args, rest


def _generation():
    """The job adapter of the installed TorchTitan generation: job_model (0.2 job files) or job_model_v03 (0.3's
    config registry)."""
    from ..integration_common.torchtitan_version import installed_generation

    if installed_generation() == "0.3":
        from . import job_model_v03 as generation
    else:
        from . import job_model as generation
    return generation


def _check_paths(args, rest: list[str]):
    """One-line failures for what can be checked before anything loads."""
    from .hf_folder import parse_size
    from .job_model import find_step

    if args.scheme is not None and args.format != "nvfp4":
        fail(PROG, f"--scheme {args.scheme} applies to --format nvfp4 only")
    if args.calibration_batches is not None and args.scheme != "w4a4":
        fail(PROG, f"--calibration-batches {args.calibration_batches} applies to --scheme w4a4 only")
    if args.calibration_batches is not None and args.calibration_batches < 1:
        fail(PROG, f"--calibration-batches {args.calibration_batches}: give a positive number of batches")
    if args.weight_dtype != "auto" and args.format != "nvfp4":
        fail(PROG, f"--weight-dtype {args.weight_dtype} applies to --format nvfp4 only")
    try:
        step = find_step(args.checkpoint)
        shard_bytes = parse_size(args.max_shard_size)
        refuse_output_over_input(args.out, [args.checkpoint], "--out")
    except ValueError as e:
        fail(PROG, str(e))
    problem = _generation().check_flags(rest)
    if problem:
        fail(PROG, problem)
    if step.path.resolve() in args.out.resolve().parents:
        fail(PROG, f"--out {args.out} is inside the checkpoint folder {step.path}: write it elsewhere")
    if args.out.exists() and not args.out.is_dir():
        fail(PROG, f"--out {args.out} is a file; give a folder path")
    if args.out.is_dir() and any(args.out.iterdir()):
        fail(PROG, f"--out {args.out} exists and is not empty; remove it or give another folder")
    if not args.out.parent.is_dir():
        fail(PROG, f"--out {args.out}: no such folder {args.out.parent}")
    return step, shard_bytes


def _require_packages() -> None:
    """One line naming what is missing and the extra that brings it: export (TorchTitan 0.2) or export03 (0.3:
    transformers pinned to a release that accepts huggingface-hub 1.x, as torchtitan 0.3 does)."""
    from ..integration_common.torchtitan_version import installed_generation

    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        extra = "export03" if installed_generation() == "0.3" else "export"
        fail(PROG, f"needs {' and '.join(missing)}: pip install 'titan-nvfp4[{extra}]'")


def _nvfp4_checks(layers, job, step, args) -> torch.dtype:
    """Refusals of --format nvfp4 (one line each); the dtype the weights are quantized in."""
    from ..training.schedule import LINEAR_STEPS
    from .hf_weights import forward_weight_dtype

    if layers.lowrank:
        fail(PROG, f"--format nvfp4: layer {layers.lowrank[0]!r} is low-rank ({job.knob} lora_rank, "
                   f"{len(layers.lowrank)} layers): its forward adds U·diag(σ)·V to NVFP4(R), which compressed-tensors' "
                   "NVFP4 layout cannot hold; export --format bf16 (W = R + U·diag(σ)·V)")
    if layers.split:
        fail(PROG, f"--format nvfp4: layer {layers.split[0]!r} runs its OutControl-selected input channels in MXFP8 "
                   f"beside NVFP4 ({job.knob} outcontrol_fraction, {len(layers.split)} layers), which "
                   "compressed-tensors' NVFP4 layout (one format per layer) cannot hold; export --format bf16")
    if args.scheme == "w4a4":
        fos = [n for n, m in layers.nvfp4.items() if m.recipe.four_over_six]
        if fos:
            fail(PROG, f"--scheme w4a4: layer {fos[0]!r} quantizes its input with block_scale_rule = four_over_six "
                       "(each block's scale max to 6 or 4), which compressed-tensors' NVFP4 activations (max to 6) "
                       "cannot express; export --scheme w4a16")
    if not layers.nvfp4:
        fail(PROG, f"--format nvfp4: the job's model has no NVFP4 layers ({job.converters}): export --format bf16")
    counter = getattr(job.model, LINEAR_STEPS, None)
    switch = counter.schedule.switch_step if counter is not None else None
    if switch is not None:
        fraction = job.bf16_after_fraction
        if step.step is None:
            fail(PROG, f"--format nvfp4: the job switches to BF16 at step {switch} (bf16_after_fraction = {fraction}) "
                       f"and {step.path} is not named step-N: give the step-N folder so its step is known")
        if step.step >= switch:
            fail(PROG, f"--format nvfp4: {step.path} is at step {step.step}, and the run computes in BF16 from step "
                       f"{switch} on (bf16_after_fraction = {fraction}): its forward no longer uses NVFP4 weights; "
                       "export --format bf16")
    if args.weight_dtype != "auto":
        return DTYPES[args.weight_dtype]
    forward, narrower = forward_weight_dtype(layers, job.fsdp, job.mixed_precision_param, job.dtypes)
    if narrower:
        fail(PROG, f"--format nvfp4: {step.path} stores {narrower[0]}.weight in "
                   f"{job.dtypes[narrower[0] + '.weight']}, but the run's forward quantized {forward} weights "
                   "(checkpoint.export_dtype?): its codes cannot be reproduced; pass --weight-dtype bfloat16 to "
                   "quantize the stored weights instead")
    return forward


def input_amaxes(args, job, layers, step) -> tuple[dict[str, torch.Tensor], str]:
    """({NVFP4 layer: input amax}, where it came from) for --scheme w4a4: calibration when asked, else the amax
    history the checkpoint carries; a ValueError when it carries none."""
    from .activation_scales import calibrated_amaxes, history_amaxes

    if args.calibration_batches is not None:
        n = args.calibration_batches
        batches = job.calibration(n)
        return calibrated_amaxes(job.model, layers.nvfp4, batches), f"calibrated on {n} batch{'es' if n > 1 else ''}"
    found = history_amaxes(step.path, list(layers.nvfp4))
    if found is None:
        raise ValueError(f"--scheme w4a4: checkpoint {step.path} carries no activation amax history "
                         f"({job.knob} activation_amax_history = {job.activation_amax_history}): pass "
                         "--calibration-batches N to take the input scales from N batches of the job's dataset")
    return found, "from the run's amax history"


def export(args, rest: list[str], step, shard_bytes: int) -> str:
    """Build, load, convert and write; returns the summary line. ValueErrors are the user's input."""
    from .compressed_nvfp4 import quantization_config
    from .hf_folder import copy_tokenizer, write_json, write_shards
    from .hf_models import HF_MODELS
    from .hf_weights import classify, dense_state, fused_mismatches, hf_dense, hf_nvfp4

    job = _generation().open_job(rest, step.path)
    model = job.model
    layers = classify(model)
    for other in layers.other:
        module = model.get_submodule(other)
        if args.format == "nvfp4":
            raise ValueError(f"--format nvfp4: {other!r} ({type(module).__name__}) holds MoE experts: transformers "
                             "holds them as fused 3-D parameters (gate_up_proj, down_proj), not Linear modules, so "
                             "compressed-tensors' NVFP4 Linear layout cannot describe them; export --format bf16")
        if getattr(module, "lora_rank", 0):
            raise ValueError(f"{other!r} ({type(module).__name__}) holds low-rank experts ([quantize.grouped_mm.nvfp4] "
                             "lora_rank): export_hf does not fold their branch yet")
        if not all(k.startswith(("w1", "w2", "w3")) for k in module.state_dict()):
            raise ValueError(f"module {other!r} ({type(module).__name__}) is not supported by export_hf yet")
    adapter = job.adapter
    state = dense_state(model)
    hf_model = HF_MODELS[job.name]
    config = dict(job.hf_config)
    if args.format == "nvfp4":
        weight_dtype = _nvfp4_checks(layers, job, step, args)
        scheme = args.scheme or "w4a16"
        amaxes, source = input_amaxes(args, job, layers, step) if scheme == "w4a4" else (None, "")
        out = hf_nvfp4(adapter, model, state, layers, weight_dtype, input_amax=amaxes)
        hf_state = out.state
        config["quantization_config"] = quantization_config(out.ignore, activations=amaxes is not None)
        mismatched = fused_mismatches(out.global_scales, out.ignore, hf_model.fused)
        if mismatched:
            print(f"export_hf: warning: vLLM and SGLang load {' / '.join('+'.join(g) for g in hf_model.fused)} as one "
                  f"GEMM each, with one weight global scale: {len(mismatched)} such groups differ here (e.g. "
                  f"{mismatched[0]}); served by them, these layers would not decode to the trained weights "
                  "(docs/export.md, 'Fused layers')", file=sys.stderr)
        inputs = f", input scales {source}" if source else ""
        what = (f"{len(layers.nvfp4)} NVFP4 Linears ({scheme}{inputs}, quantized in "
                f"{str(weight_dtype).removeprefix('torch.')}), "
                f"{len(out.ignore)} BF16 ({', '.join(out.ignore[:3])}{', ...' if len(out.ignore) > 3 else ''})")
    else:
        hf_state = hf_dense(adapter, state)
        what = "BF16" + (f", {len(layers.lowrank)} low-rank layers as W = R + U·diag(σ)·V" if layers.lowrank else "")
    from transformers import GenerationConfig

    with writing(PROG, args.out, "--out"), atomic_dir(args.out, "--out") as tmp:
        shards = write_shards(tmp, hf_state, shard_bytes)
        write_json(tmp / "config.json", config)
        GenerationConfig(bos_token_id=job.bos_id, eos_token_id=job.eos_id).save_pretrained(str(tmp))
        copy_tokenizer(job.assets, tmp)
    at = f"step {step.step}" if step.step is not None else str(step.path)
    return f"export_hf: {at} of {step.path.parent if step.step is not None else step.path} -> {args.out}: {what}; " \
           f"{shards} shard{'s' if shards > 1 else ''}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap, args, rest = _args(argv)
    step, shard_bytes = _check_paths(args, rest)
    _require_packages()
    verified_or_fail(PROG, step.path)
    try:
        print(export(args, rest, step, shard_bytes))
    except ValueError as e:
        fail(PROG, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


if __name__ == "__main__":
    main()
