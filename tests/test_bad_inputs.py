"""Bad input at the public entry points: each case is a clear error naming the key, layer, value or file.

One row per case: what is called, the exception it must raise and a pattern its message must match (CASES),
or the tool, its arguments and the one error line it must print (TOOL_CASES).
The table in docs/configuration.md ("Errors") lists the same cases for users.
"""

from __future__ import annotations

import importlib
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_nvfp4 import (DecomposedLinear, NVFP4Linear, NVFP4Recipe, nvfp4_grouped_mm, nvfp4_linear, quantize_mxfp8,
                         quantize_nvfp4, rht, rht_signs)
from titan_nvfp4.compare import check_arm_args, load_spec
from titan_nvfp4.ops import nvfp4_gemm
from titan_nvfp4.ops.backends import resolve_backend
from titan_nvfp4.recipe.nvfp4_recipe import build_recipe, load_preset
from job_helpers import edited_toml, meta_llama, parse, world1

ROOT = Path(__file__).resolve().parents[1]
X = torch.randn(4, 32)
REF = NVFP4Recipe(gemm_backend="reference")
L = "--quantize.linear.nvfp4."


def _linear(x: torch.Tensor):
    layer = NVFP4Linear(32, 16, recipe=NVFP4Recipe(gemm_backend="reference"), name="layers.0.attention.wq")
    return layer(x)


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return str(path)


def _convert(*cli: str):
    from torchtitan.protocols.model_converter import build_model_converters

    return build_model_converters(parse(*cli), world1())


def _convert_llama(*cli: str):
    """Build the converters of the job file plus ``cli`` and convert the Llama3 debug model (6 blocks) on meta."""
    cfg = parse(*cli)
    _convert(*cli).convert(meta_llama(cfg))


def _file(tmp_path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return str(path)


SPEC = '[compare]\nbase = "train_configs/llama3_nvfp4.toml"\nsteps = 10\n'
TWO_ARMS = '[[arm]]\nname = "a"\n[[arm]]\nname = "b"\n'


def _spec(tmp_path, text: str | bytes):
    return load_spec(Path(_file(tmp_path, "spec.toml", text)))


def _arm_flags(tmp_path, overrides: str):
    """A spec whose arm "a" has ``overrides`` (TOML list), checked with TorchTitan as its run would parse it."""
    spec = _spec(tmp_path, SPEC + f'[[arm]]\nname = "a"\noverrides = {overrides}\n[[arm]]\nname = "b"\n')
    check_arm_args(spec, "spec.toml", spec.arms[:1])


CASES = {
    # numerics API
    "amax=0 with non-zero x": (lambda tmp: quantize_nvfp4(X, amax=0.0), ValueError, r"amax = 0 but x has non-zero"),
    "amax of shape (2,)": (lambda tmp: quantize_nvfp4(X, amax=torch.ones(2)), ValueError, r"got shape \(2,\)"),
    "amax on the meta device": (lambda tmp: quantize_nvfp4(X, amax=torch.ones((), device="meta")), ValueError,
                                r"meta device"),
    "negative amax": (lambda tmp: quantize_nvfp4(X, amax=-1.0), ValueError, r"non-negative, got -1.0"),
    "float64 beyond float32's range": (
        lambda tmp: quantize_nvfp4(torch.tensor([[1e39] + [0.0] * 15], dtype=torch.float64)), ValueError,
        r"beyond float32's range \(max \|x\| = 1e\+39\)"),
    # modules
    "wrong in_features": (lambda tmp: _linear(torch.randn(4, 24)), RuntimeError,
                          r"layers\.0\.attention\.wq: input of shape \(4, 24\) has 24 features, .*in_features=32"),
    "dims not multiples of 16": (lambda tmp: NVFP4Linear(24, 16, name="mlp.w1"), ValueError, r"'mlp\.w1'.*multiple of 16"),
    # backends
    "cuda backend without a GPU": (lambda tmp: resolve_backend("auto", torch.device("cuda")), RuntimeError,
                                   r"gemm_backend 'auto' on device cuda: torch .* (CPU-only build|finds no GPU)"),
    "emulated on cuda without a GPU": (lambda tmp: resolve_backend("emulated", torch.device("cuda")), RuntimeError,
                                       r"gemm_backend 'emulated' on device cuda"),
    # recipes
    "seed beyond int64": (lambda tmp: NVFP4Recipe(sr_seed=2**70), ValueError, r"sr_seed must be below 2\*\*63"),
    "recipe file with a TOML syntax error": (lambda tmp: load_preset(_toml(tmp, "rht = [\n")), ValueError,
                                             r"recipe file .*recipe\.toml: invalid TOML"),
    "unknown preset": (lambda tmp: build_recipe("nvidia_papr", {}), ValueError, r"unknown recipe 'nvidia_papr'"),
    # the TOML section, parsed by TorchTitan
    "empty recipe": (lambda tmp: parse(toml=edited_toml(tmp, {"recipe": '""'})), ValueError,
                     r"\[quantize\.linear\.nvfp4\] recipe must be a preset name or a path"),
    "rht_seed beyond int64": (lambda tmp: parse(toml=edited_toml(tmp, add=(f"rht_seed = {2**64}",))), ValueError,
                              r"rht_seed must be below 2\*\*63"),
    # converters
    "native backend on a machine without FP4 tensor cores": (
        lambda tmp: _convert("--quantize.linear.nvfp4.gemm_backend", "native"), ValueError,
        r"\[quantize\.linear\.nvfp4\] gemm_backend = 'native' cannot run here"),
    "a converter listed twice": (
        lambda tmp: _convert("--model.converters", "quantize.linear.nvfp4,quantize.linear.nvfp4"), ValueError,
        r"converters lists 'quantize\.linear\.nvfp4' 2 times"),
    "bf16 blocks covering the whole model": (lambda tmp: _convert_llama(L + "recipe", "nvidia_paper_selective"),
                                             ValueError, r"bf16_first_blocks = 2 and bf16_last_blocks = 8 keep all 6"),
    "filter_fqns keeping every Linear": (lambda tmp: _convert_llama(L + "filter_fqns", "layers,output"), ValueError,
                                         r"\[quantize\.linear\.nvfp4\] converted no Linear layer"),
    "grouped-experts converter on a dense model": (
        lambda tmp: _convert_llama("--model.converters", "quantize.grouped_mm.nvfp4"), ValueError,
        r"quantize\.grouped_mm\.nvfp4: no routed-expert module matched fqns \['experts'\]"),
    "lora_rank larger than a Linear": (lambda tmp: _convert_llama(L + "lora_rank", "4096"), ValueError,
                                       r"^\[quantize\.linear\.nvfp4\] lora_rank 4096 does not fit Linear 'layers\.0\.attention\.wq' \(256x256\)"),
    # quantize_nvfp4 / quantize_mxfp8 and the quantized tensors
    "int tensor": (lambda tmp: quantize_nvfp4(torch.ones(4, 32, dtype=torch.int32)), TypeError,
                   r"needs a floating-point tensor, got torch\.int32"),
    "bool tensor": (lambda tmp: quantize_nvfp4(torch.ones(4, 32, dtype=torch.bool)), TypeError, r"got torch\.bool"),
    "complex tensor": (lambda tmp: quantize_nvfp4(torch.ones(4, 32, dtype=torch.complex64)), TypeError,
                       r"got torch\.complex64"),
    "a list, not a tensor": (lambda tmp: quantize_nvfp4([[1.0] * 16]), TypeError, r"x must be a torch\.Tensor, got list"),
    "0-d tensor": (lambda tmp: quantize_nvfp4(torch.tensor(1.0)), ValueError, r"cannot quantize a 0-d tensor"),
    "last dim not a multiple of 16": (lambda tmp: quantize_nvfp4(torch.randn(4, 24)), ValueError,
                                      r"last dim to be a multiple of 16, got shape \(4, 24\)"),
    "1-d tensor of 15": (lambda tmp: quantize_nvfp4(torch.randn(15)), ValueError, r"got shape \(15,\)"),
    "block_shape (1, 32)": (lambda tmp: quantize_nvfp4(X, block_shape=(1, 32)), ValueError,
                            r"block_shape must be one of .*got \(1, 32\)"),
    "block_shape 16": (lambda tmp: quantize_nvfp4(X, block_shape=16), ValueError, r"block_shape must be one of .*got 16"),
    "16x1 blocks with 4 rows": (lambda tmp: quantize_nvfp4(X, block_shape=(16, 1)), ValueError,
                                r"16x1 blocks need dim 0 to be a multiple of 16, got shape \(4, 32\)"),
    "16x16 blocks on a 3-d tensor": (lambda tmp: quantize_nvfp4(torch.randn(2, 16, 16), block_shape=(16, 16)),
                                     ValueError, r"needs a 2D tensor, got shape \(2, 16, 16\)"),
    "stochastic = 'yes'": (lambda tmp: quantize_nvfp4(X, stochastic="yes"), TypeError,
                           r"stochastic must be True or False, got 'yes'"),
    "four_over_six = 1": (lambda tmp: quantize_nvfp4(X, four_over_six=1), TypeError, r"four_over_six must be True or False"),
    "seed 1.5": (lambda tmp: quantize_nvfp4(X, stochastic=True, seed=1.5), ValueError, r"seed must be an integer .*got 1\.5"),
    "seed beyond 2**64": (lambda tmp: quantize_nvfp4(X, stochastic=True, seed=2**70), ValueError, r"seed must be an integer"),
    "seed and generator": (lambda tmp: quantize_nvfp4(X, stochastic=True, seed=1, generator=torch.Generator()),
                           ValueError, r"pass seed or generator, not both"),
    "generator not a Generator": (lambda tmp: quantize_nvfp4(X, stochastic=True, generator=1), TypeError,
                                  r"generator must be a torch\.Generator, got int"),
    "generator on another device": (
        lambda tmp: quantize_nvfp4(torch.empty(4, 32, device="meta"), stochastic=True, generator=torch.Generator()),
        ValueError, r"generator is on cpu, x on meta"),
    "amax a string": (lambda tmp: quantize_nvfp4(X, amax="1"), TypeError, r"amax must be a real number .*got str"),
    "dequantize to int32": (lambda tmp: quantize_nvfp4(X).dequantize(torch.int32), TypeError,
                            r"dequantize needs a floating-point torch\.dtype, got torch\.int32"),
    "dequantize to 'bf16'": (lambda tmp: quantize_nvfp4(X).dequantize("bf16"), TypeError, r"got 'bf16'"),
    "transpose of 1x16 blocks": (lambda tmp: quantize_nvfp4(X).t(), ValueError, r"only 2D tensors with 16x16 blocks"),
    "MXFP8 of an int tensor": (lambda tmp: quantize_mxfp8(torch.ones(4, 32, dtype=torch.int64)), TypeError,
                               r"MXFP8 quantization needs a floating-point tensor"),
    "MXFP8 of a 0-d tensor": (lambda tmp: quantize_mxfp8(torch.tensor(1.0)), ValueError, r"0-d tensor to MXFP8"),
    "MXFP8 last dim 16": (lambda tmp: quantize_mxfp8(torch.randn(4, 16)), ValueError,
                          r"multiple of 32, got shape \(4, 16\)"),
    "MXFP8 float64 beyond float32": (
        lambda tmp: quantize_mxfp8(torch.tensor([[1e39] + [0.0] * 31], dtype=torch.float64)), ValueError,
        r"beyond float32's range"),
    "MXFP8 dequantize to int": (lambda tmp: quantize_mxfp8(torch.randn(2, 32)).dequantize(torch.int8), TypeError,
                                r"floating-point torch\.dtype"),
    "x that requires grad": (lambda tmp: quantize_nvfp4(X.clone().requires_grad_(True)), ValueError,
                             r"quantize_nvfp4: x requires grad, but quantization is not differentiable"),
    "MXFP8 of x that requires grad": (lambda tmp: quantize_mxfp8(X.clone().requires_grad_(True)), ValueError,
                                      r"quantize_mxfp8: x requires grad"),
    "amax beyond float32": (lambda tmp: quantize_nvfp4(X, amax=1e300), ValueError,
                            r"amax = 1e\+300 is beyond float32's range"),
    "rht signs of 12": (lambda tmp: rht(X, torch.ones(12)), ValueError,
                        r"rht: signs must be a 1-D floating-point tensor of a power-of-two length >= 2 \(rht_signs\), "
                        r"got torch\.float32 \(12,\)"),
    "rht_signs seed 1.5": (lambda tmp: rht_signs(1.5), ValueError, r"rht_signs: seed must be an integer .*got 1\.5"),
    "GEMM bias shorter than N": (lambda tmp: nvfp4_gemm(quantize_nvfp4(X), quantize_nvfp4(torch.randn(48, 32)),
                                                         torch.float32, bias=torch.randn(16), backend="reference"),
                                 ValueError, r"NVFP4 GEMM: bias of shape \(16,\), expected \(48,\)"),
    "build_recipe overrides a list": (lambda tmp: build_recipe("nvidia_paper", ["rht"]), TypeError,
                                      r"build_recipe: overrides must be a dict of recipe keys, got list"),
    # nvfp4_linear and the modules
    "nvfp4_linear: K of x and weight differ": (lambda tmp: nvfp4_linear(X, torch.randn(16, 48), None, REF), ValueError,
                                               r"x \(4, 32\) and weight \(16, 48\) do not fit"),
    "nvfp4_linear: bias of the wrong size": (lambda tmp: nvfp4_linear(X, torch.randn(16, 32), torch.randn(8), REF),
                                             ValueError, r"bias of shape \(8,\), expected \(16,\)"),
    "nvfp4_linear: no recipe": (lambda tmp: nvfp4_linear(X, torch.randn(16, 32), None, None), TypeError,
                                r"recipe must be an NVFP4Recipe, got NoneType"),
    "nvfp4_linear: an int bias": (lambda tmp: nvfp4_linear(X, torch.randn(16, 32), torch.ones(16, dtype=torch.int32),
                                                           REF), TypeError,
                                  r"nvfp4_linear: bias must be a floating-point tensor, got torch\.int32"),
    "nvfp4_linear: a weight on meta": (lambda tmp: nvfp4_linear(X, torch.empty(16, 32, device="meta"), None, REF),
                                       ValueError, r"x is on cpu but weight on meta \(not materialized"),
    "nvfp4_linear: counter of 3 floats": (lambda tmp: nvfp4_linear(X, torch.randn(16, 32), None, REF,
                                                                   counter=torch.zeros(3)), ValueError,
                                          r"counter must be an int64 tensor of shape \(2,\) \(sr_counter\)"),
    "nvfp4_linear: signs of 8": (lambda tmp: nvfp4_linear(X, torch.randn(16, 32), None, REF, signs=torch.ones(8)),
                                 ValueError, r"signs must be a floating-point tensor of shape \(16,\)"),
    "integer input": (lambda tmp: NVFP4Linear(32, 16, recipe=REF, name="mlp.w1")(torch.ones(4, 32, dtype=torch.int64)),
                      TypeError, r"mlp\.w1: input must be a floating-point tensor, got torch\.int64"),
    "a layer on meta given a real input": (
        lambda tmp: NVFP4Linear(32, 16, recipe=REF, name="mlp.w1", device="meta")(X), RuntimeError,
        r"mlp\.w1: the layer is on the meta device \(not materialized: to_empty\(\) and initialize it first\)"),
    "grouped GEMM: bias not [E, N]": (
        lambda tmp: nvfp4_grouped_mm(torch.randn(8, 32), torch.randn(2, 16, 32), torch.tensor([4, 8]), torch.randn(2, 8),
                                     REF), ValueError, r"grouped GEMM: bias of shape \(2, 8\), expected \(2, 16\)"),
    "grouped GEMM: no recipe": (
        lambda tmp: nvfp4_grouped_mm(torch.randn(8, 32), torch.randn(2, 16, 32), torch.tensor([4, 8]), None, None),
        TypeError, r"grouped GEMM: recipe must be an NVFP4Recipe, got NoneType"),
    "in_features 0": (lambda tmp: NVFP4Linear(0, 16), ValueError, r"in_features must be a positive integer, got 0"),
    "in_features -16": (lambda tmp: NVFP4Linear(-16, 16, name="mlp.w1"), ValueError,
                        r"'mlp\.w1'.*in_features must be a positive integer, got -16"),
    "in_features '32'": (lambda tmp: NVFP4Linear("32", 16), ValueError, r"got '32'"),
    "recipe a dict": (lambda tmp: NVFP4Linear(32, 16, recipe={"rht": False}, name="mlp.w1"), TypeError,
                      r"mlp\.w1: recipe must be an NVFP4Recipe .*got dict"),
    "recipe a preset name": (lambda tmp: NVFP4Linear(32, 16, recipe="nvidia_paper"), TypeError, r"got str"),
    "integer dtype": (lambda tmp: NVFP4Linear(32, 16, dtype=torch.int32), TypeError,
                      r"dtype must be a floating-point torch\.dtype"),
    "from_linear of a Conv1d": (lambda tmp: NVFP4Linear.from_linear(nn.Conv1d(16, 16, 1), REF, name="c"), TypeError,
                                r"from_linear\('c'\): needs an nn\.Linear, got Conv1d"),
    "0-d input": (lambda tmp: NVFP4Linear(32, 16, recipe=REF, name="mlp.w1")(torch.tensor(1.0)), RuntimeError,
                  r"mlp\.w1: input of shape \(\) has 0 features"),
    "layer_id 'a'": (lambda tmp: NVFP4Linear(32, 16, layer_id="a", name="mlp.w1"), ValueError,
                     r"mlp\.w1: layer_id must be a non-negative integer \(it seeds .*\), got 'a'"),
    "layer_id -1 (DecomposedLinear)": (lambda tmp: DecomposedLinear(32, 32, rank=16, layer_id=-1, recipe=REF), ValueError,
                                       r"DecomposedLinear: layer_id must be a non-negative integer .*got -1"),
    "a list as input": (lambda tmp: NVFP4Linear(32, 16, recipe=REF)([[1.0] * 32]), TypeError,
                        r"input must be a torch\.Tensor, got list"),
    "DecomposedLinear rank 0": (lambda tmp: DecomposedLinear(32, 32, rank=0, recipe=REF), ValueError,
                                r"^DecomposedLinear: rank must be a positive multiple of 16 \(rank 0: use NVFP4Linear\), got 0"),
    "DecomposedLinear rank 8": (lambda tmp: DecomposedLinear(32, 32, rank=8, recipe=REF), ValueError,
                                r"^DecomposedLinear: rank must be a positive multiple of 16, got 8$"),
    "DecomposedLinear rank '16'": (lambda tmp: DecomposedLinear(32, 32, rank="16", recipe=REF, name="w"), ValueError,
                                   r"^DecomposedLinear 'w': rank must be a positive multiple of 16, got '16'"),
    "DecomposedLinear rank above the dims": (lambda tmp: DecomposedLinear(32, 32, rank=48, recipe=REF, name="w"),
                                             ValueError, r"^rank 48 does not fit Linear 'w' \(32x32\)"),
    "DecomposedLinear lora_nvfp4 'no'": (lambda tmp: DecomposedLinear(32, 32, rank=16, recipe=REF, lora_nvfp4="no"),
                                         ValueError, r"lora_nvfp4 must be True or False, got 'no'"),
    "DecomposedLinear recipe {}": (lambda tmp: DecomposedLinear(32, 32, rank=16, recipe={}), TypeError,
                                   r"recipe must be an NVFP4Recipe"),
    "DecomposedLinear wrong in_features": (
        lambda tmp: DecomposedLinear(32, 32, rank=16, recipe=REF, name="w")(torch.randn(4, 48)), RuntimeError,
        r"w: input of shape \(4, 48\) has 48 features"),
    "experts with a dict recipe": (lambda tmp: _experts({}), TypeError, r"moe\.experts: recipe must be an NVFP4Recipe"),
    "experts with a dim not a multiple of 16": (lambda tmp: _experts(REF, dim=24), ValueError,
                                                r"cannot convert experts 'moe\.experts' to NVFP4: w1 \(2, 32, 24\)"),
    "experts lora_rank 8": (lambda tmp: _experts(REF, lora_rank=8), ValueError,
                            r"\[quantize\.grouped_mm\.nvfp4\] lora_rank must be 0 \(off\) or a positive multiple"),
    # the TOML sections (a wrong type in the file; TorchTitan's parser refuses wrong types on the command line)
    "rht = 1": (lambda tmp: parse(toml=edited_toml(tmp, {"rht": "1"})), ValueError, r"rht must be true or false, got 1"),
    "bf16_first_blocks = 1.5": (lambda tmp: parse(toml=edited_toml(tmp, {"bf16_first_blocks": "1.5"})), ValueError,
                                r"bf16_first_blocks must be a non-negative integer, got 1\.5"),
    "gemm_backend = 3": (lambda tmp: parse(toml=edited_toml(tmp, {"gemm_backend": "3"})), ValueError,
                         r"gemm_backend must be one of .*got 3"),
    "filter_fqns a string": (lambda tmp: parse(toml=edited_toml(tmp, {"filter_fqns": '"output"'})), ValueError,
                             r"filter_fqns must be a list of strings, got 'output'"),
    "filter_fqns with an empty pattern": (lambda tmp: parse(toml=edited_toml(tmp, {"filter_fqns": '["output", ""]'})),
                                          ValueError, r"filter_fqns holds an empty pattern"),
    "lora_rank = \"16\"": (lambda tmp: parse(toml=edited_toml(tmp, add=('lora_rank = "16"',))), ValueError,
                           r"lora_rank must be 0 \(off\) or a positive multiple of 16, got '16'"),
    "telemetry_every = 1.5": (lambda tmp: parse(toml=edited_toml(tmp, add=("telemetry_every = 1.5",))), ValueError,
                              r"telemetry_every must be a non-negative integer, got 1\.5"),
    "bf16_after_fraction = true": (lambda tmp: parse(toml=edited_toml(tmp, add=("bf16_after_fraction = true",))),
                                   ValueError, r"bf16_after_fraction must be a number in \[0, 1\], got True"),
    "fsdp_nvfp4_all_gather = \"yes\"": (
        lambda tmp: parse(toml=edited_toml(tmp, add=('fsdp_nvfp4_all_gather = "yes"',))), ValueError,
        r"fsdp_nvfp4_all_gather must be true or false, got 'yes'"),
    "staged_expert_activations in the Linear section": (
        lambda tmp: parse(toml=edited_toml(tmp, add=("staged_expert_activations = false",))), ValueError,
        r"staged_expert_activations applies to the routed experts only"),
    "grouped section: backward = mxfp8": (
        lambda tmp: parse(toml=edited_toml(tmp, add=("[quantize.grouped_mm.nvfp4]", 'backward = "mxfp8"'))), ValueError,
        r"\[quantize\.grouped_mm\.nvfp4\] backward = 'mxfp8': the experts run an NVFP4 backward only"),
    "grouped section: fqns with an empty pattern": (
        lambda tmp: parse(toml=edited_toml(tmp, add=("[quantize.grouped_mm.nvfp4]", 'fqns = [""]'))), ValueError,
        r"\[quantize\.grouped_mm\.nvfp4\] fqns holds an empty pattern"),
    "grouped section: staged_expert_activations = \"no\"": (
        lambda tmp: parse(toml=edited_toml(tmp, add=("[quantize.grouped_mm.nvfp4]", 'staged_expert_activations = "no"'))),
        ValueError, r"\[quantize\.grouped_mm\.nvfp4\] staged_expert_activations must be true or false"),
    # recipe files
    "recipe file that does not exist": (lambda tmp: load_preset(str(tmp / "nope.toml")), ValueError,
                                        r"unknown recipe '.*nope\.toml'.*no such \.toml file either"),
    "recipe path to a folder": (lambda tmp: load_preset(str(tmp)), ValueError, r"recipe '.*' is a folder"),
    "recipe file without .toml": (lambda tmp: load_preset(_file(tmp, "recipe.txt", "rht = false\n")), ValueError,
                                  r"recipe\.txt' is a file not ending in \.toml"),
    "recipe file with an unknown key": (lambda tmp: load_preset(_toml(tmp, "rhtt = true\n")), ValueError,
                                        r"\[recipe preset .*recipe\.toml\] unknown recipe key 'rhtt'; valid keys"),
    "recipe file with a wrong type": (lambda tmp: load_preset(_toml(tmp, 'weight_2d = "yes"\n')), ValueError,
                                      r"recipe\.toml\] weight_2d must be true or false, got 'yes'"),
    "recipe file with a table": (lambda tmp: load_preset(_toml(tmp, "[recipe]\nrht = false\n")), ValueError,
                                 r"unknown recipe key 'recipe'"),
    "recipe file not UTF-8": (lambda tmp: load_preset(_file(tmp, "bin.toml", b"\xff\xfe[")), ValueError,
                              r"recipe file .*bin\.toml: not UTF-8 text"),
    "recipe constructor with an unknown key": (lambda tmp: NVFP4Recipe(rhtt=True), TypeError, r"'rhtt'"),
    # comparison specs
    "spec without [compare]": (lambda tmp: _spec(tmp, TWO_ARMS), ValueError, r"spec\.toml: needs a \[compare\] table"),
    "spec with an unknown key": (lambda tmp: _spec(tmp, SPEC + "stepz = 3\n" + TWO_ARMS), ValueError,
                                 r"unknown \[compare\] keys \['stepz'\]"),
    "spec without arms": (lambda tmp: _spec(tmp, SPEC), ValueError, r"at least two \[\[arm\]\] tables, got 0"),
    "spec with one [arm] table": (lambda tmp: _spec(tmp, SPEC + '[arm]\nname = "a"\n'), ValueError,
                                  r"arms are \[\[arm\]\] tables"),
    "duplicate arm names": (lambda tmp: _spec(tmp, SPEC + '[[arm]]\nname = "a"\n[[arm]]\nname = "a"\n'), ValueError,
                            r"arm name 'a' must be unique"),
    "arm named '..'": (lambda tmp: _spec(tmp, SPEC + '[[arm]]\nname = ".."\n[[arm]]\nname = "b"\n'), ValueError,
                       r"arm name '\.\.' must be unique and a plain file name"),
    "arm with an unknown key": (lambda tmp: _spec(tmp, SPEC + '[[arm]]\nname = "a"\noverride = []\n[[arm]]\nname = "b"\n'),
                                ValueError, r"arm 'a' has unknown keys \['override'\]"),
    "arm overrides a string": (
        lambda tmp: _spec(tmp, SPEC + '[[arm]]\nname = "a"\noverrides = "--x"\n[[arm]]\nname = "b"\n'), ValueError,
        r"arm 'a' overrides must be a list of strings"),
    "arm base a number": (lambda tmp: _spec(tmp, SPEC + '[[arm]]\nname = "a"\nbase = 3\n[[arm]]\nname = "b"\n'),
                          ValueError, r"arm 'a' base must be a string"),
    "spec base a folder": (lambda tmp: _spec(tmp, '[compare]\nbase = "train_configs"\nsteps = 10\n' + TWO_ARMS),
                           ValueError, r"base = 'train_configs': a folder, not a job file"),
    "spec out a number": (lambda tmp: _spec(tmp, SPEC + "out = 3\n" + TWO_ARMS), ValueError,
                          r"\[compare\] out must be a string, got 3"),
    "reference = baseline": (lambda tmp: _spec(tmp, SPEC + 'baseline = "a"\nreference = "a"\n' + TWO_ARMS), ValueError,
                             r"reference = 'a' is the baseline arm"),
    "empty launcher": (lambda tmp: _spec(tmp, SPEC + "launcher = []\n" + TWO_ARMS), ValueError,
                       r"launcher must name a command"),
    "timeout_s = nan": (lambda tmp: _spec(tmp, SPEC + "timeout_s = nan\n" + TWO_ARMS), ValueError,
                        r"timeout_s must be a non-negative number, got nan"),
    "spec not UTF-8": (lambda tmp: _spec(tmp, b"\xff\xfe["), ValueError, r"spec\.toml: not UTF-8 text"),
    "arm override with a misspelt key": (lambda tmp: _arm_flags(tmp, '["--quantize.linear.nvfp4.rhtt", "False"]'),
                                         ValueError, r"arm 'a': TorchTitan rejects its arguments: .*rhtt"),
    "arm override with a bad value": (
        lambda tmp: _arm_flags(tmp, '["--quantize.linear.nvfp4.backward", "fp8"]'), ValueError,
        r"arm 'a': TorchTitan rejects .*backward must be one of .*got 'fp8'"),
    "arm override without its value": (lambda tmp: _arm_flags(tmp, '["--quantize.linear.nvfp4.rht"]'), ValueError,
                                       r"arm 'a': TorchTitan rejects .*Missing value"),
}


def _experts(recipe, dim: int = 32, lora_rank: int = 0):
    """Convert a 2-expert GroupedExperts (dim x hidden 32) as the grouped converter would."""
    from torchtitan.models.moe.moe import GroupedExperts

    from titan_nvfp4.integration.experts import NVFP4GroupedExperts

    with torch.device("meta"):
        mod = GroupedExperts(dim=dim, hidden_dim=32, num_experts=2, use_grouped_mm=True)
    return NVFP4GroupedExperts.convert(mod, recipe, layer_id=0, name="moe.experts", lora_rank=lora_rank)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_a_clear_error(case, tmp_path):
    call, exc, pattern = CASES[case]
    if "without a GPU" in case and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    with pytest.raises(exc, match=pattern):
        call(tmp_path)


def test_defined_results_at_the_edges():
    """What is not an error has a defined result: an all-zero tensor with amax 0 decodes to zeros, a given
    amax below the data saturates (codes ±6, scale 448), a NaN amax makes every value NaN."""
    assert torch.equal(quantize_nvfp4(torch.zeros(2, 32), amax=0.0).dequantize(), torch.zeros(2, 32))
    q = quantize_nvfp4(torch.tensor([[10.0] + [1.0] * 15]), amax=1e-30)
    assert float(q.scale.float()[0, 0]) == 448.0
    assert torch.isnan(quantize_nvfp4(X, amax=float("nan")).dequantize()).all()


def test_a_filter_pattern_that_matches_nothing_is_a_warning(caplog):
    """A filter_fqns pattern that no Linear's name contains is most likely a typo: a warning names it (not an error:
    TorchTitan's float8 and MX converters ignore such patterns, and one job file may serve several models). The
    default patterns (router.gate, shared_experts: MoE only) are expected to miss on a dense model and stay quiet."""
    with caplog.at_level(logging.WARNING):
        _convert_llama(L + "filter_fqns", "output,attention.wqq,router.gate")
    assert "[quantize.linear.nvfp4] filter_fqns pattern 'attention.wqq' matches no Linear of the model" in caplog.text
    assert "router.gate" not in caplog.text


def test_defined_results_of_empty_tensors():
    """Empty tensors are not errors: they quantize to empty codes and decode to empty tensors of their shape."""
    for shape in ((0, 32), (4, 0)):
        assert quantize_nvfp4(torch.randn(shape)).dequantize().shape == shape
        assert quantize_mxfp8(torch.randn(shape)).dequantize().shape == shape
    assert NVFP4Linear(32, 16, recipe=REF)(torch.randn(2, 0, 32)).shape == (2, 0, 16)


def test_meta_inputs_give_meta_outputs():
    """Shape inference: a meta input gives a meta output of Y's shape and dtype (no autocast error), gradients too."""
    x = torch.empty(2, 3, 32, device="meta", requires_grad=True)
    layer = NVFP4Linear(32, 16, recipe=REF, device="meta")
    y = layer(x)
    assert y.is_meta and y.shape == (2, 3, 16) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.is_meta and x.grad.shape == x.shape and layer.weight.grad.shape == (16, 32)
    x16 = torch.empty(4, 32, device="meta", dtype=torch.bfloat16)
    assert nvfp4_linear(x16, torch.randn(16, 32), None, REF).shape == (4, 16)  # a CPU weight too
    assert DecomposedLinear(32, 32, rank=16, recipe=REF, device="meta")(x16).shape == (4, 32)  # never decomposed


# -- the tools: (module, arguments, exit status, the one line they print on stderr); run in tmp_path with two logs
LOG = (ROOT / "tests" / "data" / "llama3_bf16.log").read_text()
GARBLED = "step: 1  loss: e  grad_norm: 1.0  memory: 1.00GiB(1%)  tps: 10\n"
TOOL_CASES = {
    "loss_log: an empty log": ("loss_log", ["empty.log"], 2, r"no TorchTitan metric lines in empty\.log"),
    "loss_log: garbled metric lines": ("loss_log", ["garbled.log"], 2, r"no TorchTitan metric lines in garbled\.log"),
    "loss_log: a folder without events": ("loss_log", ["folder"], 2, r"no TensorBoard events .* under folder"),
    "loss_log: two runs of one name": ("loss_log", ["a.log", "folder/a.log"], 2, r"two runs named 'a'"),
    "loss_log: --last 0": ("loss_log", ["a.log", "--last", "0"], 2, r"--last must be a positive number"),
    "loss_log: --csv into a missing folder": ("loss_log", ["a.log", "--csv", "nodir/x.csv"], 2,
                                              r"--csv nodir/x\.csv: no such folder nodir"),
    "loss_log: --csv onto a folder": ("loss_log", ["a.log", "--csv", "folder"], 2, r"--csv folder is a folder"),
    "loss_log: a group that matches no run": ("loss_log", ["a.log", "b.log", "--group", "g=zzz*"], 2,
                                              r"--group g: no run matches \(runs: a, b\)"),
    "loss_log: a run wanted by two groups": ("loss_log", ["a.log", "b.log", "--group", "g=a,b", "--group", "h=a"], 2,
                                             r"--group h: no run matches .*; a matches but joined --group g first"),
    "loss_log: a malformed group": ("loss_log", ["a.log", "--group", "x"], 2, r"--group 'x': expected NAME=PATTERN"),
    "loss_plot: --smooth 1": ("loss_plot", ["a.log", "--out", "x.png", "--smooth", "1"], 2, r"--smooth must be in \[0, 1\)"),
    "loss_plot: --out into a missing folder": ("loss_plot", ["a.log", "--out", "nodir/x.png"], 2,
                                               r"--out nodir/x\.png: no such folder nodir"),
    "loss_plot: --out of an unknown format": ("loss_plot", ["a.log", "--out", "x.txt"], 2, r"unknown image format '\.txt'"),
    "loss_plot: a group that matches no run": ("loss_plot", ["a.log", "b.log", "--out", "x.png", "--group", "g=zzz*"],
                                               2, r"--group g: no run matches"),
    "e2e_report: a log without metric lines": ("e2e_report", ["empty.log"], 1, r"no TorchTitan metric lines in: empty\.log"),
    "e2e_report: a folder": ("e2e_report", ["folder"], 2, r"folder is a folder, not a log file"),
    "e2e_report: --json into a missing folder": ("e2e_report", ["a.log", "--json", "nodir/x.json"], 2,
                                                 r"--json nodir/x\.json: no such folder"),
    "e2e_report: --skip -1": ("e2e_report", ["a.log", "--skip", "-1"], 2, r"--skip must be >= 0, got -1"),
    "e2e_report: --tokens-per-step 0": ("e2e_report", ["a.log", "--tokens-per-step", "0"], 2,
                                        r"--tokens-per-step must be a positive integer"),
    "export_dense: an empty file": ("export_dense", ["empty.log", "out.pt"], 2, r"cannot read checkpoint empty\.log"),
    "export_dense: a garbled file": ("export_dense", ["a.log", "out.pt"], 2, r"cannot read checkpoint a\.log"),
    "export_dense: a folder without a checkpoint": ("export_dense", ["folder", "out.pt"], 2,
                                                    r"folder is a folder without a DCP checkpoint"),
    "export_dense: a tensor, not a state dict": ("export_dense", ["tensor.pt", "out.pt"], 2,
                                                 r"tensor\.pt holds a Tensor, not a state dict"),
    "export_dense: factors without their residual": ("export_dense", ["factors.pt", "out.pt"], 2,
                                                     r"factors\.pt: a\.lora_u has no a\.weight"),
    "export_dense: OUT.pt in a missing folder": ("export_dense", ["tensor.pt", "nodir/out.pt"], 2,
                                                 r"output file nodir/out\.pt: no such folder"),
    "emulated_dp: no --data-parallel": ("emulated_dp", [], 2, r"--data-parallel N is required"),
    "emulated_dp: --data-parallel two": ("emulated_dp", ["--data-parallel", "two"], 2, r"'two' is not an integer"),
    "emulated_dp: --data-parallel 0": ("emulated_dp", ["--data-parallel", "0"], 2, r"--data-parallel must be >= 1"),
    "compare: a misspelt override": ("compare", ["spec.toml"], 2,
                                     r"spec\.toml: arm 'a': TorchTitan rejects its arguments: .*rhtt"),
}


@pytest.fixture
def tool_inputs(tmp_path, monkeypatch):
    """Logs, checkpoints and a spec with a misspelt override in tmp_path, the working directory."""
    (tmp_path / "a.log").write_text(LOG)
    (tmp_path / "b.log").write_text(LOG)
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "garbled.log").write_text(GARBLED)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.log").write_text(LOG)
    torch.save(torch.ones(2), tmp_path / "tensor.pt")
    torch.save({"a.lora_u": torch.ones(2, 1)}, tmp_path / "factors.pt")
    (tmp_path / "train_configs").mkdir()
    (tmp_path / "train_configs" / "llama3_nvfp4.toml").write_text((ROOT / "train_configs" / "llama3_nvfp4.toml").read_text())
    (tmp_path / "spec.toml").write_text(SPEC + '[[arm]]\nname = "a"\noverrides = ["--quantize.linear.nvfp4.rhtt", "1"]\n'
                                        '[[arm]]\nname = "b"\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", TOOL_CASES)
def test_a_tool_given_bad_input_prints_one_line_and_exits_non_zero(case, tool_inputs, capsys):
    tool, argv, status, pattern = TOOL_CASES[case]
    module = f"titan_nvfp4.{tool}" if tool == "compare" else f"titan_nvfp4.tools.{tool}"
    try:
        code = importlib.import_module(module).main(argv) or 0
    except SystemExit as e:
        code = e.code
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert code == status, err
    assert len(lines) == 1 and lines[0].startswith(f"python -m {module}: ") and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]
    assert not (tool_inputs / "outputs").exists(), "nothing was run"


def test_a_tool_run_as_a_program_exits_2_without_a_traceback(tool_inputs):
    tool, argv = "export_dense", ["a.log", "out.pt"]  # a file torch.load cannot read
    r = subprocess.run([sys.executable, "-m", f"titan_nvfp4.tools.{tool}", *argv], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.splitlines()  # one line: no runpy warning ("found in sys.modules") either
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"python -m titan_nvfp4.tools.{tool}: error:"), r.stderr
