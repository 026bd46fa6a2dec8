"""MS-EDEN, the reference quantizer of titan_nvfp4/numerics/ms_eden.py (Quartet II's backward quantizer):
unbiasedness, error against our stochastic rounding, the scale headroom, determinism, and agreement with
the authors' own quantizer (tests/data/quartet2_ms_eden.pt). Also issue 64's question whether our SR
should get a scale headroom: measured here on prototypes (the production SR path is unchanged)."""

from pathlib import Path

import pytest
import torch

from titan_nvfp4.numerics.formats import e2m1_decode, e2m1_encode_stochastic, to_e4m3_saturating
from titan_nvfp4.numerics.ms_eden import (ROLES, MS_EDEN_SCALE_OVERRIDE, e2m1_encode_away, ms_eden_generator,
                                          ms_eden_parts, ms_eden_seed, ms_eden_signs, quantize_ms_eden,
                                          stochastic_e4m3)
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
from titan_nvfp4.numerics.rht import hadamard_matrix, rht, rht_matrix

FIXTURE = Path(__file__).parent / "data" / "quartet2_ms_eden.pt"


pytestmark = pytest.mark.usefixtures("one_thread")


def _gaussian(rows, cols, seed):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _student_t3(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, generator=g)
    chi2 = 2.0 * torch._standard_gamma(torch.full((rows, cols), 1.5), generator=g)  # chi-square, 3 dof
    return z / torch.sqrt(chi2 / 3.0)


def _rel_mse(approx, x):
    """Relative squared error per row, averaged over the rows (the authors' metric: one huge element of a
    heavy-tailed input does not dominate it)."""
    d, x = approx.double(), x.double()
    return float((((d - x) ** 2).sum(-1) / (x**2).sum(-1)).mean())


def _derotate(v, signs):
    """The inverse RHT along the last dim: T = H·diag(s)/√n is orthonormal and H symmetric, so Tᵀ = diag(s)·H/√n."""
    n = signs.numel()
    back = rht(v, torch.ones(n))
    return (back.view(*v.shape[:-1], -1, n) * signs).reshape(v.shape)


def _eden_estimate(x, seed, step, group=128):
    """One MS-EDEN draw of x as training makes it at ``step``: signs and scale draws from (seed, step)."""
    signs = ms_eden_signs(seed, step, "dgrad_signs", size=group)
    q = quantize_ms_eden(x, signs, generator=ms_eden_generator(seed, step, "dgrad_dy"))
    return _derotate(q.dequantize(), signs)


def _eden_mean_error(x, n, seed, group=128, chunk=500):
    """(relative error of the mean of n MS-EDEN draws of x, mean relative MSE of one draw). The draws are
    batched: each one's signs and scale draws come from its own step, as ms_eden_signs(seed, step) and
    ms_eden_generator(seed, step, role) make them, and each draw has its own tensor amax."""
    rows, cols = x.shape
    total = torch.zeros_like(x, dtype=torch.float64)
    sq = 0.0
    for start in range(0, n, chunk):
        steps = range(start, min(n, start + chunk))
        signs = torch.stack([ms_eden_signs(seed, t, "dgrad_signs", size=group) for t in steps])
        b = len(steps)
        xs = (x.view(rows, cols // group, group) * signs[:, None, None, :]).reshape(b, rows, cols)
        v = rht(xs, torch.ones(group))  # the RHT with each draw's signs, applied above
        codes, _, corrected, s = ms_eden_parts(v, v.abs().amax(dim=(1, 2)).view(b, 1, 1), group)
        u = torch.stack([torch.rand(corrected.shape[1:], generator=ms_eden_generator(seed, t, "dgrad_dy"))
                         for t in steps])
        scale = stochastic_e4m3(corrected, u).float()
        vals = (e2m1_decode(codes).view(b, rows, cols // 16, 16) * (scale * s).unsqueeze(-1)).view(b, rows, cols)
        est = (rht(vals, torch.ones(group)).view(b, rows, cols // group, group) * signs[:, None, None, :])
        est = est.reshape(b, rows, cols)
        total += est.double().sum(0)
        sq += float(((est.double() - x) ** 2).sum())
    return float((total / n - x).norm() / x.norm()), sq / n / float((x.double() ** 2).sum())


# -- (a) unbiasedness -----------------------------------------------------------------------------------

def test_mean_of_draws_converges_at_the_inverse_sqrt_rate():
    """Unbiased: the mean of n draws (signs redrawn per draw, as per step in training) approaches x as
    1/√n, and its squared error is the one-draw MSE over n (any bias would add a floor to both). Measured
    (8×256 Gaussian): relative error 0.0061, 0.0032, 0.0016 at n = 250, 1000, 4000."""
    x = _gaussian(8, 256, 11)
    err = {}
    for n in (250, 1000, 4000):
        err[n], mse1 = _eden_mean_error(x, n, seed=n)
    slope = torch.log(torch.tensor(err[4000] / err[250])) / torch.log(torch.tensor(16.0))
    assert -0.6 < float(slope) < -0.4, (err, float(slope))
    assert 1.6 < err[250] / err[1000] < 2.5 and 1.6 < err[1000] / err[4000] < 2.5, err
    # E‖mean − x‖² = (one-draw MSE) / n for independent unbiased draws
    assert 0.7 < err[4000] ** 2 * 4000 / mse1 < 1.3, (err[4000], mse1)


def test_scale_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    """ê is one of the two E4M3 neighbours of the corrected scale, and its mean is that scale."""
    c = torch.tensor([0.3, 0.5626, 1.0, 3.3, 17.0, 255.0, 300.0, 0.0011, 0.0])
    u = torch.rand(20000, c.numel(), generator=torch.Generator().manual_seed(3))
    e = stochastic_e4m3(c.expand_as(u), u).float()
    lo = to_e4m3_saturating(c).float()
    lo = torch.where(lo > c, (to_e4m3_saturating(c).view(torch.uint8) - 1).view(torch.float8_e4m3fn).float(), lo)
    hi = torch.where(lo == c, lo, (lo.to(torch.float8_e4m3fn).view(torch.uint8) + 1).view(torch.float8_e4m3fn).float())
    assert bool(((e == lo) | (e == hi)).all())
    gap = (hi - lo).clamp(min=1e-30)
    assert bool(((e.mean(0) - c).abs() <= 4 * gap / (2 * 20000 ** 0.5) + 1e-12).all()), (e.mean(0), c)
    assert torch.equal(stochastic_e4m3(c[[2]], torch.tensor([0.999])).float(), torch.tensor([1.0]))  # exact: never up


# -- (b) error against stochastic rounding -----------------------------------------------------------------

@pytest.mark.parametrize("name,make", [("gaussian", _gaussian), ("student_t3", _student_t3)])
def test_error_is_lower_than_stochastic_rounding(name, make):
    """One draw's relative MSE: MS-EDEN (128-point RHT) against quantize_nvfp4(x, stochastic=True).
    Measured here: Gaussian 1.91× lower, Student-t(3) 1.79× (1.91–1.96× and 1.77–1.87× over 8 seeds); against
    SR with the 17/16 scale headroom (unbiased, the authors' SR baseline) 2.38× (the paper's "more than 2×")."""
    x = make(128, 1024, 7)
    eden = _rel_mse(_eden_estimate(x, seed=5, step=0), x)
    sr = _rel_mse(quantize_nvfp4(x, stochastic=True, seed=9).dequantize(), x)
    assert 0.0085 < eden < 0.0115, eden  # the authors' kernel test: above 3.32 bits, i.e. below 0.0101 (Gaussian)
    assert sr / eden > 1.7, (name, sr, eden)
    if name == "gaussian":
        srh = _rel_mse(_sr_headroom(x, torch.Generator().manual_seed(9)), x)
        assert srh / eden > 2.2, (srh, eden)


# -- (c) the scale headroom ----------------------------------------------------------------------------------

def _worst_case_blocks(rows, seed):
    """Blocks built to maximise the correction: every block's max is the tensor amax (so its scale is the
    largest, 256, and the max maps to 6.07), and the 15 others sit just below a rounding threshold (4.999,
    2.499, 0.7499, ... in those units), so that RTN rounds them all down. Row 0 is the worst case (all at
    4.999: c = 1.22); the other rows mix thresholds at random."""
    g = torch.Generator().manual_seed(seed)
    unit = 6.0 / MS_EDEN_SCALE_OVERRIDE * 255.99 / 256.0  # the block max in scaled units
    thresholds = torch.tensor([4.999, 3.499, 2.499, 1.749, 1.249, 0.7499, 0.2499])
    pick = thresholds[torch.randint(0, len(thresholds), (rows, 128, 15), generator=g)]
    pick[0] = 4.999
    others = pick * (1.0 - 1e-4 * torch.rand(rows, 128, 15, generator=g)) / unit
    others *= torch.where(torch.rand(rows, 128, 15, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat((torch.ones(rows, 128, 1), others), dim=-1).reshape(rows, 128 * 16)


def _adversarial_inputs():
    yield "worst_case_corrections", _worst_case_blocks(8, 1)
    all_equal = torch.full((4, 256), 4.999)  # every element at a threshold: c = 1 exactly
    yield "all_equal_at_threshold", all_equal
    zero_blocks = _gaussian(4, 256, 2)
    zero_blocks[:, 32:64] = 0.0
    zero_blocks[1] = 0.0
    yield "zero_blocks", zero_blocks
    yield "all_zero", torch.zeros(4, 256)
    outlier = _gaussian(4, 256, 3)
    outlier[2, 77] = 3.0e38
    yield "single_huge_outlier", outlier
    yield "denormal_range", _gaussian(4, 256, 4) * 1e-40
    mixed = _gaussian(4, 256, 5) * 1e-30
    mixed[0, 0] = 1.0
    yield "tiny_blocks_beside_a_large_one", mixed
    # one worst-case block at the tensor amax and, in its group, 7 constant blocks whose subnormal E4M3
    # scale rounds down by almost 1.5x (y = 9.05, clipped to 6): the largest correction there is, c = 1.49
    sub = _worst_case_blocks(1, 2)[:, :128].repeat(1, 2)
    sub[0, 16:128] = 1.49 * 2.0**-9 / 255.99
    yield "subnormal_scales_beside_the_largest", sub


@pytest.mark.parametrize("name,x", list(_adversarial_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_headroom_keeps_corrected_scales_inside_e4m3(name, x):
    """With scale_max = 255.99 the pre-correction scales stay at or below 256 and the corrected ones below
    390, so their upper E4M3 neighbour (at most 416) never saturates at 448: the stored scales are finite
    and the scale SR unbiased. The same worst-case blocks overflow 448 without the headroom."""
    amax = x.abs().amax()
    for signs in (None, ms_eden_signs(1, 0)):
        v = rht(x, signs) if signs is not None else x
        codes, e, corrected, s = ms_eden_parts(v, v.abs().amax())
        assert bool(torch.isfinite(corrected).all()) and float(e.max()) <= 256.0, name
        assert float(corrected.max()) < 390.0, (name, float(corrected.max()))
        q = quantize_ms_eden(x, signs, uniforms=torch.full(corrected.shape, 0.0))  # u = 0: always the upper neighbour
        up = q.scale.float()
        assert bool(torch.isfinite(up).all()) and float(up.max()) <= 416.0, name
        if amax > 0:
            assert bool(torch.isfinite(q.dequantize()).all())
    if name == "worst_case_corrections":
        _, _, corrected, _ = ms_eden_parts(x, amax)
        assert float(corrected.max()) > 1.2 * 256  # corrections up to 1.22 do occur ...
        _, _, corrected, _ = ms_eden_parts(x, amax, scale_max=448.0)
        assert float(corrected.max()) > 448.0  # ... and would saturate E4M3 without the headroom
    if name == "subnormal_scales_beside_the_largest":
        _, _, corrected, _ = ms_eden_parts(x, amax)
        assert float(corrected.max()) > 1.45 * 256, float(corrected.max())  # the bound is nearly reached


def test_non_finite_groups_decode_to_nan():
    x = _gaussian(2, 256, 6)
    x[0, 3] = float("nan")
    q = quantize_ms_eden(x, uniforms=torch.rand(2, 16), amax=torch.tensor(10.0))
    d = q.dequantize()
    assert bool(torch.isnan(d[0, :128]).all()) and bool(torch.isfinite(d[0, 128:]).all())
    assert bool(torch.isfinite(d[1]).all())
    assert bool(torch.isnan(quantize_ms_eden(x, uniforms=torch.rand(2, 16)).dequantize()).all())  # amax NaN


# -- (d) determinism -----------------------------------------------------------------------------------------

def test_same_seed_and_step_give_the_same_bits_and_steps_differ():
    x = _gaussian(16, 256, 8)

    def draw(seed, step):
        signs = ms_eden_signs(seed, step, "wgrad_signs")
        return signs, quantize_ms_eden(x, signs, generator=ms_eden_generator(seed, step, "wgrad_dy"))

    s1, a = draw(3, 100)
    s2, b = draw(3, 100)
    assert torch.equal(s1, s2) and set(s1.tolist()) <= {-1.0, 1.0}
    assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)
    s3, c = draw(3, 101)
    assert not torch.equal(s1, s3) and not torch.equal(a.data, c.data)
    assert len({ms_eden_seed(3, 100, r) for r in ROLES}) == len(ROLES)
    assert not torch.equal(ms_eden_signs(3, 100, "dgrad_signs"), ms_eden_signs(3, 100, "wgrad_signs"))
    assert ms_eden_seed(3, 100, "wgrad_dy") == ms_eden_seed(3, 100, ROLES.index("wgrad_dy"))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="role must be one of"):
        ms_eden_seed(1, 2, "forward")
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        ms_eden_seed(1, -1, 0)
    with pytest.raises(ValueError, match="power of two"):
        ms_eden_signs(1, 0, size=96)
    with pytest.raises(ValueError, match="group must be a multiple of 16"):
        quantize_ms_eden(torch.zeros(4, 96), group=64)
    with pytest.raises(ValueError, match="one draw per block"):
        quantize_ms_eden(torch.zeros(4, 128), uniforms=torch.rand(4, 4))
    with pytest.raises(ValueError, match="2D floating-point"):
        quantize_ms_eden(torch.zeros(128))


# -- (e) agreement with the authors' quantizer ---------------------------------------------------------------

def _fixture():
    return torch.load(FIXTURE)


def test_fixture_is_small_and_names_its_source():
    assert FIXTURE.stat().st_size < 200_000
    fx = _fixture()
    assert fx["source"] == "IST-DASLab/Quartet-II@8776a90b7aa0c0a400ad858a3c05a66f7ec55b73"
    assert abs(fx["scale_override"] - 17 / 16 * 0.93) < 1e-15


@pytest.mark.parametrize("case", ["identity128", "rht128", "identity16"])
def test_same_values_as_the_authors_quantizer(case):
    """Given the authors' draws (tl.rand(seed, block index)) and tensor amax, our MS-EDEN reproduces the
    dequantized output of their Triton kernel bit for bit: with no transform (128- and 16-element
    correction groups; a zero group, an underflowing block, integer ties, an outlier) and with a
    sign-randomised 128-point Hadamard transform."""
    c = _fixture()["cases"][case]
    rows = c["x"].shape[0]
    q = quantize_ms_eden(c["x"], c["signs"], group=c["group"], amax=c["amax"], uniforms=c["uniforms"].view(rows, -1))
    assert torch.equal(q.dequantize(), c["out"])


def test_own_amax_changes_only_the_last_bit_of_the_tensor_scale():
    """With the amax of our own rotation (fp32 butterflies, not their matmul) the codes and block scales are
    still theirs; only the tensor scale, and so every value, can move by about one ulp."""
    c = _fixture()["cases"]["rht128"]
    u = c["uniforms"].view(16, -1)
    ours = quantize_ms_eden(c["x"], c["signs"], uniforms=u)
    theirs_amax = quantize_ms_eden(c["x"], c["signs"], amax=c["amax"], uniforms=u)
    assert torch.equal(ours.data, theirs_amax.data)
    assert torch.equal(ours.scale.view(torch.uint8), theirs_amax.scale.view(torch.uint8))
    torch.testing.assert_close(ours.dequantize(), c["out"], rtol=2**-20, atol=0)


# -- the transform, the rounding ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_rht_of_any_power_of_two_size_is_the_orthonormal_matrix(n):
    s = ms_eden_signs(2, 3, size=n)
    x = _gaussian(8, 2 * n, 12)
    m = rht_matrix(s)
    torch.testing.assert_close(m @ m.T, torch.eye(n, dtype=torch.float64))
    want = (x.double().view(8, 2, n) @ m).view(8, 2 * n)
    torch.testing.assert_close(rht(x, s).double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(_derotate(rht(x, s), s), x, rtol=0, atol=1e-6)
    assert torch.equal(hadamard_matrix(n) @ hadamard_matrix(n), n * torch.eye(n, dtype=torch.float64))


def test_element_rounding_is_nearest_with_ties_away_from_zero():
    v = torch.tensor([0.25, 0.2499, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.99, 7.0, -0.25, -5.0, 0.0, -0.0])
    want = torch.tensor([0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.0])
    got = e2m1_decode(e2m1_encode_away(v))
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


# -- issue 64: should our stochastic rounding get a scale headroom? ------------------------------------------

def _sr_headroom(x, g, headroom=17 / 16):
    """Prototype: SR with the block max mapped to 6/headroom (the authors' SR baseline): after the scale
    rounds to nearest no element exceeds 6, so nothing clips."""
    vmax = 6.0 / headroom
    s_enc = vmax * 448.0 / x.abs().amax()
    blocks = x.reshape(-1, x.shape[-1] // 16, 16).float()
    e = to_e4m3_saturating(blocks.abs().amax(-1) * s_enc / vmax).float()
    v = blocks * torch.where(e > 0, s_enc / e, torch.zeros_like(e)).unsqueeze(-1)
    codes = e2m1_encode_stochastic(v, torch.randint(0, 256, v.shape, generator=g, dtype=torch.int32))
    return (e2m1_decode(codes) * e.unsqueeze(-1) / s_enc).reshape(x.shape)


def _sr_scale_up(x, g):
    """Prototype: SR with each block scale rounded *up* to E4M3 (S = 6·448/amax as today): no element
    exceeds 6 either, at a smaller cost in error than the 17/16 headroom."""
    s_enc = 6.0 * 448.0 / x.abs().amax()
    blocks = x.reshape(-1, x.shape[-1] // 16, 16).float()
    want = blocks.abs().amax(-1) * s_enc / 6.0
    near = to_e4m3_saturating(want)
    byte = torch.where(near.float() < want, (near.view(torch.uint8) + 1).clamp(max=0x7E), near.view(torch.uint8))
    e = byte.view(torch.float8_e4m3fn).float()
    v = blocks * torch.where(e > 0, s_enc / e, torch.zeros_like(e)).unsqueeze(-1)
    codes = e2m1_encode_stochastic(v, torch.randint(0, 256, v.shape, generator=g, dtype=torch.int32))
    return (e2m1_decode(codes) * e.unsqueeze(-1) / s_enc).reshape(x.shape)


def _sr_mean_error(x, n, variant, seed):
    """Relative error of the mean of n SR draws of x (all in one batch: the same x, so the same amax)."""
    g = torch.Generator().manual_seed(seed)
    xb = x.repeat(n, 1)
    if variant == "production":
        d = quantize_nvfp4(xb, stochastic=True, generator=g, amax=x.abs().amax()).dequantize()
    elif variant == "headroom_17_16":
        d = _sr_headroom(xb, g)
    else:
        d = _sr_scale_up(xb, g)
    mean = d.view(n, *x.shape).double().mean(0)
    return float((mean - x).norm() / x.norm())


def test_stochastic_rounding_bias_and_the_headroom_that_removes_it():
    """Issue 64: the mean of N draws of quantize_nvfp4(x, stochastic=True), x a 16×256 Gaussian, stalls near
    1% from x (measured 0.0171, 0.0124, 0.0110 at N = 100, 400, 1600, as the issue's 0.0175, 0.0127, 0.0114;
    1/√N would quarter it): block maxima whose scale rounded down clip at 6. Mapping the block max to 6·16/17
    (measured 0.0155, 0.0076, 0.0038) or rounding the block scale up (0.0152, 0.0076, 0.0037) removes the
    clipping and the floor."""
    x = _gaussian(16, 256, 64)
    err = {v: [_sr_mean_error(x, n, v, seed=n) for n in (100, 400, 1600)]
           for v in ("production", "headroom_17_16", "scale_up")}
    prod = err["production"]
    assert prod[0] / prod[2] < 2.5 and prod[2] > 0.007, prod  # a bias floor: far from the 4× of 1/√N
    for v in ("headroom_17_16", "scale_up"):
        e = err[v]
        assert e[0] / e[2] > 3.0 and e[2] < 0.005, (v, e)
