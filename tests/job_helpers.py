"""The TorchTitan job the integration tests start from: the real job file (train_configs/llama3_nvfp4.toml) parsed
with CLI overrides or with its [quantize.linear.nvfp4] section edited, a one-process world, and the Llama3 debug
model on meta, converted by the job's converters (``llama_model``)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import titan_nvfp4.integration  # noqa: F401  (registers the converter)
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import Transformer, llama3_args

ROOT = Path(__file__).resolve().parents[1]
JOB_TOML = ROOT / "train_configs" / "llama3_nvfp4.toml"
SECTION = "[quantize.linear.nvfp4]"


def parse(*cli: str, toml: Path = JOB_TOML):
    return ConfigManager().parse_args(["--job.config_file", str(toml), *cli])


def edited_toml(tmp_path: Path, replace: dict[str, str] | None = None, add: tuple[str, ...] = ()) -> Path:
    """A copy of the real job file whose [quantize.linear.nvfp4] section has ``key = value`` set
    (replacing the existing or commented-out line, so no key appears twice) plus extra lines."""
    text = JOB_TOML.read_text()
    head, sep, section = text.partition(SECTION)
    assert sep, "the job file lost its [quantize.linear.nvfp4] section"
    assert "\n[" not in section, "the section is expected to be the last one of the file"
    for key, value in (replace or {}).items():
        pat = re.compile(rf"^#?[ \t]*{re.escape(key)}[ \t]*=.*$", re.M)
        assert len(pat.findall(section)) == 1, f"{key} not exactly once in the section"
        section = pat.sub(f"{key} = {value}", section)
    section = section.rstrip("\n") + "\n" + "".join(f"{line}\n" for line in add)
    path = tmp_path / "job.toml"
    path.write_text(head + sep + section)
    tomllib.loads(path.read_text())  # still valid TOML, no duplicate keys
    return path


def toml_error(tmp_path: Path, *lines: str, grouped: bool = False) -> str:
    """The error of parsing the real job file with ``lines`` added to its [quantize.linear.nvfp4] section, or with
    ``grouped`` to a [quantize.grouped_mm.nvfp4] section appended after it."""
    if grouped:
        toml = tmp_path / "job.toml"
        toml.write_text(JOB_TOML.read_text() + "\n[quantize.grouped_mm.nvfp4]\n" + "".join(f"{x}\n" for x in lines))
    else:
        toml = edited_toml(tmp_path, add=lines)
    with pytest.raises(ValueError) as e:
        parse(toml=toml)
    return str(e.value)


def world1() -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def meta_llama(cfg=None) -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel"])
    if cfg is not None:
        args.update_from_config(cfg)  # as TorchTitan's trainer does (max_seq_len = training.seq_len)
    with torch.device("meta"):
        return Transformer(args)


def initialized(model, cfg):
    """``model`` (on meta) converted by the job's converters, materialized on the CPU and initialized from seed 0, as
    TorchTitan's trainer does; returns (model, converters)."""
    from torchtitan.protocols.model_converter import build_model_converters

    converters = build_model_converters(cfg, world1())
    converters.convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, converters


def llama_model(tmp_path, *add, steps: int = 4):
    cfg = parse("--training.steps", str(steps), toml=edited_toml(tmp_path, add=add))
    return initialized(meta_llama(cfg), cfg)
