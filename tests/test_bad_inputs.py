"""Bad input at the public entry points: each case is a clear error naming the key, layer, value or file.

One row per case: what is called, the exception it must raise and a pattern its message must match.
The table in docs/configuration.md ("Errors") lists the same cases for users.
"""

from __future__ import annotations

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, quantize_nvfp4
from titan_nvfp4.ops.backends import resolve_backend
from titan_nvfp4.recipe import build_recipe, load_preset
from test_converter import edited_toml, parse, world1

X = torch.randn(4, 32)


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
}


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
