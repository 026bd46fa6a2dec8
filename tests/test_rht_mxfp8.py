"""The random Hadamard transform and MXFP8, against float64 math and TorchAO's MXFP8 (RCEIL)."""

import pytest
import torch

from titan_nvfp4 import quantize_mxfp8, rht, rht_signs
from titan_nvfp4.numerics.rht import hadamard_matrix, rht_matrix


def test_hadamard_is_orthogonal():
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16, dtype=torch.float64))
    with pytest.raises(ValueError):
        hadamard_matrix(12)


def test_rht_matches_float64_matrix_and_is_orthonormal():
    s = rht_signs(123)
    assert set(s.tolist()) == {-1.0, 1.0}
    m = rht_matrix(s)
    assert torch.allclose(m @ m.t(), torch.eye(16, dtype=torch.float64), atol=0, rtol=0)
    x = torch.randn(7, 64)
    y = rht(x, s)
    ref = (x.double().view(-1, 16) @ m).view(7, 64)
    assert ((y.double() - ref).norm() / ref.norm()) < 1e-6


def test_rht_cancels_in_the_wgrad_product():
    """Transforming both operands along the contraction dim leaves dYᵀX unchanged."""
    s = rht_signs(5)
    dy_t, x_t = torch.randn(32, 64, dtype=torch.float64), torch.randn(48, 64, dtype=torch.float64)
    m = rht_matrix(s)
    a = (dy_t.view(-1, 16) @ m).view(32, 64)
    b = (x_t.view(-1, 16) @ m).view(48, 64)
    assert torch.allclose(a @ b.t(), dy_t @ x_t.t(), rtol=1e-12, atol=1e-12)


def test_rht_signs_reproducible_and_seeded():
    assert torch.equal(rht_signs(1), rht_signs(1))
    assert not torch.equal(rht_signs(1), rht_signs(2))


def test_rht_spreads_an_outlier():
    x = torch.zeros(1, 16)
    x[0, 3] = 16.0
    y = rht(x, rht_signs(0))
    assert torch.equal(y.abs(), torch.full((1, 16), 4.0))


def test_rht_rejects_bad_width():
    with pytest.raises(ValueError, match="multiple of 16"):
        rht(torch.randn(2, 24), rht_signs(0))


mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_bit_identical_to_torchao_rceil(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)).to(dtype)
    ours = quantize_mxfp8(x)
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(ours.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))


def test_mxfp8_semantics():
    x = torch.randn(8, 64, dtype=torch.float64)
    q = quantize_mxfp8(x)
    scale = q.scale.view(torch.uint8).to(torch.int32) - 127
    amax = x.abs().view(8, 2, 32).amax(-1)
    # the scale is the smallest power of two that keeps the block max within E4M3's 448
    assert torch.all(amax / torch.exp2(scale.double()) <= 448)
    assert torch.all(amax / torch.exp2(scale.double() - 1) > 448)
    rel = (q.dequantize(torch.float64) - x).norm() / x.norm()
    assert rel < 0.04  # 3 mantissa bits: <= 2^-4 relative per element


def test_mxfp8_edge_cases():
    x = torch.randn(2, 64)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    q = quantize_mxfp8(x)
    d = q.dequantize()
    assert torch.all(d[0, :32] == 0) and torch.isfinite(d[0, 32:]).all()
    assert torch.isnan(d[1, 32:]).all() and torch.isfinite(d[1, :32]).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 48))
