"""TorchTitan integration: converter registration, the [quantize.linear.nvfp4] job-config section,
and converting / materializing / training-stepping the Llama3 debug model on CPU."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import titan_nvfp4.integration  # noqa: F401  (registers the converter)
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, available_presets
from titan_nvfp4.integration.job_config import DEFAULT_FILTER_FQNS
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import _registry_model_converter_cls, build_model_converters

from job_helpers import ROOT, edited_toml, meta_llama, parse, world1

NAME = "quantize.linear.nvfp4"
RANKING_SPEC = "configs/compare/recipe_ranking_386m.toml"  # pins a corpus
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


#: what the job file sets beyond its preset: the debug model's eager runs graph its small Linears
JOB_FILE_FIELDS = {"eager_graphs": "small"}


def job_recipe(preset: str, **fields) -> NVFP4Recipe:
    """The recipe the job file builds with ``recipe = preset`` and ``fields`` set in its section."""
    return dataclasses.replace(preset_from_file(preset), **{**JOB_FILE_FIELDS, **fields})


def preset_from_file(name: str) -> NVFP4Recipe:
    """A preset read straight from configs/ (not through titan_nvfp4.recipe.nvfp4_recipe.load_preset)."""
    with open(ROOT / "configs" / f"{name}.toml", "rb") as f:
        data = tomllib.load(f)
    data.pop("description", None)
    return NVFP4Recipe(**data)


@pytest.fixture(scope="module")
def job_cfg():
    return parse()


# ------------------------------------------------------------------------------ 1. registration

@pytest.mark.long
def test_import_registers_converter_once_and_the_flavors():
    from titan_nvfp4.integration.flavors import BENCH_FLAVOR

    assert _registry_model_converter_cls[NAME].__name__ == "NVFP4LinearConverter"
    # In a fresh interpreter: `import titan_nvfp4` imports no torch, its tools no TorchTitan (they start fast; the
    # comparison runner reads a spec that pins a corpus without torch), and the public names load on use; the
    # converter and our llama3 flavor are absent before `import titan_nvfp4.integration` and present after (the
    # flavor through what TorchTitan's job-config parsing imports), and importing or re-executing the modules again
    # does not trip TorchTitan's "already registered" assertion.
    code = "\n".join([
        "import importlib, sys",
        "import titan_nvfp4",
        "assert 'torch' not in sys.modules, sorted(sys.modules)",
        "import titan_nvfp4.compare, titan_nvfp4.tools.loss_log",
        "from pathlib import Path",
        f"spec = titan_nvfp4.compare.load_spec(Path({str(ROOT / RANKING_SPEC)!r}))",
        "assert spec.corpus and 'torch' not in sys.modules, sorted(sys.modules)",  # a corpus pin read without torch
        "assert 'torchtitan' not in sys.modules, sorted(sys.modules)",
        "assert titan_nvfp4.NVFP4Linear.__name__ == 'NVFP4Linear' and 'torch' in sys.modules",
        "from titan_nvfp4 import convert",
        "from torchtitan.models.llama3 import llama3_args",
        "from torchtitan.protocols.model_converter import _registry_model_converter_cls as reg",
        "from torchtitan.protocols.train_spec import get_train_spec",
        f"assert {NAME!r} not in reg and {BENCH_FLAVOR!r} not in llama3_args",
        "import titan_nvfp4.integration",
        f"cls = reg[{NAME!r}]",
        "import titan_nvfp4, titan_nvfp4.integration.job_config",
        f"print(get_train_spec('llama3').model_args[{BENCH_FLAVOR!r}].dim)",
        "importlib.reload(titan_nvfp4.integration.converter)",
        "importlib.reload(titan_nvfp4.integration.job_config)",
        f"assert reg[{NAME!r}] is cls",
        "print('ok')",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["2048", "ok"], out.stderr[-2000:]


# --------------------------------------------------------------------------- 2. parsing the job file

def test_job_file_parses_to_paper_recipe(job_cfg):
    sec = job_cfg.quantize.linear.nvfp4
    assert sec.recipe == "nvidia_paper" and sec.filter_fqns == ["output"]
    assert NAME in job_cfg.model.converters
    recipe = sec.build_recipe()
    assert recipe == job_recipe("nvidia_paper") and recipe.eager_graphs == "small"
    assert (recipe.weight_2d, recipe.stochastic_rounding, recipe.rht) == (True, True, True)
    assert (recipe.bf16_first_blocks, recipe.bf16_last_blocks) == (0, 0)


def test_cli_override_wins():
    r = parse("--quantize.linear.nvfp4.rht", "False").quantize.linear.nvfp4.build_recipe()
    assert r == job_recipe("nvidia_paper", rht=False)


def test_toml_override_wins_over_preset_and_cli_over_toml(tmp_path):
    path = edited_toml(tmp_path, {"weight_2d": "false"})
    r = parse(toml=path).quantize.linear.nvfp4.build_recipe()
    assert r == job_recipe("nvidia_paper", weight_2d=False)
    r = parse("--quantize.linear.nvfp4.weight_2d", "True", toml=path).quantize.linear.nvfp4.build_recipe()
    assert r.weight_2d is True


def test_other_preset_with_override(tmp_path):
    path = edited_toml(tmp_path, {"recipe": '"naive_rtn"', "rht": "true"})
    r = parse(toml=path).quantize.linear.nvfp4.build_recipe()
    assert r == job_recipe("naive_rtn", rht=True)
    assert r.weight_2d is False and r.stochastic_rounding is False


# ------------------------------------------------------------------------- 3. bad input at parse time

@pytest.mark.parametrize("replace,add,needles", [
    ({}, ("weight2d = true",), ["weight2d"]),
    ({"rht": '"yes"'}, (), ["rht", "yes"]),
    ({"stochastic_rounding": '"false"'}, (), ["stochastic_rounding", "false"]),
    ({"bf16_first_blocks": "-1"}, (), ["bf16_first_blocks", "-1"]),
    ({"bf16_last_blocks": "true"}, (), ["bf16_last_blocks", "True"]),
    ({"recipe": '"nvidia_papr"'}, (), ["nvidia_papr", *available_presets()]),
    ({"gemm_backend": '"cutlass"'}, (), ["gemm_backend", "cutlass"]),
    ({"filter_fqns": '["output", 3]'}, (), ["filter_fqns", "3"]),
    ({"filter_fqns": '"output"'}, (), ["filter_fqns", "output"]),
    ({}, ("fsdp_nvfp4_all_gather = 1",), ["fsdp_nvfp4_all_gather", "1"]),
    ({}, ("fsdp_nvfp4_all_gather = true", "weight_2d = false"), ["fsdp_nvfp4_all_gather", "weight_2d"]),
    ({}, ("fsdp_nvfp4_all_gather = true", "bf16_after_fraction = 0.2"), ["fsdp_nvfp4_all_gather", "bf16_after_fraction"]),
], ids=["misspelt_key", "bool_as_string", "bool_as_string_false", "negative_blocks", "bool_for_int", "unknown_recipe",
        "unknown_backend", "filter_not_strings", "filter_not_list", "all_gather_not_bool", "all_gather_1x16",
        "all_gather_late_bf16"])
def test_bad_values_fail_at_parse_time(tmp_path, replace, add, needles):
    path = edited_toml(tmp_path, replace, add)
    with pytest.raises(ValueError) as e:
        parse(toml=path)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"


def test_fsdp_nvfp4_all_gather_wraps_under_fsdp_with_or_without_tensor_parallelism(tmp_path):
    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight

    cfg = parse(toml=edited_toml(tmp_path, add=("fsdp_nvfp4_all_gather = true",)))
    dims = {n: ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=dp * tp)
            for n, dp, tp in (("one", 1, 1), ("fsdp", 2, 1), ("tp", 2, 2))}
    for name, wrapped in (("one", False), ("fsdp", True), ("tp", True)):  # FSDP2 x TP: test_tensor_parallel.py
        model = meta_llama(cfg)
        build_model_converters(cfg, dims[name]).convert(model)
        assert isinstance(model.layers["0"].attention.wq.weight, NVFP4ShardedWeight) == wrapped, name
        assert not isinstance(model.output.weight, NVFP4ShardedWeight)  # filtered: stays BF16, gathers as BF16


def test_available_presets_listed():
    assert {"nvidia_paper", "naive_rtn", "nvidia_paper_selective"} <= set(available_presets())


# ---------------------------------------------------------------------- 4. converting Llama3 debugmodel

def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_convert_llama_debugmodel_on_meta_and_train_step(job_cfg, caplog):
    caplog.set_level(logging.INFO)
    ref = meta_llama(job_cfg)
    model = meta_llama(job_cfg)
    params_before = {n: p for n, p in model.named_parameters()}
    build_model_converters(job_cfg, world1()).convert(model)

    expected = {f"layers.{i}.{s}" for i in range(6) for s in BLOCK_LINEARS}
    lin = _linears(model)
    converted = {n for n, m in lin.items() if isinstance(m, NVFP4Linear)}
    assert converted == expected and len(converted) == 42
    assert type(model.output) is nn.Linear
    assert all(m.recipe == job_cfg.quantize.linear.nvfp4.build_recipe() for n, m in lin.items() if n in converted)
    assert len({lin[n].layer_id for n in converted}) == 42, "SR streams must differ per layer"
    # nothing allocated: the very same meta Parameters
    assert all(p.is_meta for p in model.parameters())
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == list(ref.state_dict())
    # logs: the count and every skipped fqn with its reason
    text = caplog.text
    assert re.search(r"NVFP4: converted 42 Linear layers", text), text
    assert re.search(r"kept output in high precision \(filter_fqns \['output'\]\)", text), text

    # materialize as TorchTitan does, then one training step on CPU
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 65), generator=g)
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(inp)
    assert logits.shape == (2, 64, 2048)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert 5.0 < loss.item() < 12.0  # about log(2048) = 7.6 at init
    for n in expected:
        w = model.get_submodule(n).weight
        assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0, n

    # an unconverted (BF16-path) checkpoint loads strictly and gives nearly the same logits
    plain = meta_llama(job_cfg)
    plain.to_empty(device="cpu")
    with torch.no_grad():
        plain.init_weights(buffer_device=None)
    model.load_state_dict(plain.state_dict(), strict=True)
    assert torch.equal(model.layers["2"].attention.wq.weight, plain.layers["2"].attention.wq.weight)
    with torch.no_grad():
        a, b = model(inp), plain(inp)
    err = ((a - b).norm() / b.norm()).item()
    assert 1e-4 < err < 0.3, err  # quantized, but the same function


def test_selective_blocks(caplog):
    caplog.set_level(logging.INFO)
    cfg = parse("--quantize.linear.nvfp4.bf16_first_blocks", "1", "--quantize.linear.nvfp4.bf16_last_blocks", "2")
    model = meta_llama(cfg)
    conv = _registry_model_converter_cls[NAME](cfg, world1())
    conv.convert(model)
    lin = _linears(model)
    converted = {n for n, m in lin.items() if isinstance(m, NVFP4Linear)}
    assert converted == {f"layers.{i}.{s}" for i in (1, 2, 3) for s in BLOCK_LINEARS}
    for i in (0, 4, 5):
        assert all(type(model.get_submodule(f"layers.{i}.{s}")) is nn.Linear for s in BLOCK_LINEARS)
    assert "NVFP4: converted 21 Linear layers" in caplog.text
    for s in BLOCK_LINEARS:
        assert f"kept layers.0.{s} in high precision (block 0 < bf16_first_blocks=1)" in caplog.text
        for i in (4, 5):
            assert f"kept layers.{i}.{s} in high precision (block {i} in the last bf16_last_blocks=2)" in caplog.text
    assert all(p.is_meta for p in model.parameters())


def test_missing_section_falls_back_to_default_recipe(tmp_path, caplog):
    """A job file without custom_config_module: the converter warns and uses the paper recipe."""
    caplog.set_level(logging.INFO)
    text = (ROOT / "train_configs" / "llama3_bf16.toml").read_text()
    line = re.compile(r"^custom_config_module\s*=.*$", re.M)
    assert len(line.findall(text)) == 1
    path = tmp_path / "bf16_no_section.toml"
    path.write_text(line.sub("", text))
    cfg = parse("--model.converters", NAME, toml=path)
    assert getattr(cfg.quantize.linear, "nvfp4", None) is None
    conv = _registry_model_converter_cls[NAME](cfg, world1())
    assert "custom_config_module" in caplog.text
    assert conv.recipe == preset_from_file("nvidia_paper") and conv.filter_fqns == list(DEFAULT_FILTER_FQNS)


# -------------------------------------------------------------------- 5. bad dims inside a block

class _Block(nn.Module):
    def __init__(self, odd: bool):
        super().__init__()
        self.ok = nn.Linear(32, 32, bias=False)
        self.proj = nn.Linear(20 if odd else 32, 32, bias=False)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(odd=True), "1": _Block(odd=False)})
        self.output = nn.Linear(32, 48, bias=False)


def test_bad_dim_linear_fails_or_is_filtered(caplog):
    caplog.set_level(logging.INFO)
    with torch.device("meta"):
        tiny = _Tiny()
    conv = _registry_model_converter_cls[NAME](parse(), world1())
    with pytest.raises(ValueError) as e:
        conv.convert(tiny)
    assert "layers.0.proj" in str(e.value) and "in_features=20" in str(e.value)

    cfg = parse("--quantize.linear.nvfp4.filter_fqns", "output,layers.0.proj")
    with torch.device("meta"):
        tiny = _Tiny()
    caplog.clear()
    _registry_model_converter_cls[NAME](cfg, world1()).convert(tiny)
    assert type(tiny.layers["0"].proj) is nn.Linear and type(tiny.output) is nn.Linear
    assert {n for n, m in tiny.named_modules() if isinstance(m, NVFP4Linear)} == {
        "layers.0.ok", "layers.1.ok", "layers.1.proj"}
    assert "NVFP4: converted 3 Linear layers" in caplog.text
    assert "kept layers.0.proj in high precision (filter_fqns ['layers.0.proj'])" in caplog.text
    assert "kept output in high precision (filter_fqns ['output'])" in caplog.text


def test_converting_twice_is_a_no_op(job_cfg):
    model = meta_llama(job_cfg)
    conv = _registry_model_converter_cls[NAME](job_cfg, world1())
    conv.convert(model)
    mods = {n: m for n, m in model.named_modules()}
    conv.convert(model)
    assert all(m is mods[n] for n, m in model.named_modules())


@pytest.mark.parametrize("converters", ["quantize.linear.nvfp4,quantize.linear.nvfp4",
                                        "quantize.linear.nvfp4,quantize.grouped_mm.nvfp4,quantize.grouped_mm.nvfp4"])
def test_a_converter_listed_twice_is_refused_by_name(converters):
    cfg = parse("--model.converters", converters)
    name = converters.split(",")[-1]
    with pytest.raises(ValueError, match=rf"converters lists '{re.escape(name)}' 2 times"):
        build_model_converters(cfg, world1())
