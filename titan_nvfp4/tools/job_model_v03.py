"""The model a TorchTitan 0.3 config builds, on the CPU, with the weights of one of its DCP checkpoints: export_hf's
Job (export_job.py) for 0.3 runs.

A 0.3 run is named by its config registry entry, ``--module MODULE --config NAME`` (e.g.
``--module titan_nvfp4.integration_v03.configs --config llama3_debug_nvfp4``) and its overrides, as for
``torchtitan.train``. The config is parsed by TorchTitan's ConfigManager, its ``quantize`` sections are applied to
the model config tree as NVFP4Trainer does (GEMM backend "reference"), the model is built on meta, materialized and
initialized, and the checkpoint's model entries (TorchTitan's state-dict keys: a fused QKV Linear saves wq, wk and
wv) are loaded into it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import torch

from .export_job import first_batches, flag_value
from .job_model import load_weights


def check_flags(rest: list[str]) -> str | None:
    """What is wrong with the flags export_hf passes on (None: nothing): 0.3 names its run by --module and --config."""
    module, name = flag_value(rest, "--module"), flag_value(rest, "--config")
    if module is None or name is None:
        return ("--module MODULE --config NAME are required (TorchTitan 0.3): the config registry entry the "
                "checkpoint was trained with, e.g. --module titan_nvfp4.integration_v03.configs --config "
                "llama3_debug_nvfp4")
    try:
        registry = importlib.import_module(module)
    except ImportError as e:
        return f"--module {module}: cannot import it ({e})"
    if not callable(getattr(registry, name, None)):
        return f"--config {name}: {module} has no such config"
    return None


def parse_config(overrides: list[str]):
    """TorchTitan's config of the registry entry with its overrides, the quantize sections applied to the model
    config tree with the "reference" GEMM backend (the CPU's)."""
    from torchtitan.config import ConfigManager

    from ..integration_v03.trainer import apply_quantize

    config = ConfigManager().parse_args(list(overrides))
    quantize = getattr(config, "quantize", None)
    for section in (getattr(quantize, "linear", None), getattr(quantize, "grouped_mm", None)):
        if section is not None:
            section.gemm_backend = "reference"
    if quantize is not None:
        apply_quantize(config)
    return config


def calibration_batches(config, tokenizer, count: int) -> Iterator[torch.Tensor]:
    """The token ids of the first ``count`` batches of the config's dataloader (one process), as the Trainer builds
    it; a ValueError naming the dataset when it cannot be read."""
    loader_config = config.dataloader

    def build():
        from ..integration_v03.trainer import prepare_offline_data

        prepare_offline_data(config)
        return loader_config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=config.training.seq_len,
                                   local_batch_size=config.training.local_batch_size, snapshot_every_n_steps=None)

    return first_batches(build, f"the config's dataset {getattr(loader_config, 'dataset', '?')!r}", count)


def open_job(overrides: list[str], folder: Path):
    """export_hf's Job of a 0.3 config registry entry and the DCP checkpoint ``folder``."""
    from torchtitan.tools import utils as tt_utils
    from torchtitan.config import TORCH_DTYPE_MAP

    from .export_job import Job
    from .hf_folder import tokenizer_files
    from .hf_models import HF_CONFIGS_V03

    config = parse_config(overrides)
    spec = config.model_spec
    if spec is None:
        raise ValueError("the config has no model_spec: not a model's training config")
    name = spec.name
    if spec.state_dict_adapter is None:
        raise ValueError(f"model {name!r} has no state-dict adapter in TorchTitan: its weights have no Hugging Face "
                         "names to export to")
    if name not in HF_CONFIGS_V03:
        raise ValueError(f"model {name!r} is not supported by export_hf for TorchTitan 0.3 yet (supported: "
                         f"{', '.join(HF_CONFIGS_V03)})")
    assets = Path(config.hf_assets_path)
    tokenizer_files(assets)  # a ValueError naming the folder when it has no tokenizer
    tokenizer = config.tokenizer.build(tokenizer_path=str(assets))
    mc = spec.model
    mc.update_from_config(config=config)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = mc.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    loaded = load_weights(model, folder)
    quantize = getattr(config, "quantize", None)
    section = quantize.linear if quantize is not None else None
    sections = [] if quantize is None else [n for n, s in (("quantize.linear", quantize.linear),
                                                          ("quantize.grouped_mm", quantize.grouped_mm)) if s.enable]
    return Job(
        name=name, model=model, adapter=spec.state_dict_adapter(mc, None),  # names only: no HF index
        hf_config=HF_CONFIGS_V03[name](mc, model, tokenizer.bos_id, tokenizer.eos_id), assets=assets,
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, fsdp=loaded.fsdp, dtypes=loaded.dtypes,
        mixed_precision_param=config.training.mixed_precision_param,
        converters=f"enabled quantize sections: {sections}",
        bf16_after_fraction=section.switch()[0] if section is not None else None,
        activation_amax_history=section.activation_amax_history if section is not None else 0,
        knob="--quantize.linear", calibration=lambda n: calibration_batches(config, tokenizer, n))


__all__ = ["calibration_batches", "check_flags", "open_job", "parse_config"]
