"""autograd/clamped_swiglu.py against TorchTitan 0.2's own gpt-oss swiglu under autograd (the reference nobody here
wrote): the same output and input gradient bits, on random and adversarial inputs, while keeping only the input
for backward. tests/test_torchtitan03.py checks the addcmul form against 0.3's."""

from __future__ import annotations

import inspect

import pytest
import torch

from clamped_swiglu_cases import bits, case
from titan_nvfp4.autograd.clamped_swiglu import ALPHA, LIMIT, clamped_swiglu
from titan_nvfp4.integration_common.torchtitan_version import installed_generation

if installed_generation() == "0.2":
    from torchtitan.models.gpt_oss.model.moe import swiglu

pytestmark = pytest.mark.skipif(installed_generation() != "0.2", reason="TorchTitan 0.2's swiglu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _both(x, dy, **kw):
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = swiglu(a, **kw), clamped_swiglu(b, **kw)
    ya.backward(dy)
    yb.backward(dy)
    return (ya, a.grad), (yb, b.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0, 30.0])
def test_same_bits_as_torchtitans_swiglu_under_autograd(device, dtype, scale):
    x, dy = case((3, 50, 96), dtype, scale, seed=int(scale * 10), device=device)
    (ya, ga), (yb, gb) = _both(x, dy)
    assert torch.equal(bits(ya), bits(yb)), "output"
    assert torch.equal(bits(ga), bits(gb)), f"input gradient: {int((bits(ga) != bits(gb)).sum())} elements differ"


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_with_other_alpha_and_limit(device):
    x, dy = case((64, 32), torch.bfloat16, 4.0, seed=3, device=device)
    (ya, ga), (yb, gb) = _both(x, dy, alpha=1.0, limit=3.0)
    assert torch.equal(bits(ya), bits(yb)) and torch.equal(bits(ga), bits(gb))


def test_defaults_are_torchtitans():
    params = inspect.signature(swiglu).parameters
    assert (params["alpha"].default, params["limit"].default) == (ALPHA, LIMIT)


def test_keeps_only_its_input_for_backward():
    """TorchTitan's formula keeps x and four half-width intermediates (three times x's bytes); this keeps x."""
    x, dy = case((128, 64), torch.bfloat16, 3.0, seed=5, device="cpu")
    counts = {}
    for name, fn in (("torchtitan", swiglu), ("ours", clamped_swiglu)):
        storages = {}
        xr = x.clone().requires_grad_()

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(xr).backward(dy)
        counts[name] = (len(storages), sum(storages.values()))
    assert counts["ours"] == (1, x.numel() * 2)
    assert counts["torchtitan"] == (5, 3 * x.numel() * 2)


def test_without_grad_it_is_the_formula():
    x, _ = case((16, 32), torch.bfloat16, 3.0, seed=7, device="cpu")
    with torch.no_grad():
        y = clamped_swiglu(x.clone().requires_grad_())
    assert y.grad_fn is None and torch.equal(bits(y), bits(swiglu(x)))


def test_compiles_whole_to_the_same_bits():
    """TorchTitan 0.3 may compile gpt-oss's expert body: the function traces with fullgraph (aot_eager here)."""
    x, dy = case((64, 32), torch.bfloat16, 5.0, seed=9, device="cpu")
    torch._dynamo.reset()
    try:
        xc = x.clone().requires_grad_()
        yc = torch.compile(clamped_swiglu, backend="aot_eager", fullgraph=True)(xc)
        yc.backward(dy)
    finally:
        torch._dynamo.reset()
    (ya, ga), _ = _both(x, dy)
    assert torch.equal(bits(ya), bits(yc)) and torch.equal(bits(ga), bits(xc.grad))


def test_same_bits_under_autocast():
    """TorchTitan trains one GPU under autocast: the formula's ops keep their dtypes there, forward and recomputed."""
    x, dy = case((64, 32), torch.bfloat16, 5.0, seed=11, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (ya, ga), (yb, gb) = _both(x, dy)
    assert torch.equal(bits(ya), bits(yb)) and torch.equal(bits(ga), bits(gb))
