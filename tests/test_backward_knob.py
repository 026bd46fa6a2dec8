"""recipe.backward (NVFP4 forward, MXFP8 or BF16 backward): the forward is the NVFP4 one bit for bit,
the gradients are the stated products (float64 on the MXFP8-dequantized operands; the exact matmul for
BF16), and the knob is validated where it cannot apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.autograd.linear_function import nvfp4_linear
from titan_nvfp4.numerics.mxfp8 import quantize_mxfp8

BASE = NVFP4Recipe(gemm_backend="reference")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(recipe, x, w, b):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = nvfp4_linear(x, w, b, recipe)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(dy.to(y.device))
    return y.detach(), x.grad, w.grad, b.grad, dy


def _mx64(a):
    """MXFP8 of a (blocks along dim 1, zero-padded to 32) dequantized, in float64."""
    pad = (-a.shape[1]) % 32
    return quantize_mxfp8(torch.nn.functional.pad(a, (0, pad))).dequantize(torch.float32).double()


@pytest.mark.parametrize("m", [48, 37])  # 37 tokens: the wgrad contraction is padded to 64
def test_mxfp8_and_bf16_backward(m):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(m, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    y_fp4, *_ = _run(BASE, x, w, b)
    y_mx, dx, dw, db, dy = _run(dataclasses.replace(BASE, backward="mxfp8"), x, w, b)
    assert torch.equal(y_mx, y_fp4)  # the forward is untouched
    # dgrad: blocks along N (48: padded to 64); wgrad: blocks along the tokens
    dx64 = _mx64(dy) @ _mx64(w.t().contiguous()).t()
    dw64 = _mx64(dy.t().contiguous()) @ _mx64(x.t().contiguous()).t()
    assert torch.allclose(dx.double(), dx64, rtol=1e-6, atol=1e-6)  # fp32 sums of exact products
    assert torch.allclose(dw.double(), dw64, rtol=1e-6, atol=1e-6)
    assert torch.equal(db, dy.sum(0))
    assert not torch.allclose(dx, dy @ w, rtol=1e-3)  # MXFP8 did round
    _, dx16, dw16, _, _ = _run(dataclasses.replace(BASE, backward="bf16"), x, w, b)
    assert torch.equal(dx16, dy @ w) and torch.equal(dw16, dy.t() @ x)


def test_backward_knob_validation(tmp_path):
    from job_helpers import edited_toml, parse

    with pytest.raises(ValueError, match="backward must be one of"):
        NVFP4Recipe(backward="fp8")
    with pytest.raises(ValueError, match="fsdp_nvfp4_all_gather.*backward"):
        parse(toml=edited_toml(tmp_path, add=('backward = "mxfp8"', "fsdp_nvfp4_all_gather = true")))
    from titan_nvfp4.integration.job_config import NVFP4GroupedMMConfig

    with pytest.raises(ValueError, match=r"grouped_mm.nvfp4\] backward = 'mxfp8'"):
        NVFP4GroupedMMConfig(backward="mxfp8")
    cfg = parse(toml=edited_toml(tmp_path, add=('backward = "bf16"',)))
    assert cfg.quantize.linear.nvfp4.build_recipe().backward == "bf16"


@pytest.mark.parametrize("n", [64, 48])  # 48: dY's blocks along N need padding, the reference quantizes it
def test_mxfp8_backward_kernels_match_the_reference(n, monkeypatch):
    """The emulated backend's MXFP8 operands come from the Triton kernel (the CPU interpreter here): the
    same bits as the reference quantizer, so the same gradients; X is saved as MXFP8 (1 byte and 1/32
    of a scale per element), not in its dtype."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(40, 64, generator=g), torch.randn(n, 64, generator=g), torch.randn(n, generator=g)
    x, w, b = (t.to(DEV) for t in (x, w, b))  # on a GPU both backends run the same BF16 tensor-core GEMM
    ref = _run(dataclasses.replace(BASE, backward="mxfp8"), x, w, b)
    from titan_nvfp4.ops import quantize as ops_quantize

    kernel_calls = []
    real = ops_quantize.library.quantize_mxfp8
    monkeypatch.setattr(ops_quantize.library, "quantize_mxfp8",
                        lambda x, **k: kernel_calls.append((k["rowwise"], k["colwise"], k["staged"])) or real(x, **k))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        emu = _run(NVFP4Recipe(gemm_backend="emulated", backward="mxfp8"), x, w, b)
    for a, e in zip(ref[1:4], emu[1:4]):
        assert torch.equal(a, e)
    # (rowwise, colwise, staged) — forward: Xᵀ kept as MXFP8; backward: dY both ways (only when 32
    # divides N) and Wᵀ, staged in BF16 for their GEMMs
    want = [(False, True, False), (True, True, True), (False, True, True)]
    assert kernel_calls == (want if n == 64 else [want[0], want[2]])
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert [tuple(t.shape) for t in fp8] == [(64, 64)], "Xᵀ in MXFP8, 40 tokens padded to 64"
    assert not any(t.shape == x.shape and t.is_floating_point() and t.element_size() >= 2 for t in saved)
