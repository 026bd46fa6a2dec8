"""Eager sibling NVFP4 Linears on one X (wq, wk, wv) quantize it once (titan_nvfp4/autograd/sibling_x.py), with the bits
each layer computes on its own; any change to X, its object, the signs or the settings quantizes afresh, and the
remembered operands go when X does. Only an activation of the running forward is shared (as a norm's output is);
tests/test_faults_api.py refills inputs behind the version counter's back."""

import gc
import sys

import pytest
import torch

import titan_nvfp4.autograd.linear_function as lf
import titan_nvfp4.autograd.sibling_x as sx
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.ops.backends import interpreting
from sibling_helpers import DEV, qkv_layers

_NEEDS_KERNELS = pytest.mark.skipif(
    DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture
def counted(monkeypatch):
    """The number of X quantizations (lf.quantize_activation calls) so far; sharing starts from nothing."""
    calls = []
    real = lf.quantize_activation

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(lf, "quantize_activation", counting)
    sx.forget_shared_x()
    yield calls
    sx.forget_shared_x()


def _activation(x: torch.Tensor) -> torch.Tensor:
    """x as the siblings read it in a model: an activation of this forward (a norm's output), not a leaf."""
    return x.detach().requires_grad_(True) * 1.0


def _step(m, x, dy, autocast=False):
    xi = x.clone().requires_grad_(True)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
        y = m(xi * 1.0)  # an activation, as a norm's output: what siblings share
    y.backward(dy.to(y.dtype))
    out = [y.detach(), xi.grad] + [layer.weight.grad.clone() for layer in (m.q, m.k, m.v)]
    for layer in (m.q, m.k, m.v):
        layer.weight.grad = None
    return out


_FP32_EMULATED_SLOW = pytest.mark.slow(reason="5 s on 2 cores; the emulated backend under bf16 autocast in CI")


@pytest.mark.parametrize("autocast, backend", [
    (False, "reference"), (True, "reference"),
    pytest.param(False, "emulated", marks=[_NEEDS_KERNELS, _FP32_EMULATED_SLOW]),
    pytest.param(True, "emulated", marks=_NEEDS_KERNELS)],
    ids=["fp32-reference", "fp32_under_bf16_autocast-reference", "fp32-emulated", "fp32_under_bf16_autocast-emulated"])
def test_siblings_quantize_x_once_with_each_layers_bits(backend, autocast, counted, monkeypatch):
    """Under autocast the one quantization is of X's bf16 cast, made once for the three layers. On the emulated
    backend the three wgrads stage the one saved Xᵀ once."""
    staged = []
    real_stage = lf.staged_for_gemms
    monkeypatch.setattr(lf, "staged_for_gemms", lambda t, b: staged.append(b) or real_stage(t, b))
    m = qkv_layers(NVFP4Recipe(gemm_backend=backend))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g).to(DEV)
    dy = torch.randn(32, 128, generator=g).to(DEV)
    counters = [layer.sr_counter.clone() for layer in (m.q, m.k, m.v)]
    shared = _step(m, x, dy, autocast)
    assert counted == [torch.bfloat16 if autocast else torch.float32], counted
    assert len(staged) == (1 if backend == "emulated" else 3), staged  # the reference GEMM reads codes
    for layer, c in zip((m.q, m.k, m.v), counters):  # the SR streams replay: the same dY draws
        layer.sr_counter.copy_(c)
    monkeypatch.setattr(lf, "shared_x_operands", lambda x, signs, key, quantize, layer: quantize())
    monkeypatch.setattr(lf, "shared_staging", lambda codes, scales, key, stage: stage())
    alone = _step(m, x, dy, autocast)
    assert len(counted) == 4 and len(staged) == (4 if backend == "emulated" else 6)
    for i, (a, b) in enumerate(zip(shared, alone)):
        assert torch.equal(a, b), f"result {i} differs"


def test_a_changed_or_new_x_and_other_settings_quantize_afresh(counted):
    recipe = NVFP4Recipe(gemm_backend="reference")
    m = qkv_layers(recipe)
    x = _activation(torch.randn(32, 64, device=DEV))
    m.q(x), m.k(x)
    assert len(counted) == 1
    with torch.no_grad():
        x.mul_(2)  # in place: the version counter moves
    y = m.v(x)
    assert len(counted) == 2
    fresh = NVFP4Linear(64, 32, bias=False, recipe=recipe, layer_id=7).to(DEV)
    with torch.no_grad():
        fresh.weight.copy_(m.v.weight)
    assert torch.equal(y, fresh(x.clone())) and len(counted) == 3  # an equal X in another tensor
    other = NVFP4Linear(64, 32, bias=False, recipe=NVFP4Recipe(gemm_backend="reference", rht_seed=5),
                        layer_id=8).to(DEV)
    other(x)
    assert len(counted) == 4, "another signs tensor: afresh"
    other(x)
    assert len(counted) == 5, "the same layer reading one X again (a new step, or a repeat): afresh"
    m.q(x)
    assert len(counted) == 6, "back to the first signs tensor"
    m.k.weight.requires_grad_(False)  # no wgrad: X's wgrad operand is not made, a different quantization
    m.k(x)
    assert len(counted) == 7


def test_the_remembered_operands_go_with_x(counted):
    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    x = _activation(torch.randn(32, 64, device=DEV))
    y = m.q(x)
    assert sx._last["x"].x_ref() is x
    del x, y  # y's graph holds x's
    gc.collect()
    assert "x" not in sx._last


def test_x_freed_at_interpreter_exit_raises_nothing(counted, monkeypatch):
    # at exit the module's globals become None before the last X is freed: its callback must not read them
    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    x = _activation(torch.randn(32, 64, device=DEV))
    y = m.q(x)
    remembered = sx._last
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    sx._last = None
    try:
        del x, y
        gc.collect()
    finally:
        sx._last = remembered
    assert raised == [] and "x" not in remembered


def test_compiling_and_amax_history_do_not_share(counted):
    """An X quantized with given amaxes (amax history, tensor parallelism) is not remembered."""
    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    x = _activation(torch.randn(32, 64, device=DEV))
    amax = torch.stack([x.detach().abs().max(), x.detach().abs().max()])
    lf.nvfp4_linear(x, m.q.weight, None, m.q.recipe, m.q.sr_counter, m.q.rht_signs, x_amax=amax)
    lf.nvfp4_linear(x, m.k.weight, None, m.k.recipe, m.k.sr_counter, m.k.rht_signs, x_amax=amax)
    assert len(counted) == 2 and "x" not in sx._last


def test_inference_tensors_are_quantized_each_time(counted):
    """An inference-mode X has no version counter to check: each sibling quantizes it."""
    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    with torch.inference_mode():
        x = torch.randn(32, 64, device=DEV)
        m.q(x), m.k(x)
    assert len(counted) == 2 and "x" not in sx._last


def test_under_a_dispatch_mode_every_call_quantizes(counted):
    """A dispatch mode (selective activation checkpointing, FLOP counters) sees each layer's own X quantization."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    x = _activation(torch.randn(32, 64, device=DEV))
    with Passthrough():
        m.q(x), m.k(x)
    assert len(counted) == 2 and "x" not in sx._last


def test_leaves_and_tensors_under_no_grad_are_quantized_by_every_layer(counted):
    """A leaf (an input batch, a buffer a loop refills, a numpy array) or any X under no_grad has no autograd
    provenance in this forward: every sibling quantizes it, also a leaf that requires grad and a view of one."""
    m = qkv_layers(NVFP4Recipe(gemm_backend="reference"))
    leaf = torch.randn(32, 64, device=DEV, requires_grad=True)
    m(leaf)
    m(leaf.view(32, 64))
    with torch.no_grad():
        m(leaf * 1.0)
    assert len(counted) == 9 and "x" not in sx._last
    m(leaf * 1.0)  # an activation: one quantization for the three
    assert len(counted) == 10
