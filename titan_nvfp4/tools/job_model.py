"""The model a TorchTitan 0.2 job file builds, on the CPU, with the weights of one of its DCP checkpoints.

The job file is parsed by TorchTitan's ConfigManager (with the command line's overrides), the model is built
from its train spec and flavor as the Trainer builds it (meta device, ``update_from_config``) and converted
with the job's converters, so NVFP4 and low-rank layers have the modules, recipes and state-dict keys of the
run. The GEMM backend is set to "reference" (bit-identical to the GPU backends, and the one that runs here).
The checkpoint is a ``step-N`` folder or the checkpoint folder holding them (its latest step is taken).
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .export_job import first_batches, flag_value

STEP = re.compile(r"step-(\d+)")
#: the job's [experimental] custom_import is imported as the Trainer does, except our data preparers (they build
#: corpora, which an export never reads)
DATA_ONLY = "titan_nvfp4.data"


@dataclass
class StepFolder:
    """A DCP checkpoint folder and its step (None when its name is not TorchTitan's ``step-N``)."""

    path: Path
    step: int | None


def steps_in(folder: Path) -> dict[int, Path]:
    """{step: folder} of the ``step-N`` subfolders of ``folder`` holding a DCP checkpoint (a .metadata file)."""
    out = {}
    for p in folder.iterdir() if folder.is_dir() else ():
        m = STEP.fullmatch(p.name)
        if m and (p / ".metadata").is_file():
            out[int(m.group(1))] = p
    return out


def find_step(path: Path) -> StepFolder:
    """The checkpoint ``path`` names: a folder with a .metadata file, or the latest ``step-N`` folder inside it;
    else a ValueError saying what is there."""
    if (path / ".metadata").is_file():
        m = STEP.fullmatch(path.name)
        return StepFolder(path, int(m.group(1)) if m else None)
    if not path.exists():
        siblings = sorted(steps_in(path.parent))
        have = f" (the checkpoint folder {path.parent} holds steps {', '.join(map(str, siblings))})" if siblings else ""
        raise ValueError(f"no such checkpoint: {path}{have}")
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is a file; give a DCP checkpoint folder (step-N) or the folder holding them")
    steps = steps_in(path)
    if not steps:
        raise ValueError(f"{path} holds no DCP checkpoint: no .metadata file and no step-N folder with one")
    last = max(steps)
    return StepFolder(steps[last], last)


def parse_job(overrides: list[str], backend: str | None = "reference"):
    """TorchTitan's JobConfig from ``--job.config_file ...`` and further overrides, with the NVFP4 sections' GEMM
    backend set to ``backend`` ("reference", the CPU's, by default; None: the job's own)."""
    import titan_nvfp4.integration  # noqa: F401  (registers the converters and our flavors)
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(list(overrides))
    if backend is None:
        return cfg
    quantize = getattr(cfg, "quantize", None)
    for section in (getattr(getattr(quantize, "linear", None), "nvfp4", None),
                    getattr(getattr(quantize, "grouped_mm", None), "nvfp4", None)):
        if section is not None:
            section.gemm_backend = backend
    return cfg


def import_custom(cfg) -> None:
    """Import the job's ``[experimental] custom_import`` (it may register the flavor), unless it is one of our data
    preparers."""
    name = cfg.experimental.custom_import
    if name and not (name == DATA_ONLY or name.startswith(DATA_ONLY + ".")):
        importlib.import_module(name)


def one_process_dims():
    """TorchTitan's ParallelDims of one process (the converters' view of an unsharded model)."""
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def build_model(cfg) -> tuple[nn.Module, object, object]:
    """(model on the CPU, uninitialized; its train spec; its model args) as the job builds and converts it."""
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    import_custom(cfg)
    spec = get_train_spec(cfg.model.name)
    if cfg.model.flavor not in spec.model_args:
        raise ValueError(f"model {cfg.model.name!r} has no flavor {cfg.model.flavor!r} (it has "
                         f"{', '.join(sorted(spec.model_args))})")
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    build_model_converters(cfg, one_process_dims()).convert(model)
    model.to_empty(device="cpu")
    with torch.no_grad():  # buffers the checkpoint does not hold (RoPE tables) as the Trainer makes them
        model.init_weights(buffer_device=None)
    return model, spec, args


def _unaliased(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a fresh tensor for each entry sharing storage with an earlier one: an undecomposed low-rank
    layer (a model just materialized) hands out its parameter as both ``weight`` (W) and ``lora_residual`` (R), and
    DCP would load both into it; each gets its own buffer, and load_state_dict then takes R for the parameter."""
    seen, out = set(), {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr() if value.numel() else None
        out[key] = torch.empty_like(value) if ptr is not None and ptr in seen else value
        seen.add(ptr)
    return out


#: the top-level entries of a TorchTitan checkpoint beside the model's flat keys
_NOT_MODEL = ("optimizer", "lr_scheduler", "lr_schedulers", "dataloader", "train_state")
#: the model entries of an NVFP4 layer beside its weight and bias (decomposed_linear.py, outcontrol.py)
_LAYER_STATE = ("lora_", "outcontrol_")


def _plain_view(model: nn.Module, key: str) -> bool:
    """Whether checkpoint entry ``key`` is the NVFP4 state of a layer (low-rank factors, OutControl's selection) that
    ``model`` holds as a plain Linear: its ``weight`` entry is the W a BF16 Linear multiplies, the rest is not needed.
    Into an NVFP4 layer the same entries would be dropped silently: those are refused."""
    module, _, leaf = key.rpartition(".")
    if not leaf.startswith(_LAYER_STATE):
        return False
    try:
        return type(model.get_submodule(module)) is nn.Linear
    except AttributeError:
        return False


@dataclass
class Loaded:
    """What the checkpoint told about its weights: the dtype each model key is stored in, and whether the run
    sharded its norm weights (FSDP2: the forward computed with mixed_precision_param weights)."""

    dtypes: dict[str, torch.dtype]
    fsdp: bool


def load_weights(model: nn.Module, folder: Path) -> Loaded:
    """Load the model's entries of the DCP checkpoint ``folder`` into ``model`` (ValueErrors name a missing key or a
    shape that differs from the job's model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = _unaliased(model.state_dict())
    missing = [k for k in state if k not in saved]
    if missing:
        raise ValueError(f"checkpoint {folder} has no {missing[0]!r}, which the job file's model has"
                         + (f" ({len(missing) - 1} more keys missing)" if len(missing) > 1 else "")
                         + ": was it written by another job file (model flavor, converters, lora_rank)?")
    extra = [k for k in saved if k.split(".", 1)[0] not in _NOT_MODEL and k not in state and not _plain_view(model, k)]
    if extra:
        raise ValueError(f"checkpoint {folder} has {extra[0]!r}, which the job file's model lacks"
                         + (f" ({len(extra) - 1} more such keys)" if len(extra) > 1 else "")
                         + ": was it written by another job file (model flavor, converters, lora_rank, "
                         "outcontrol_fraction)?")
    for key, value in state.items():
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise ValueError(f"checkpoint {folder} stores {key!r} with shape {tuple(size)}, the job file's model has "
                             f"{tuple(value.shape)}: was it written by another job file (model flavor)?")
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as e:  # DCP wraps a rank's failure in its CheckpointException
        failures = getattr(e, "failures", None)
        inner = next(iter(failures.values()), e) if isinstance(failures, dict) and failures else e
        inner = inner[0] if isinstance(inner, tuple) else inner
        text = str(inner).strip().splitlines()
        raise ValueError(f"cannot read checkpoint {folder}: {type(inner).__name__}"
                         + (f": {text[0]}" if text else "")) from None
    model.load_state_dict(state)
    dtypes = {k: saved[k].properties.dtype for k in state if hasattr(saved[k], "properties")}
    norms = [k for k in state if k.endswith("norm.weight") and hasattr(saved[k], "chunks")]
    return Loaded(dtypes, any(len(saved[k].chunks) > 1 for k in norms))


def load_layer_state(model: nn.Module, folder: Path, step: int | None) -> tuple[int | None, list[str]]:
    """Restore what the DCP checkpoint ``folder``'s train_state carries for the NVFP4 layers beside the weights (their
    activation amax windows, OsciReset margins, SR call counts) and set the converters' step counters to its step, as
    a resumed run's Trainer does (training/train_state.load_state_of_layers): the forward then quantizes X with the
    run's windows and follows its bf16_after_fraction switch. ``step``: the folder's, for a checkpoint without a
    train_state step. Returns (the step used, the train_state sections the model wanted and the checkpoint lacks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from ..training.train_state import load_state_of_layers, state_of_layers

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    wanted = state_of_layers([model])
    flat = {f"train_state.{section}.{fqn}": value for section, entries in wanted.items()
            for fqn, value in entries.items() if f"train_state.{section}.{fqn}" in saved}
    if "train_state.step" in saved:
        flat["train_state.step"] = 0
    if flat:
        dcp.load(flat, checkpoint_id=str(folder))
    if "train_state.step" in flat:
        step = int(flat.pop("train_state.step"))
    state = {section: {fqn: flat[f"train_state.{section}.{fqn}"] for fqn in entries
                       if f"train_state.{section}.{fqn}" in flat} for section, entries in wanted.items()}
    load_state_of_layers([model], {k: v for k, v in state.items() if v}, step or 0)
    return step, [section for section, entries in state.items() if not entries]


def calibration_batches(cfg, spec, tokenizer, count: int) -> Iterator[torch.Tensor]:
    """The token ids of the first ``count`` batches of the job's dataloader (one process: rank 0 of 1), as the
    Trainer builds it from the train spec; the job's [experimental] custom_import is imported in full first (a
    data preparer registers, or builds, the run's dataset). A ValueError naming the dataset when it cannot be read."""
    name, path = cfg.training.dataset, cfg.training.dataset_path

    def build():
        if cfg.experimental.custom_import:
            importlib.import_module(cfg.experimental.custom_import)
        if spec.build_dataloader_fn is None:
            raise ValueError(f"model {cfg.model.name!r} has no dataloader in its train spec")
        return spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=cfg)

    return first_batches(build, f"the job's dataset {name!r}" + (f" ({path})" if path else ""), count)


def check_flags(rest: list[str]) -> str | None:
    """What is wrong with the job flags export_hf passes on (None: nothing): the job file must be named and exist."""
    job = flag_value(rest, "--job.config_file")
    if job is None:
        return "--job.config_file JOB.toml is required: the job file the checkpoint was trained with"
    if not job or not Path(job).is_file():
        return f"--job.config_file {job}: no such file"
    return None


def open_job(overrides: list[str], folder: Path):
    """export_hf's Job (export_job.py) of a 0.2 job file (``--job.config_file JOB.toml`` and further overrides) and
    the DCP checkpoint ``folder``; ValueErrors name the model, flavor, tokenizer folder or key at fault."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.protocols.train_spec import get_train_spec

    from .export_job import Job
    from .hf_folder import tokenizer_files
    from .hf_models import HF_MODELS

    cfg = parse_job(overrides)
    import_custom(cfg)
    name = cfg.model.name
    try:
        spec = get_train_spec(name)
    except ValueError as e:
        raise ValueError(f"[model] name {name!r}: {e}") from None
    if spec.state_dict_adapter is None:
        raise ValueError(f"model {name!r} has no state-dict adapter in TorchTitan: its weights have no Hugging Face "
                         "names to export to")
    if name not in HF_MODELS:
        raise ValueError(f"model {name!r} is not supported by export_hf yet (supported: {', '.join(HF_MODELS)})")
    assets = Path(cfg.model.hf_assets_path)
    tokenizer_files(assets)  # a ValueError naming the folder when it has no tokenizer
    tokenizer = HuggingFaceTokenizer(str(assets))
    model, spec, model_args = build_model(cfg)
    loaded = load_weights(model, folder)
    section = cfg.quantize.linear.nvfp4
    return Job(
        name=name, model=model, adapter=spec.state_dict_adapter(model_args, None),  # names only: no HF index
        hf_config=HF_MODELS[name].config(model_args, model, tokenizer.bos_id, tokenizer.eos_id), assets=assets,
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, fsdp=loaded.fsdp, dtypes=loaded.dtypes,
        mixed_precision_param=cfg.training.mixed_precision_param,
        converters=f"[model] converters = {list(cfg.model.converters)}",
        bf16_after_fraction=section.switch()[0], activation_amax_history=section.activation_amax_history,
        knob="[quantize.linear.nvfp4]", calibration=lambda n: calibration_batches(cfg, spec, tokenizer, n))


__all__ = ["DATA_ONLY", "Loaded", "StepFolder", "build_model", "calibration_batches", "find_step", "import_custom",
           "check_flags", "load_layer_state", "load_weights", "one_process_dims", "open_job", "parse_job", "steps_in"]
