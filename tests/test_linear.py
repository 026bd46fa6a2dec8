"""NVFP4Linear and NVFP4LinearFunction against float64 products of the dequantized operands.

Each reference rebuilds the exact NVFP4 operands the recipe prescribes (see linear_function.py):
  fprop  X 1x16 along K (nearest), W 16x16 (or 1x16) nearest
  dgrad  dY 1x16 along N, stochastic from the layer's generator; W the same 16x16 tiles read
         transposed (or W^T re-quantized 1x16 along N when weight_2d is off)
  wgrad  dY^T and X^T, 16 along tokens (zero-padded), after the RHT; dY continues the generator
and multiplies them in float64. A correct implementation differs from it only by fp32 accumulation
(~1e-7) and, for 16-bit outputs, by the one final rounding.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, build_recipe, quantize_nvfp4, rht, rht_signs
from titan_nvfp4.autograd.linear_function import nvfp4_linear, sr_counter, sr_seed
from titan_nvfp4.ops import nvfp4_gemm
from linear_helpers import assert_matches, reference, rel, wgrad_operand_ref

CPU = torch.device("cpu")


def _recipe(name: str, **over) -> NVFP4Recipe:
    presets = {
        "nvidia_paper": ("nvidia_paper", {}),
        "naive_rtn": ("naive_rtn", {}),
        "rht_off": ("nvidia_paper", {"rht": False}),
        "sr_off": ("nvidia_paper", {"stochastic_rounding": False}),
    }
    preset, fields = presets[name]
    return build_recipe(preset, {**fields, **over})










def run_layer(m: NVFP4Linear, x: torch.Tensor, dy: torch.Tensor | None = None, seed: int = 0):
    """Forward + backward with a random (or given) dY; returns y, dY, dX, dW, db, the SR call index."""
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    y = m(x)
    if dy is None:
        g = torch.Generator().manual_seed(seed)
        dy = torch.randn(y.shape, generator=g).to(y.dtype)
    call = m.sr_calls
    y.backward(dy)
    db = m.bias.grad if m.bias is not None else None
    return y.detach(), dy, x.grad, m.weight.grad, db, call


def make_layer(k, n, bias, dtype, recipe, layer_id=0, seed=0):
    torch.manual_seed(seed)
    m = NVFP4Linear(k, n, bias=bias, recipe=recipe, layer_id=layer_id, dtype=dtype)
    if bias:
        with torch.no_grad():
            m.bias.normal_()  # nn.Linear's init is tiny; make the bias visible in y
    return m


# ------------------------------------------------------------------------------------ 1. the bar

@pytest.mark.parametrize("recipe_name", ["nvidia_paper", "naive_rtn", "rht_off", "sr_off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", [(15,), (3, 11), (2, 16)], ids=["t15", "b3s11_t33", "b2s16_t32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_float64_of_dequantized_operands(recipe_name, dtype, lead, bias):
    recipe = _recipe(recipe_name)
    k, n, layer_id = 64, 48, 7
    m = make_layer(k, n, bias, dtype, recipe, layer_id=layer_id)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*lead, k, generator=g) * torch.exp(torch.randn(*lead, 1, generator=g))).to(dtype)
    y, dy, dx, dw, db, call = run_layer(m, x, seed=2)

    assert call == 0 and m.sr_calls == (1 if recipe.stochastic_rounding else 0)
    assert y.dtype == dtype and y.shape == (*lead, n)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert dw.dtype == dtype and dw.shape == m.weight.shape
    ref = reference(x.reshape(-1, k), m.weight.detach(), m.bias.detach() if bias else None,
                    dy.reshape(-1, n), recipe, layer_id, call)
    assert_matches(y.reshape(-1, n), ref["y"], "y")
    assert_matches(dx.reshape(-1, k), ref["dx"], "dX")
    assert_matches(dw, ref["dw"], "dW")
    if bias:
        assert db.dtype == dtype
        assert_matches(db, ref["db"], "db")
    else:
        assert m.bias is None

    # The GEMMs really are 4-bit: the high-precision product is far away.
    exact = x.double().reshape(-1, k) @ m.weight.double().t()
    if bias:
        exact = exact + m.bias.double()
    assert rel(y.reshape(-1, n), exact) > 1e-3


def test_sr_counter_advances_and_second_call_uses_next_stream():
    recipe = _recipe("nvidia_paper")
    m = make_layer(64, 32, False, torch.float32, recipe, layer_id=2)
    x = torch.randn(40, 64)
    dy = torch.randn(40, 32)
    _, _, dx0, dw0, _, c0 = run_layer(m, x, dy)
    dw0 = dw0.clone()
    _, _, dx1, dw1, _, c1 = run_layer(m, x, dy)
    assert (c0, c1, m.sr_calls) == (0, 1, 2)
    assert not torch.equal(dw0, dw1) and not torch.equal(dx0, dx1)
    ref = reference(x, m.weight.detach(), None, dy, recipe, 2, 1)
    assert_matches(dw1, ref["dw"], "dW call 1")
    assert_matches(dx1, ref["dx"], "dX call 1")


def test_frozen_weight_and_no_grad_input():
    """Only dX when W is frozen (no wgrad operand saved); only dW when x needs no grad."""
    recipe = _recipe("sr_off")
    m = make_layer(64, 32, True, torch.float32, recipe)
    x = torch.randn(20, 64)
    dy = torch.randn(20, 32)
    ref = reference(x, m.weight.detach(), m.bias.detach(), dy, recipe, 0, 0)

    m.weight.requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    m(xr).backward(dy)
    assert m.weight.grad is None
    assert_matches(xr.grad, ref["dx"], "dX (frozen W)")
    assert_matches(m.bias.grad, ref["db"], "db (frozen W)")

    m.weight.requires_grad_(True)
    m.bias.grad = None
    m(x).backward(dy)
    assert_matches(m.weight.grad, ref["dw"], "dW (x without grad)")


# ------------------------------------------------------------- 2. the wgrad RHT, checked independently

def _walsh_hadamard16() -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j): the Sylvester Hadamard matrix, built without the package."""
    idx = torch.arange(16)
    parity = torch.zeros(16, 16, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(4):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).double()


def test_rht_is_the_signed_normalised_hadamard():
    s = rht_signs(11)
    m = torch.diag(s.double()) @ _walsh_hadamard16() / 4.0
    assert torch.allclose(m @ m.t(), torch.eye(16, dtype=torch.float64))
    v = torch.randn(5, 48)
    ref = (v.double().reshape(-1, 16) @ m).reshape(5, 48)
    assert rel(rht(v, s), ref) < 1e-6


@pytest.mark.parametrize("use_rht", [True, False], ids=["rht", "no_rht"])
def test_wgrad_rht_exact_operands_and_true_dw(use_rht):
    recipe = _recipe("sr_off", rht=use_rht, rht_seed=3)
    k, n, t = 64, 32, 200  # 200 tokens: padded to 208
    m = make_layer(k, n, False, torch.float32, recipe, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, k, generator=g)
    x[:, 5] *= 30.0  # an outlier feature channel, what the RHT is for
    dy = torch.randn(t, n, generator=g)
    _, _, _, dw, _, _ = run_layer(m, x, dy)

    true_dw = dy.double().t() @ x.double()
    assert rel(dw, true_dw) < 0.2

    # The exact product of the (transformed) operands.
    ref = reference(x, m.weight.detach(), None, dy, recipe, 0, 0)
    assert rel(dw, ref["dw"]) < 1e-5

    # The operands really were transformed with T = diag(s) H / 4 (independent matrix) before FP4.
    tmat = torch.diag(rht_signs(3).double()) @ _walsh_hadamard16() / 4.0
    xt = F.pad(x.t().double(), (0, 8))
    expect = (xt.reshape(-1, 16) @ tmat).reshape(k, -1) if use_rht else xt
    x_col = ref["x_col"].dequantize().double()
    assert x_col.shape == (k, 208)
    assert rel(x_col, expect) < 0.15  # FP4 error only
    other = (xt.reshape(-1, 16) @ tmat).reshape(k, -1) if not use_rht else xt
    assert rel(x_col, other) > 0.5  # and not the other variant


# ------------------------------------------------------------------ 3. stochastic rounding statistics

@pytest.mark.parametrize("use_rht", [True, False], ids=["rht", "no_rht"])
def test_sr_mean_over_calls_converges_to_unrounded_dy_product(use_rht):
    recipe = _recipe("nvidia_paper", rht=use_rht)
    k, n, t, calls = 32, 32, 48, 200
    m = make_layer(k, n, False, torch.float32, recipe, layer_id=1, seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, k, generator=g)
    dy = torch.randn(t, n, generator=g)
    xr = x.clone().requires_grad_(True)
    acc = torch.zeros(n, k, dtype=torch.float64)
    first = None
    for i in range(calls):
        m.weight.grad = None
        m(xr).backward(dy)
        if first is None:
            first = m.weight.grad.clone()
        acc += m.weight.grad.double()
    assert m.sr_calls == calls
    mean = acc / calls

    signs = rht_signs(recipe.rht_seed) if use_rht else None
    dy_t = F.pad(dy.t(), (0, (-t) % 16))
    if signs is not None:
        dy_t = rht(dy_t, signs)
    x_col = wgrad_operand_ref(x, signs).dequantize().double()
    target = dy_t.double() @ x_col.t()  # dY unquantized, x as the layer saved it
    err_one, err_mean = rel(first, target), rel(mean, target)
    assert err_one > 0.02  # a single call is visibly noisy
    assert err_mean < 0.35 * err_one, (err_mean, err_one)


def test_sr_reproducible_per_layer_and_seeded():
    x = torch.randn(32, 64)
    dy = torch.randn(32, 32)

    def grads(**over):
        layer_id = over.pop("layer_id", 5)
        m = make_layer(64, 32, False, torch.float32, _recipe("nvidia_paper", **over), layer_id=layer_id, seed=8)
        _, _, dx, dw, _, _ = run_layer(m, x, dy)
        return dx, dw

    dx_a, dw_a = grads()
    dx_b, dw_b = grads()
    assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)
    dx_c, dw_c = grads(sr_seed=1)
    assert not torch.equal(dw_a, dw_c) and not torch.equal(dx_a, dx_c)
    dx_d, dw_d = grads(layer_id=6)
    assert not torch.equal(dw_a, dw_d) and not torch.equal(dx_a, dx_d)


# --------------------------------------------------------------------- 4. what forward saves

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_activations_are_nvfp4(dtype):
    m = make_layer(64, 32, True, dtype, _recipe("nvidia_paper"))
    x = torch.randn(2, 24, 64, dtype=dtype, requires_grad=True)  # 48 tokens: x numel 3072, W numel 2048
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        y = m(x)
    assert saved, "nothing saved?"
    y.backward(torch.randn_like(y))  # the saved set is enough for backward
    x2d_shapes = {tuple(x.shape), (48, 64), (64, 48)}
    other_bytes = 0
    for t in saved:
        if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn,):
            if t.dim() == 0:
                assert t.dtype == torch.float32  # a global scale
                continue
            if t.data_ptr() == m.rht_signs.data_ptr():  # the 16 RHT signs
                continue
            assert t.data_ptr() == m.weight.data_ptr() and t.shape == m.weight.shape, (
                f"high-precision tensor {t.dtype} {tuple(t.shape)} saved")
            assert t.numel() != x.numel() and tuple(t.shape) not in x2d_shapes
            continue
        assert t.dtype in (torch.uint8, torch.float8_e4m3fn), t.dtype
        other_bytes += t.numel() * t.element_size()
    # codes + scales of W (16x16) and of x's wgrad operand (64 x 48 tokens): ~0.5 byte/element
    assert other_bytes <= (m.weight.numel() + 64 * 48) * (0.5 + 1 / 16)
    assert other_bytes < x.numel() * x.element_size() / 2


# ------------------------------------------------------------------------ 5. non-finite inputs

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_input_row_gives_nan_not_garbage(bad):
    m = make_layer(64, 32, True, torch.float32, _recipe("nvidia_paper"))
    x = torch.randn(4, 8, 64)
    x[1, 3, 17] = bad
    y = m(x).detach()
    assert torch.isnan(y[1, 3]).all(), "the row holding the bad value must be NaN"
    # Observed and documented (numerics/nvfp4.py): a non-finite amax makes the global scale NaN, so the
    # whole output is NaN, not only the bad row's blocks. No row may come out finite.
    assert torch.isnan(y).all()


def test_nonfinite_grad_gives_nan_grads():
    m = make_layer(64, 32, False, torch.float32, _recipe("nvidia_paper"))
    x = torch.randn(32, 64)
    dy = torch.randn(32, 32)
    dy[4, 9] = float("nan")
    _, _, dx, dw, _, _ = run_layer(m, x, dy)
    assert torch.isnan(dx[4]).all() and torch.isnan(dw).any()
    assert not torch.isfinite(dx).any() and not torch.isfinite(dw).any()


# -------------------------------------------------------------------- 6. dims not multiple of 16

def test_bad_dims_rejected_with_name():
    with pytest.raises(ValueError) as e:
        NVFP4Linear(24, 32)
    assert "NVFP4Linear" in str(e.value) and "in_features=24" in str(e.value)
    with pytest.raises(ValueError) as e:
        NVFP4Linear(32, 40, name="layers.0.attention.wq")
    assert "layers.0.attention.wq" in str(e.value) and "out_features=40" in str(e.value)
    with pytest.raises(ValueError) as e:
        NVFP4Linear.from_linear(nn.Linear(32, 20), _recipe("nvidia_paper"), name="layers.3.mlp.w2")
    msg = str(e.value)
    assert "layers.3.mlp.w2" in msg and "out_features=20" in msg and "in_features" not in msg


# --------------------------------------------------------------------------- 7. meta device

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_from_linear_on_meta_then_materialize(bias):
    recipe = _recipe("nvidia_paper")
    with torch.device("meta"):
        lin = nn.Linear(64, 32, bias=bias)
    params = dict(lin.named_parameters())
    m = NVFP4Linear.from_linear(lin, recipe, layer_id=4, name="layers.1.feed_forward.w1")
    assert isinstance(m, nn.Linear) and (m.in_features, m.out_features) == (64, 32)
    assert m.weight is params["weight"] and m.weight.is_meta
    if bias:
        assert m.bias is params["bias"] and m.bias.is_meta
    else:
        assert m.bias is None
    assert all(p.is_meta for p in m.parameters())
    assert list(m.state_dict()) == list(lin.state_dict())
    assert m.layer_id == 4 and m.recipe is recipe

    assert m.sr_counter.is_meta and m.rht_signs.is_meta

    m.to_empty(device="cpu")
    m.reset_parameters()
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in m.parameters())
    # the non-persistent buffers are rebuilt from the recipe, not left as to_empty's garbage
    assert m.sr_counter.tolist() == [sr_seed(recipe, 4, 0), 0]
    assert torch.equal(m.rht_signs, rht_signs(recipe.rht_seed))
    x = torch.randn(2, 16, 64, requires_grad=True)
    y = m(x)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert torch.isfinite(m.weight.grad).all() and m.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_state_dict_roundtrip_with_nn_linear(bias):
    src = nn.Linear(64, 32, bias=bias)
    m = NVFP4Linear(64, 32, bias=bias, recipe=_recipe("nvidia_paper"))
    assert list(m.state_dict()) == list(src.state_dict())
    m.load_state_dict(src.state_dict(), strict=True)
    assert torch.equal(m.weight, src.weight)
    back = nn.Linear(64, 32, bias=bias)
    back.load_state_dict(m.state_dict(), strict=True)
    for k, v in src.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


# ----------------------------------------------------------------------------- 8. autocast

def test_autocast_bf16_output_and_fp32_accumulation():
    """Under autocast X is quantized as F.linear would multiply it, cast to the autocast dtype (as TorchAO's
    Float8Linear does); the weight from its fp32 master; the output in bf16 from an fp32 accumulator."""
    recipe = _recipe("nvidia_paper")
    m = make_layer(64, 48, True, torch.float32, recipe, layer_id=3)
    x = torch.randn(2, 20, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    x2d = x.detach().reshape(-1, 64).to(torch.bfloat16)
    assert not torch.equal(quantize_nvfp4(x2d, (1, 16)).global_scale,  # else the test could not tell the two
                           quantize_nvfp4(x.detach().reshape(-1, 64), (1, 16)).global_scale)
    xq, wq = quantize_nvfp4(x2d, (1, 16)), quantize_nvfp4(m.weight.detach(), (16, 16))
    expect = nvfp4_gemm(xq, wq, out_dtype=torch.bfloat16, bias=m.bias.detach())  # outside autocast
    assert torch.equal(y.detach().reshape(-1, 48), expect)
    ref = xq.dequantize().double() @ wq.dequantize().double().t() + m.bias.double()
    assert_matches(y.detach().reshape(-1, 48), ref, "y under autocast")

    dy = torch.randn(y.shape).to(torch.bfloat16)
    call = m.sr_calls
    y.backward(dy)
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
    r = reference(x2d, m.weight.detach(), m.bias.detach(), dy.reshape(-1, 48), recipe, 3, call)
    # dX leaves the GEMM in X's autocast dtype, then its cast's backward takes it to fp32 (as for F.linear)
    assert torch.equal(x.grad, x.grad.to(torch.bfloat16).float())
    assert_matches(x.grad.reshape(-1, 64).to(torch.bfloat16), r["dx"], "dX under autocast")
    assert_matches(m.weight.grad, r["dw"], "dW under autocast")


# ------------------------------------------------------------------ edge cases nn.Linear handles

def test_empty_token_batch_like_nn_linear():
    m = make_layer(64, 32, True, torch.float32, _recipe("nvidia_paper"))
    x = torch.randn(2, 0, 64, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 0, 32)
    y.backward(torch.zeros_like(y))
    assert x.grad.shape == x.shape and torch.count_nonzero(m.weight.grad) == 0


def test_no_wgrad_operand_without_autograd(monkeypatch):
    import titan_nvfp4.autograd.linear_function as lf

    calls = []
    real = lf.quantize_activation
    monkeypatch.setattr(lf, "quantize_activation", lambda x2d, need_col, *a, **k: (calls.append(need_col), real(x2d, need_col, *a, **k))[1])
    m = make_layer(64, 32, False, torch.float32, _recipe("nvidia_paper"))
    x = torch.randn(16, 64)
    m(x)  # grad mode on, W requires grad: the operand is needed
    with torch.no_grad():
        m(x.clone())  # fresh tensors: the same one would reuse its quantization (sibling_x.py)
    with torch.inference_mode():
        m(x.clone())
    assert calls == [True, False, False]


def test_backward_runs_the_gemm_order_with_the_lower_peak(monkeypatch):
    """wgrad before dgrad where that leaves less memory (many tokens), dgrad first otherwise; same
    gradients either way."""
    from titan_nvfp4.autograd import linear_function as lf

    assert lf._wgrad_first(16384, 14336, 4096) and lf._wgrad_first(32768, 5632, 2048)
    # Xᵀ is staged whole for wgrad (staged_for_gemms): a wide output's dY then goes first, through dgrad
    assert not lf._wgrad_first(2048, 4096, 14336) and not lf._wgrad_first(32768, 2048, 5632)
    recipe = NVFP4Recipe()
    torch.manual_seed(0)
    w = torch.randn(48, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    grads, asked = [], []
    for first in (True, False):
        monkeypatch.setattr(lf, "_wgrad_first", lambda m, k, n, first=first: asked.append((m, k, n)) or first)
        x.grad = w.grad = None
        nvfp4_linear(x, w, None, recipe, counter=sr_counter(recipe, 0)).square().sum().backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    assert asked == [(32, 64, 48)] * 2
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
