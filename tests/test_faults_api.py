"""The Python API under faults (issue 66, S7, S8, S11 and the meta / amax edges): nothing stale, nothing half done.

S8: an input whose values change behind its version counter (numpy refilling a from_numpy tensor, a ``.data``
edit, a reused batch buffer) gives the output a fresh layer gives, bit for bit; eager sibling sharing
(titan_nvfp4/autograd/sibling_x.py) reuses only activations of the running forward. S7: quantization of a tensor that
requires grad is refused with a message, not differentiated through its scales. S11: a GEMM bias that is not
[N] is refused before a kernel reads it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import titan_nvfp4.autograd.linear_function as lf
import titan_nvfp4.autograd.sibling_x as sx
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, quantize_mxfp8, quantize_nvfp4, rht, rht_signs
from titan_nvfp4.numerics import rht_matrix
from titan_nvfp4.ops import library, nvfp4_gemm

REF = NVFP4Recipe(gemm_backend="reference")


@pytest.fixture(autouse=True)
def _fresh_sharing():
    sx.forget_shared_x()
    yield
    sx.forget_shared_x()


def _layers(n: int, seed: int = 0, bias: bool = False, dims: tuple[int, int] = (64, 32),
            first_id: int = 0) -> list[NVFP4Linear]:
    """n Linears (in, out = ``dims``) with distinct weights; the same arguments give the same layers (weights,
    layer ids and so SR streams)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(first_id, first_id + n):
        layer = NVFP4Linear(*dims, bias=bias, recipe=REF, layer_id=i, name=f"w{i}")
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            if bias:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
        out.append(layer)
    return out


def _fresh(layer: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    """What a fresh copy of ``layer`` gives for a fresh copy of x (nothing remembered)."""
    twin = _layers(1)[0]
    with torch.no_grad():
        twin.weight.copy_(layer.weight)
    return twin(x.detach().clone())


# -- S8: values changed behind the version counter -----------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True], ids=["input", "input_requiring_grad"])
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_a_numpy_backed_input_refilled_in_place_is_quantized_afresh(requires_grad, grad_mode):
    """The issue's reproduction (max error 7.9, no error raised): numpy rewrites the storage, the version stays."""
    a, b = _layers(2)
    arr = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    x = torch.from_numpy(arr).requires_grad_(requires_grad)
    with torch.set_grad_enabled(grad_mode):
        a(x), b(x)
        for refill in range(3):
            arr[:] = np.random.default_rng(refill + 1).standard_normal((32, 64))
            version = x._version
            ya, yb = a(x), b(x)  # the same layer again, then another layer
            assert x._version == version  # invisible to the version counter
            assert torch.equal(ya, _fresh(a, x)) and torch.equal(yb, _fresh(b, x)), refill


@pytest.mark.parametrize("requires_grad", [False, True], ids=["input", "input_requiring_grad"])
def test_a_data_edit_between_calls_is_quantized_afresh(requires_grad):
    a, b = _layers(2)
    x = torch.randn(32, 64, requires_grad=requires_grad)
    a(x)
    x.data.copy_(torch.randn(32, 64))  # .data: a new version counter, x's does not move
    assert torch.equal(b(x), _fresh(b, x))
    x.data.mul_(3)
    assert torch.equal(a(x), _fresh(a, x))


def test_a_data_edit_of_an_activation_is_seen_by_the_same_layer():
    """An activation is shared between siblings; a layer reading it again quantizes afresh (a new step or a repeat)."""
    (a,) = _layers(1)
    h = torch.randn(32, 64, requires_grad=True) * 1.0
    a(h)
    h.data.copy_(torch.randn(32, 64))
    assert torch.equal(a(h), _fresh(a, h))


class FirstBlock(nn.Module):
    """A model whose NVFP4 Linears (q, k, v as siblings) read the batch buffer itself, under a head kept in high
    precision (as filter_fqns keeps TorchTitan's output layer): no later NVFP4 layer replaces what they remember."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = _layers(3, seed=1, bias=True)
        self.out = nn.Linear(96, 32, bias=False)
        with torch.no_grad():
            self.out.weight.copy_(torch.randn(32, 96, generator=torch.Generator().manual_seed(2)))

    def forward(self, x):
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1))


def _train(feed, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses and final parameters of FirstBlock trained by plain SGD on ``feed(step)``'s inputs."""
    m = FirstBlock()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = m(feed(step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("refill", ["numpy", "data"])
def test_a_reused_batch_buffer_trains_on_each_steps_batch(refill):
    """A plain PyTorch loop refilling one input buffer: every step trains on its own batch, as a twin fed fresh
    tensors does (losses and weights bit for bit, SR streams included)."""
    batches = [torch.randn(32, 64, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    arr = np.zeros((32, 64), dtype=np.float32)
    buf = torch.from_numpy(arr)

    def refilled(step):
        if refill == "numpy":
            arr[:] = batches[step].numpy()
        else:
            buf.data.copy_(batches[step])
        return buf

    losses, params = _train(refilled)
    fresh_losses, fresh_params = _train(lambda step: batches[step].clone())
    assert len(set(float(v) for v in fresh_losses)) == 3  # three batches, three losses
    for step, (a, b) in enumerate(zip(losses, fresh_losses)):
        assert torch.equal(a, b), step
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)


def test_siblings_on_one_activation_still_share(monkeypatch):
    """The speed-up stays where it is provably right: q, k, v on one activation of one forward quantize it once
    (tests/test_sibling_x.py checks the bits); on the buffer itself, each quantizes it."""
    calls = []
    real = lf.quantize_activation
    monkeypatch.setattr(lf, "quantize_activation", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = FirstBlock()
    x = torch.randn(32, 64, requires_grad=True)
    m(x * 1.0)
    assert len(calls) == 1
    m(x)
    assert len(calls) == 4


# -- S7: quantization is not differentiable ------------------------------------------------------------------

@pytest.mark.parametrize("block_shape", [(1, 16), (16, 1), (16, 16)])
def test_quantizing_a_tensor_that_requires_grad_is_refused(block_shape):
    x = torch.randn(32, 64, requires_grad=True)
    with pytest.raises(ValueError, match=r"quantize_nvfp4: x requires grad, but quantization is not differentiable"
                                         r".*x\.detach\(\).*nvfp4_linear / NVFP4Linear"):
        quantize_nvfp4(x, block_shape)
    with pytest.raises(ValueError, match=r"quantize_nvfp4: amax requires grad"):
        quantize_nvfp4(x.detach(), block_shape, amax=x.detach().abs().max().requires_grad_(True))
    with pytest.raises(ValueError, match=r"quantize_mxfp8: x requires grad"):
        quantize_mxfp8(x)
    ref = quantize_nvfp4(x.detach(), block_shape)
    with torch.no_grad():  # under no_grad (a weight quantized for inspection) it is an ordinary quantization
        q = quantize_nvfp4(x, block_shape)
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale.float(), ref.scale.float())
    assert not q.scale.requires_grad and not q.global_scale.requires_grad
    with torch.no_grad():
        assert torch.equal(quantize_mxfp8(nn.Parameter(x.detach())).data.float(), quantize_mxfp8(x.detach()).data.float())


def test_the_rht_is_differentiable_exactly():
    """The RHT is linear and orthonormal: autograd gives the transposed transform of the gradient."""
    signs = rht_signs(3)
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.randn(4, 32)
    (rht(x, signs) * g).sum().backward()
    m = rht_matrix(signs).float()
    assert torch.allclose(x.grad, (g.reshape(-1, 16) @ m.t()).reshape(4, 32), atol=1e-6)


# -- S11: the GEMM's bias -------------------------------------------------------------------------------------

def _operands():
    return quantize_nvfp4(torch.randn(32, 64)), quantize_nvfp4(torch.randn(48, 64))


@pytest.mark.parametrize("backend", ["reference", "emulated"])
@pytest.mark.parametrize("bias, exc, pattern", [
    (torch.randn(16), ValueError, r"NVFP4 GEMM: bias of shape \(16,\), expected \(48,\)"),
    (torch.randn(1), ValueError, r"bias of shape \(1,\), expected \(48,\)"),  # no broadcast
    (torch.randn(2, 48), ValueError, r"bias of shape \(2, 48\), expected \(48,\)"),
    (torch.ones(48, dtype=torch.int32), TypeError, r"bias must be a floating-point tensor, got torch\.int32"),
    (torch.empty(48, device="meta"), ValueError, r"bias is on meta, the operands on cpu"),
], ids=["short", "one", "2d", "int", "meta"])
def test_a_gemm_bias_that_is_not_one_value_per_column_is_refused(backend, bias, exc, pattern):
    """Checked where each backend reads it, before any kernel runs: the emulated op's wrapper too (no GPU
    needed to see the refusal)."""
    a, b = _operands()
    with pytest.raises(exc, match=pattern):
        nvfp4_gemm(a, b, torch.float32, bias=bias, backend=backend)
    if backend == "emulated" and not bias.is_meta:  # the custom op itself, as torch.compile calls it
        with pytest.raises(exc, match=pattern):
            library.gemm.op(a.data, a.scale, a.global_scale, b.data, b.scale, b.global_scale, bias, a_tiles=False,
                            b_tiles=False, out_dtype=torch.float32, backend="emulated")


def test_a_strided_bias_of_the_right_shape_is_read_as_it_is():
    a, b = _operands()
    bias = torch.randn(96)[::2]
    want = nvfp4_gemm(a, b, torch.float32, bias=bias.contiguous(), backend="reference")
    assert torch.equal(nvfp4_gemm(a, b, torch.float32, bias=bias, backend="reference"), want)


# -- meta inputs with a seed; amaxes beyond float32 ------------------------------------------------------------

@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_stochastic_rounding_of_a_meta_input_with_a_seed_gives_meta_shapes(block_shape):
    """Shape inference: a seed has nothing to seed on the meta device (it used to raise from the generator)."""
    x = torch.empty(32, 64, device="meta")
    q = quantize_nvfp4(x, block_shape, stochastic=True, seed=7)
    want = quantize_nvfp4(torch.zeros(32, 64), block_shape, stochastic=True, seed=7)
    assert q.data.is_meta and q.data.shape == want.data.shape and q.scale.shape == want.scale.shape
    assert rht(x, rht_signs(7, "meta")).shape == x.shape


@pytest.mark.parametrize("amax, pattern", [
    (1e300, r"amax = 1e\+300 is beyond float32's range"),
    (-1e300, r"amax = -1e\+300 is beyond float32's range"),
    (torch.tensor(1e300, dtype=torch.float64), r"amax = 1e\+300 is beyond float32's range"),
    (10**400, r"amax = an integer of 401 digits is beyond float32's range"),
    (1e-300, r"amax = 1e-300 rounds to 0 in float32 but x has non-zero values"),
], ids=["1e300", "-1e300", "float64_tensor", "huge_int", "1e-300"])
def test_an_amax_float32_cannot_hold_is_named(amax, pattern):
    """It used to become inf (every value NaN) or 0, silently."""
    with pytest.raises(ValueError, match=pattern):
        quantize_nvfp4(torch.randn(4, 32), amax=amax)
    if not isinstance(amax, torch.Tensor) and amax != 1e-300:  # a number is checked without a value to read
        with pytest.raises(ValueError, match=pattern):
            quantize_nvfp4(torch.empty(4, 32, device="meta"), amax=amax)
    with pytest.raises(ValueError, match=r"x holds finite values beyond float32's range \(max \|x\| = 1e\+300\)"):
        quantize_nvfp4(torch.tensor([[1e300] + [0.0] * 15], dtype=torch.float64))
