"""Sibling NVFP4 Linears on the same X (titan_nvfp4/shared_input.py): the later ones reuse the first one's
quantization of X, and every output, gradient and SR counter equals what each layer computes on its own."""

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4 import shared_input
from titan_nvfp4.ops.backends import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _backends():
    kernel = DEV == "cuda" or interpreting()
    return ["reference", pytest.param("emulated", marks=pytest.mark.skipif(not kernel, reason="needs a GPU or "
                                                                                              "TRITON_INTERPRET=1"))]


def _siblings(backend: str, k: int = 32, ns=(32, 16, 16)) -> list[NVFP4Linear]:
    """wq, wk, wv-like layers built on meta and materialized, as TorchTitan does."""
    recipe = NVFP4Recipe(gemm_backend=backend)
    with torch.device("meta"):
        layers = [NVFP4Linear(k, n, bias=False, recipe=recipe, layer_id=i, name=f"w{i}") for i, n in enumerate(ns)]
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        layer.to_empty(device=DEV)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    return layers


def _steps(layers, xs, dys, share: bool):
    out = []
    shared_input.enabled, was = share, shared_input.enabled
    try:
        for x, dy in zip(xs, dys):
            x = x.clone().requires_grad_(True)
            ys = [layer(x) for layer in layers]
            sum((y * d[:, : y.shape[1]]).sum() for y, d in zip(ys, dy)).backward()
            out += [y.detach() for y in ys] + [x.grad] + [layer.weight.grad.clone() for layer in layers]
            for layer in layers:
                layer.weight.grad = None
    finally:
        shared_input.enabled = was
    return out + [layer.sr_counter.clone() for layer in layers]


@pytest.mark.parametrize("backend", _backends())
def test_siblings_quantize_x_once_with_the_bits_of_each_on_its_own(backend):
    """Two steps of three layers on one X: 2 reuses per step with sharing, none without; outputs, dX, dW and
    the SR counters torch.equal; the layers hold one RHT sign tensor; the slot is empty after backward."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(48, 32, generator=g).to(DEV) for _ in range(2)]
    dys = [[torch.randn(48, 32, generator=g).to(DEV) for _ in range(3)] for _ in range(2)]
    on, off = _siblings(backend), _siblings(backend)
    assert on[0].rht_signs is on[1].rht_signs is on[2].rht_signs is off[0].rht_signs
    hits = shared_input.counts[0]
    shared = _steps(on, xs, dys, share=True)
    assert shared_input.counts[0] - hits == 4
    assert shared_input._slot is None
    hits = shared_input.counts[0]
    alone = _steps(off, xs, dys, share=False)
    assert shared_input.counts[0] == hits
    assert len(shared) == len(alone) == 2 * 7 + 3
    for i, (a, b) in enumerate(zip(shared, alone)):
        assert torch.equal(a, b), f"result {i} differs"


def test_an_x_changed_in_place_or_another_tensor_is_quantized_again():
    """The slot matches the very tensor at its version: after x.mul_(2), or for an equal copy of x, the next
    layer quantizes again, and its output is the output of that X."""
    a, b = _siblings("reference", ns=(32, 32))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        a(x)
        hits = shared_input.counts[0]
        x.mul_(2)
        y = b(x)
        assert shared_input.counts[0] == hits
        assert torch.equal(b(x), y)  # the same tensor again: reused
        assert shared_input.counts[0] == hits + 1
        assert torch.equal(b(x.clone()), y)
        assert shared_input.counts[0] == hits + 1
    shared_input.clear()


def test_the_layers_share_one_sign_tensor_after_a_dtype_cast():
    """A cast copies buffers per module; the layers point back at the shared signs (fp32, the same values)."""
    layers = _siblings("reference")
    for layer in layers:
        layer.to(torch.bfloat16)
    assert layers[0].rht_signs is layers[1].rht_signs and layers[0].rht_signs.dtype == torch.float32
