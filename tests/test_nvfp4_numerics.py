"""NVFP4 reference quantizer against TorchAO's (an implementation nobody here wrote), a NumPy twin,
float64 math, and adversarial inputs."""

import math

import numpy as np
import pytest
import torch

from titan_nvfp4 import quantize_nvfp4
from titan_nvfp4.numerics.formats import (
    E2M1_GRID,
    e2m1_decode,
    e2m1_encode_rne,
    pack_nibbles,
    unpack_nibbles,
)
from titan_nvfp4.numerics.nvfp4 import global_encode_scale

import nvfp4_twin

torchao_nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def _inputs(seed: int):
    """Fresh random, heavy-tailed and row-scaled tensors (rows x 256)."""
    g = torch.Generator().manual_seed(seed)
    yield "normal", torch.randn(64, 256, generator=g)
    yield "student_t", torch.distributions.StudentT(1.5).sample((64, 256)).clamp(-1e4, 1e4)
    yield "rowscaled", torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2)
    yield "outliers", torch.randn(64, 256, generator=g).index_put_(
        (torch.randint(0, 64, (20,), generator=g), torch.randint(0, 256, (20,), generator=g)), torch.tensor(300.0)
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# ---------------------------------------------------------------- the independent oracle: TorchAO


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_identical_to_torchao_with_power_of_two_global_scale(seed):
    """With S a power of two both formulas are exact rewrites of each other, so codes and scales
    must match bit for bit wherever TorchAO does not clamp the block scale (it floors block scales
    at 2^-6, the smallest normal E4M3; we, like Transformer Engine, keep E4M3 subnormals)."""
    for name, x in _inputs(seed):
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            true_amax = xd.float().abs().max()
            k = math.floor(math.log2(2688.0 / float(true_amax)))
            amax = 2688.0 * 2.0**-k  # >= true amax, S = 2^k exactly
            ours = quantize_nvfp4(xd, amax=amax)
            assert float(global_encode_scale(torch.tensor(amax))) == 2.0**k
            s_ao, d_ao = torchao_nvfp4.nvfp4_quantize(xd, per_tensor_scale=torch.tensor(amax / 2688.0))
            normal = ours.scale.float() >= 2.0**-6
            assert normal.float().mean() > 0.5, name
            assert torch.equal(_bytes(s_ao)[normal], _bytes(ours.scale)[normal]), name
            rows = d_ao.view(64, 16, 8)
            assert torch.equal(rows[normal], ours.data.view(64, 16, 8)[normal]), name


@pytest.mark.parametrize("seed", [3, 4])
def test_matches_torchao_with_natural_amax(seed):
    """With the natural amax TorchAO divides by amax/2688 where we multiply by 2688/amax; on these
    inputs no block lands on an E4M3 or E2M1 rounding boundary, so results agree exactly on every
    block TorchAO does not clamp."""
    for name, x in _inputs(seed):
        ours = quantize_nvfp4(x)
        s_ao, d_ao = torchao_nvfp4.nvfp4_quantize(
            x, per_tensor_scale=torchao_nvfp4.per_tensor_amax_to_scale(x.abs().max())
        )
        normal = ours.scale.float() >= 2.0**-6
        assert torch.equal(_bytes(s_ao)[normal], _bytes(ours.scale)[normal]), name
        assert torch.equal(d_ao.view(64, 16, 8)[normal], ours.data.view(64, 16, 8)[normal]), name


def test_column_blocks_match_torchao_on_transpose():
    """(16, 1) blocks along dim 0 are the 1x16 quantization of xᵀ."""
    x = torch.randn(128, 48)
    amax = 2688.0 * 2.0 ** -math.floor(math.log2(2688.0 / float(x.abs().max())))
    ours = quantize_nvfp4(x, block_shape=(16, 1), amax=amax)
    s_ao, d_ao = torchao_nvfp4.nvfp4_quantize(x.t().contiguous(), per_tensor_scale=torch.tensor(amax / 2688.0))
    assert ours.transposed and ours.data.shape == (48, 64)
    assert torch.equal(_bytes(s_ao), _bytes(ours.scale))
    assert torch.equal(d_ao, ours.data)


# ---------------------------------------------------------------- the NumPy twin (all block shapes)


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 1), (16, 16)])
def test_bit_identical_to_numpy_twin(block_shape):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 64, generator=g) * torch.exp(torch.randn(32, 1, generator=g) * 3)
    x[0, :16] = 0.0  # a zero block
    x[5, 16:32] *= 1e-9  # a block whose scale underflows E4M3
    ours = quantize_nvfp4(x, block_shape=block_shape)
    storage = x.t().contiguous() if block_shape == (16, 1) else x
    twin = nvfp4_twin.quantize_16x16 if block_shape == (16, 16) else nvfp4_twin.quantize_1x16
    codes, scales, s_dec = twin(storage.numpy())
    assert np.array_equal(ours.codes().numpy(), codes)
    got_scales = ours.row_scales() if block_shape == (16, 16) else ours.scale
    assert np.array_equal(got_scales.view(torch.uint8).numpy(), scales)
    assert float(ours.global_scale) == float(s_dec)


# ---------------------------------------------------------------- float64 semantics


def test_dequantize_error_is_bounded_by_half_a_step():
    """Each element decodes to within half an E2M1 step of x·r_b, i.e. |x̂ - x| <= gap(b)/2 · e_b/S,
    bounded above by 1/6 of... checked here as: x̂ is the nearest grid value times the block scale."""
    x = torch.randn(16, 128, dtype=torch.float64)
    q = quantize_nvfp4(x)
    scale = q.scale.double().repeat_interleave(16, 1) * q.global_scale.double()
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    cands = torch.cat((grid, -grid)) * scale.unsqueeze(-1)
    best = (cands - x.unsqueeze(-1)).abs().min(-1).values
    err = (q.dequantize(torch.float64) - x).abs()
    # nearest-even may pick the other neighbour only at exact ties; fp32 factor rounding adds 1e-6 rel.
    assert torch.all(err <= best + 1e-6 * x.abs() + 1e-30)


def test_rne_ties_go_to_even_mantissa():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0])
    assert torch.equal(e2m1_decode(e2m1_encode_rne(mids)), want)
    assert torch.equal(e2m1_decode(e2m1_encode_rne(-mids)), -want)
    # through the quantizer: amax 2688 gives S = 1, a block max of 6 gives e_b = 1 and r_b = 1
    block = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0])
    q = quantize_nvfp4(block.view(1, 16), amax=2688.0)
    assert float(q.scale.float()) == 1.0
    assert torch.equal(q.dequantize().view(-1), torch.tensor(
        [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 0.0]))


def test_exact_values_roundtrip():
    """Values already on the NVFP4 grid decode exactly (scale 1, S = 1)."""
    vals = torch.tensor(E2M1_GRID * 2).view(1, 16) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    vals[0, 7] = 6.0
    q = quantize_nvfp4(vals, amax=2688.0)
    assert torch.equal(q.dequantize(), vals)


def test_pack_unpack_roundtrip_and_order():
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (8, 16)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_nibbles(packed), codes)


# ---------------------------------------------------------------- edge cases


def test_all_zero_tensor():
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert float(q.global_scale) == 1.0
    assert torch.all(q.data == 0) and torch.all(q.scale.float() == 0)
    assert torch.equal(q.dequantize(), torch.zeros(4, 32))


def test_zero_block_and_underflowing_block_decode_to_zero():
    x = torch.randn(2, 48)
    x[0, 16:32] = 0.0
    x[1, :16] = 1e-12 * torch.randn(16)  # amax_b·S/6 far below the smallest E4M3 subnormal
    q = quantize_nvfp4(x)
    deq = q.dequantize()
    assert float(q.scale[0, 1].float()) == 0.0 and float(q.scale[1, 0].float()) == 0.0
    assert torch.all(deq[0, 16:32] == 0) and torch.all(deq[1, :16] == 0)
    assert (deq[0, :16] - x[0, :16]).norm() / x[0, :16].norm() < 0.2


@pytest.mark.parametrize("seed", range(20))
def test_subnormal_block_scales_are_used(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 32, generator=g)
    x[0, :16] *= 4 / x[0, :16].abs().max()  # tensor amax 4: S = 6·448/4 = 672
    x[0, 16:] *= 8e-5 / x[0, 16:].abs().max()  # block amax 8e-5: e_b = 8e-5·672/6 = 0.00896, below 2^-6
    q = quantize_nvfp4(x)
    assert float(q.scale[0, 1].float()) == 5 * 2.0**-9  # the nearest E4M3 subnormal, not floored to 2^-6
    assert (q.dequantize()[0, 16:] - x[0, 16:]).norm() / x[0, 16:].norm() < 0.5


@pytest.mark.parametrize("mag", [1e-36, 1e-30, 1e-8, 1e8, 1e30, 1e37])
def test_tiny_and_huge_magnitudes(mag):
    x = torch.randn(8, 64) * mag
    q = quantize_nvfp4(x)
    rel = (q.dequantize().double() - x.double()).norm() / x.double().norm()
    assert torch.isfinite(q.dequantize()).all() and rel < 0.15


def test_amax_smaller_than_data_saturates():
    x = torch.tensor([[10.0] + [1.0] * 15])
    q = quantize_nvfp4(x, amax=1.0)  # S = 2688: the block scale 10·2688/6 saturates at 448
    assert float(q.scale.float()) == 448.0
    assert float(q.dequantize()[0, 0]) == pytest.approx(6 * 448 / 2688.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_decodes_to_nan(bad):
    x = torch.randn(4, 32)
    x[2, 5] = bad
    q = quantize_nvfp4(x)
    deq = q.dequantize()
    assert torch.isnan(deq[2, :16]).all()  # the bad block is NaN, never finite garbage
    assert torch.isnan(q.global_scale)  # and so, through the global scale, is the whole tensor
    # with an all-reduced finite amax passed in, only the bad block is poisoned
    q2 = quantize_nvfp4(x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), amax=None)
    assert torch.isfinite(q2.dequantize()).all()
    q3 = quantize_nvfp4(x, amax=float(x.nan_to_num(0, 0, 0).abs().max()))
    deq3 = q3.dequantize()
    assert torch.isnan(deq3[2, :16]).all() and torch.isfinite(deq3[2, 16:]).all() and torch.isfinite(deq3[:2]).all()


def test_bad_shapes_and_arguments_are_rejected():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_nvfp4(torch.randn(24, 32), block_shape=(16, 16))
    with pytest.raises(ValueError, match="dim 0"):
        quantize_nvfp4(torch.randn(24, 32), block_shape=(16, 1))
    with pytest.raises(ValueError, match="block_shape"):
        quantize_nvfp4(torch.randn(16, 32), block_shape=(32, 32))
    with pytest.raises(TypeError):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-negative"):
        quantize_nvfp4(torch.randn(4, 16), amax=-1.0)


def test_nd_input_keeps_shape():
    x = torch.randn(2, 3, 5, 32, dtype=torch.bfloat16)
    q = quantize_nvfp4(x)
    assert q.data.shape == (30, 16) and q.scale.shape == (30, 2)
    assert q.dequantize(torch.bfloat16).shape == x.shape


# ---------------------------------------------------------------- 2D blocks


def test_16x16_of_w_and_wt_are_exact_transposes():
    w = torch.randn(64, 96) * torch.exp(torch.randn(64, 1))
    qw = quantize_nvfp4(w, block_shape=(16, 16))
    qwt = quantize_nvfp4(w.t().contiguous(), block_shape=(16, 16))
    assert torch.equal(qw.dequantize().t(), qwt.dequantize())
    assert torch.equal(qw.t().dequantize(), qwt.dequantize())
    assert torch.equal(qw.t().data, qwt.data) and torch.equal(_bytes(qw.t().scale), _bytes(qwt.scale))


def test_1x16_of_w_and_wt_differ():
    """The reason for 2D weight blocks: 1x16 blocks do not commute with the transpose."""
    w = torch.randn(64, 96)
    a = quantize_nvfp4(w).dequantize().t()
    b = quantize_nvfp4(w.t().contiguous()).dequantize()
    assert not torch.equal(a, b)


# ---------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased():
    """E[SR(x)] = x for every element inside its block's range; the block max itself can exceed
    6·e_b/S by up to half an E4M3 step (e_b rounds to nearest), and saturates there, as in TE."""
    x = torch.randn(1, 64, dtype=torch.float64).float()
    amax = float(x.abs().max())
    g = torch.Generator().manual_seed(0)
    n = 4000
    acc = torch.zeros(1, 64, dtype=torch.float64)
    for _ in range(n):
        acc += quantize_nvfp4(x, stochastic=True, generator=g, amax=amax).dequantize(torch.float64)
    mean = acc / n
    q = quantize_nvfp4(x)
    step = q.scale.double().repeat_interleave(16, 1) * float(q.global_scale)  # e_b/S per element
    target = x.double().sign() * torch.minimum(x.double().abs(), 6 * step)
    rne_err = (q.dequantize(torch.float64) - target).abs().max()
    # one draw's error is at most one grid gap (<= 2·step); the mean's is ~gap/(2·sqrt(n))
    assert torch.all((mean - target).abs() < 6 * 2 * step / math.sqrt(n))
    assert (mean - target).abs().max() < rne_err / 4


def test_stochastic_rounding_reproducible_and_seed_dependent():
    x = torch.randn(32, 64)
    a = quantize_nvfp4(x, stochastic=True, seed=1)
    b = quantize_nvfp4(x, stochastic=True, seed=1)
    c = quantize_nvfp4(x, stochastic=True, seed=2)
    assert torch.equal(a.data, b.data)
    assert not torch.equal(a.data, c.data)
    assert torch.equal(_bytes(a.scale), _bytes(c.scale))  # scales are always nearest


def test_stochastic_rounding_stays_on_neighbouring_grid_points():
    x = torch.randn(16, 64)
    q_rne = quantize_nvfp4(x)
    q_sr = quantize_nvfp4(x, stochastic=True, seed=3)
    v = x.view(16, 4, 16) * (1.0 / (q_rne.scale.float() * q_rne.global_scale)).unsqueeze(-1)
    lo = torch.tensor(E2M1_GRID)[(v.abs().unsqueeze(-1) >= torch.tensor(E2M1_GRID)[1:]).sum(-1)]
    got = e2m1_decode(q_sr.codes()).view(16, 4, 16).abs()
    assert torch.all((got == lo) | (got > lo))
    assert torch.all(got - lo <= 2.0)
