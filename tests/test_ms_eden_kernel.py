"""The MS-EDEN operand quantizer's Triton kernels (kernels/ms_eden.py) against their reference twin
(numerics/ms_eden_operand.py) bit for bit under the same Philox streams, the Philox twin against
tl.randint, and the quantized operands through nvfp4_gemm. On a CPU machine the kernels run in Triton's
interpreter at small shapes (conftest.py)."""

import pytest
import torch
import triton
import triton.language as tl

from titan_nvfp4.kernels.ms_eden import e2m1_of_quotient, ms_eden_amax_tensor, ms_eden_quantize_tensors
from titan_nvfp4.numerics.ms_eden_operand import ms_eden_operand, ms_eden_operand_amax
from titan_nvfp4.numerics.philox import philox_bits, philox_signs, uniform24
from titan_nvfp4.ops import ms_eden_operand_amax as op_amax
from titan_nvfp4.ops import nvfp4_gemm, quantize_ms_eden_operand
from titan_nvfp4.ops.library import StagedOperand

from kernel_helpers import DEV, same_bits


pytestmark = pytest.mark.usefixtures("one_thread")


@triton.jit
def _randint_probe(SEED, OFF, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, tl.randint(tl.load(SEED), tl.load(OFF + i)).to(tl.int64) & 0xFFFFFFFF)


def test_philox_twin_equals_triton_randint():
    """philox_bits(seed, offsets) is tl.randint's word for seeds and int64 offsets past 2³² (both counter
    words and both key words in use), with the seed as an int or as an int64 tensor."""
    g = torch.Generator().manual_seed(3)
    offs = torch.cat([torch.arange(8), torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**45 + 3,
                                                     2**62 + 11]),
                      torch.randint(0, 2**62, (17,), generator=g)]).to(DEV)
    out = torch.empty(32, dtype=torch.int64, device=DEV)
    for seed in (0, 1, 2**31 + 5, 2**32 + 17, 2**61 + 12345, -7):
        st = torch.tensor([seed], dtype=torch.int64, device=DEV)
        _randint_probe[(1,)](st, offs, out, N=32)
        assert torch.equal(philox_bits(seed, offs), out), seed
        assert torch.equal(philox_bits(st, offs), out), seed
    assert len(torch.unique(out)) == 32


def test_uniforms_and_signs_from_the_words():
    """uniform24: the top 24 bits × 2⁻²⁴, exact, in [0, 1); philox_signs: -1 exactly where bit 31 is set."""
    bits = torch.tensor([0, 255, 256, 2**32 - 1, 2**31, 12345678], dtype=torch.int64)
    u = uniform24(bits)
    assert u.dtype == torch.float32
    assert u.tolist() == [0.0, 0.0, 2.0**-24, 1 - 2.0**-24, 0.5, (12345678 >> 8) * 2.0**-24]
    w = philox_bits(99, torch.arange(256))
    s = philox_signs(99, 256)
    assert torch.equal(s, torch.where(w >= 2**31, -1.0, 1.0)) and 90 < int((s < 0).sum()) < 166


@triton.jit
def _quotient_probe(V, D, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    t, k, mag2, neg = e2m1_of_quotient(tl.load(V + i), 1.0 / tl.load(D + i).to(tl.float64))
    tl.store(OUT + i, t)
    tl.store(OUT + N + i, k)
    tl.store(OUT + 2 * N + i, mag2)
    tl.store(OUT + 3 * N + i, neg)


def test_quotient_codes_equal_the_division_at_every_threshold():
    """e2m1_of_quotient (y = v / d as v · RN64(1/d), the E2M1 code by bit arithmetic) gives the reference's t, code
    and 2|q| of the correctly rounded fp32 division, for v at and one or two ulps around d times each rounding
    threshold and each power of two t steps at, for block scales d from E4M3 subnormal times the floor of s to
    large, and for ±0, ±inf, NaN (v or d), subnormal v and random v."""
    from titan_nvfp4.numerics.ms_eden import e2m1_encode_away

    g = torch.Generator().manual_seed(12)
    e = torch.tensor([2.0**-9, 0.0546875, 1.0, 1.125, 13.0, 240.0, 448.0])
    s = torch.cat([torch.tensor([2.0**-117, 1e-30, 3.3e-7, 1.0, 0.37, 7.7e20]), torch.rand(4, generator=g) * 1e-3])
    d = (e[:, None] * s[None, :]).flatten()
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 2.0, 4.0, 6.0, 16.0, 2.0**-22,
                               2.0**-21, 3 * 2.0**-22, 0.3, 1.3, 5.9])
    v = (thresholds[:, None] * d[None, :]).flatten()  # rounded to fp32: v / d lands on or next to the threshold
    steps = [v]
    for _ in range(2):
        steps = [torch.nextafter(steps[0], torch.tensor(0.0)), *steps, torch.nextafter(steps[-1], torch.tensor(1e38))]
    v = torch.cat(steps)
    dd = d.repeat(len(v) // len(d))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3e-42, 1e-38, 3e38, -3e38])
    v = torch.cat([v, -v[:500], special, torch.randn(2000, generator=g) * torch.exp2(torch.randint(-60, 60, (2000,),
                                                                                                   generator=g))])
    dd = torch.cat([dd, dd[:500], torch.full((10,), 0.37), d[torch.randint(0, len(d), (2000,), generator=g)]])
    v, dd = torch.cat([v, torch.ones(2)]), torch.cat([dd, torch.tensor([float("nan"), 2.0**-126])])
    n = 1 << (len(v) - 1).bit_length()
    v = torch.cat([v, torch.zeros(n - len(v))]).float()
    dd = torch.cat([dd, torch.ones(n - len(dd))]).float()
    out = torch.empty(4 * n, dtype=torch.int32, device=DEV)
    _quotient_probe[(1,)](v.to(DEV), dd.to(DEV), out, N=n)
    t, k, mag2, neg = out.cpu().view(4, n).long()
    y = v / dd  # correctly rounded fp32 division
    a = torch.where(y.isnan(), torch.zeros_like(y), y.abs().clamp(max=16.0))
    assert torch.equal(t, (a * 2.0**22).long())
    code = e2m1_encode_away(y).long()
    assert torch.equal(k | (neg << 3), code)
    k_ref = code & 7
    assert torch.equal(mag2, torch.where(k_ref < 4, k_ref, (4 + 2 * (k_ref & 1)) << ((k_ref >> 1) - 2).clamp(min=0)))
    assert int((t > 0).sum()) > n // 2 and int((k == 7).sum()) > 100


def _same_half_bits(a, b):
    """Equal fp16 bits (the sign of zero included), NaN matching NaN whatever its payload."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]))


def _check(values, size, *, pre_scale=None, amax=None, sign_seed=11, draw_seed=23, staged=True):
    """Kernel == reference, bit for bit: codes, scales, s, staged values and the amax; returns the reference."""
    ref = ms_eden_operand(values, size=size, sign_seed=sign_seed, draw_seed=draw_seed, pre_scale=pre_scale,
                          amax=amax)
    d, s, gs = ms_eden_quantize_tensors(values, pre_scale, sign_seed, draw_seed, amax, size=size, staged=False)
    rows, cpad = values.shape[0], values.shape[1] + (-values.shape[1]) % size
    assert d.shape == (rows, cpad // 2) and s.shape == (rows, cpad // 16) and gs.shape == (1,)
    from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor
    same_bits(NVFP4Tensor(d, s, gs.reshape(()), torch.Size((rows, cpad)), (1, 16)), ref, f"size {size}")
    if staged:
        v16, _, gs2 = ms_eden_quantize_tensors(values, pre_scale, sign_seed, draw_seed, amax, size=size, staged=True)
        want = ref.scaled_codes(torch.float16)
        assert _same_half_bits(v16, want), f"size {size}: staged values"
        assert torch.equal(gs2.cpu(), gs.cpu()) or bool(gs.isnan().all() and gs2.isnan().all())
    if amax is None:
        a_ref = ms_eden_operand_amax(values, size=size, sign_seed=sign_seed, pre_scale=pre_scale)
        a_k = ms_eden_amax_tensor(values, pre_scale, sign_seed, size=size)
        assert a_k.shape == () and torch.equal(a_k.cpu(), a_ref.cpu())
    return ref


@pytest.mark.parametrize("size", [16, 32, 64, 128])
def test_kernel_equals_reference_with_padding_and_transposed_views(size):
    """Columns not a multiple of size (zero padding), read through a transposed bf16 view (strides (1, R))."""
    g = torch.Generator().manual_seed(size)
    base = (torch.randn(100, 24, generator=g) * torch.exp2(torch.randint(-4, 5, (1, 24), generator=g).float()))
    values = base.to(torch.bfloat16).to(DEV).t()  # [24, 100], not contiguous
    assert values.stride() == (1, 24)
    ref = _check(values, size)
    assert ref.data.shape == (24, (100 + (-100) % size) // 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_equals_reference_with_pre_scale_and_given_amax(dtype):
    """fp16 / fp32 inputs, a pre_scale (the operand as q·e_b times its decode scale) and a given amax
    (smaller than the data's: saturated scales and clamped values take the reference's rules)."""
    g = torch.Generator().manual_seed(1)
    values = (torch.randn(33, 80, generator=g) * 3).to(dtype).to(DEV)
    pre = torch.tensor([0.0123], dtype=torch.float32, device=DEV)
    _check(values, 32, pre_scale=pre)
    own = ms_eden_operand_amax(values, size=32, sign_seed=11, pre_scale=pre)
    _check(values, 32, pre_scale=pre, amax=own * 0.25, staged=False)
    _check(values[:, 7:71], 64, amax=torch.tensor(5.0, device=DEV), staged=False)  # a strided slice


def test_kernel_equals_reference_on_zeros_non_finite_and_adversarial_inputs():
    """All-zero input (s = 1, scales 1); a NaN and an Inf with a given finite amax (their groups NaN, the
    others normal) and with the data's own amax (+inf: s and every scale NaN); one huge outlier; rows of
    tiny values whose block scales fall in E4M3's subnormal range next to normal rows."""
    zeros = torch.zeros(5, 48, dtype=torch.bfloat16, device=DEV)
    ref = _check(zeros, 16)
    assert float(ref.global_scale) == 1.0 and bool((ref.scale.float() == 1.0).all())
    assert not (ref.data & 0x77).any()  # zero magnitudes (-0 where a sign flipped a zero)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g)
    x[1, 5], x[3, 40] = float("nan"), float("-inf")
    x = x.to(DEV)
    ref = _check(x, 32, amax=torch.tensor(4.0, device=DEV))
    nan_rows = ref.scale.float().isnan().any(-1).cpu()
    assert nan_rows.tolist() == [False, True, False, True, False, False]
    ref = _check(x, 32)
    assert bool(ref.global_scale.isnan()) and bool(ref.scale.float().isnan().all())
    y = torch.randn(8, 128, generator=g)
    y[2, 17] = 3e4  # one outlier: its group's other blocks get tiny (subnormal) scales
    y[4:6] *= 0.02  # block scales in E4M3's subnormal range
    y[6:] *= 1e-6  # rows far below the tensor scale (their scales flush to 0, then 1)
    y[7, :16] = 1e-38
    ref = _check(y.to(DEV), 128)
    e = ref.scale.float()
    assert bool(((e < 2.0**-6) & (e > 0)).any()) and bool((e > 2.0**-6).any())


def test_same_seeds_same_bits_other_draw_seed_other_scales():
    """Deterministic in the seeds; the draw seed moves scales only, the sign seed changes the rotation."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    a = quantize_ms_eden_operand(x, size=64, sign_seed=5, draw_seed=6, backend="reference")
    b = ms_eden_operand(x, size=64, sign_seed=torch.tensor([5]), draw_seed=torch.tensor([6]))
    same_bits(a, b, "same seeds")
    c = ms_eden_operand(x, size=64, sign_seed=5, draw_seed=7)
    assert torch.equal(a.data, c.data) and not torch.equal(a.scale.view(torch.uint8), c.scale.view(torch.uint8))
    d = ms_eden_operand(x, size=64, sign_seed=8, draw_seed=6)
    assert not torch.equal(a.data, d.data)


def _gemm_operands(backend):
    g = torch.Generator().manual_seed(9)
    a = torch.randn(32, 100, generator=g, dtype=torch.float32).to(torch.bfloat16).to(DEV)
    b = torch.randn(100, 24, generator=g).to(torch.bfloat16).to(DEV).t()  # [24, 100] transposed view
    seeds = dict(size=32, sign_seed=torch.tensor([77], device=DEV), backend=backend)
    qa = quantize_ms_eden_operand(a, draw_seed=1, staged=True, **seeds)
    qb = quantize_ms_eden_operand(b, draw_seed=2, **seeds)
    return a, b, qa, qb


@pytest.mark.parametrize("backend", ["reference", "emulated"])
def test_gemm_of_two_operands_with_the_same_signs_approximates_the_product(backend):
    """The rotation cancels in A·Bᵀ: nvfp4_gemm of the two quantized operands is close to values_a @ values_bᵀ,
    on the reference and the emulated backends (which give the same result from the same bits)."""
    a, b, qa, qb = _gemm_operands(backend)
    assert qa.storage_shape == (32, 128) and qb.storage_shape == (24, 128)
    assert isinstance(qa, StagedOperand) == (backend == "emulated")
    out = nvfp4_gemm(qa, qb, torch.float32, backend=backend)
    ref = a.double() @ b.double().t()
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 0.2  # 4-bit operands on a 100-long contraction
    _, _, ra, rb = _gemm_operands("reference")
    exact = nvfp4_gemm(ra, rb, torch.float32, backend="reference")
    assert torch.allclose(out, exact, rtol=1e-5, atol=1e-5)


def test_dispatch_amax_and_bad_arguments():
    """The amax dispatch on both backends; clear errors for a size, shape or pre_scale the quantizer refuses."""
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(6)).to(DEV)
    ra = op_amax(x, size=16, sign_seed=3, backend="reference")
    ka = op_amax(x, size=16, sign_seed=3, backend="emulated")
    assert ra.shape == ka.shape == () and torch.equal(ra.cpu(), ka.cpu())
    given = quantize_ms_eden_operand(x, size=16, sign_seed=3, draw_seed=4, backend="emulated", amax=ra)
    same_bits(given, quantize_ms_eden_operand(x, size=16, sign_seed=3, draw_seed=4, backend="reference"), "amax")
    for kwargs, msg in ((dict(size=48), "size must be one of"), (dict(size=16, pre_scale=torch.ones(2)), "pre_scale"),
                        (dict(size=16, pre_scale=torch.ones(1, dtype=torch.float64)), "pre_scale")):
        for backend in ("reference", "emulated"):
            with pytest.raises(ValueError, match=msg):
                quantize_ms_eden_operand(x, sign_seed=1, draw_seed=2, backend=backend, **kwargs)
    with pytest.raises(ValueError, match="2D floating-point"):
        quantize_ms_eden_operand(x.view(2, 2, 40), size=16, sign_seed=1, draw_seed=2, backend="reference")


def test_fake_impls_give_the_kernels_shapes():
    """The custom ops' fake implementations (what torch.compile traces) agree with the kernels' outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_nvfp4.ops import library

    x = torch.randn(5, 40)
    seed = torch.tensor([1])
    real = library.ms_eden_quantize(x, None, seed, seed, None, size=32, staged=False)
    staged = library.ms_eden_quantize(x, None, seed, seed, None, size=32, staged=True)
    with FakeTensorMode() as mode:
        fx, fs = mode.from_tensor(x), mode.from_tensor(seed)
        fake = library.ms_eden_quantize(fx, None, fs, fs, None, size=32, staged=False)
        fake_staged = library.ms_eden_quantize(fx, None, fs, fs, None, size=32, staged=True)
        fake_amax = library.ms_eden_amax(fx, None, fs, size=32)
    for r, f in zip((*real, *staged), (*fake, *fake_staged)):
        assert r.shape == f.shape and r.dtype == f.dtype
    assert fake_amax.shape == () and fake_amax.dtype == torch.float32


def _storage(rows, cols, tiles, seed):
    """An NVFP4 storage [rows, cols] as a forward quantizes it (Four Over Six, heavy-tailed rows), with a zero block,
    an underflowing block (scale 0, signed codes: -0 values) and blocks with subnormal scales."""
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-5, 6, (rows, 1), generator=g).float())
    x[0, :16] = 0.0
    x[1, 16:32] = -1e-30
    x[2, 32:48] = torch.linspace(-1, 1, 16) * x.abs().max() * 2.0**-15  # an E4M3 subnormal block scale
    q = quantize_nvfp4(x.to(DEV), block_shape=(16, 16) if tiles else (1, 16), four_over_six=True)
    return q


@pytest.mark.parametrize("size,transposed,tiles", [(16, False, False), (32, True, False), (64, True, True),
                                                   (128, False, True), (128, True, False)])
def test_codes_mode_equals_the_staged_values_bit_for_bit(size, transposed, tiles):
    """An NVFP4 storage read as codes (1x16 blocks or 16x16 tiles, transposed or not: X̂ᵀ reads a storage column
    across the tokens) gives the codes, scales, s and amax of its staged values q·e_b (fp16, times the decode scale
    as pre_scale), with padding; the reference twin on the NVFP4Tensor gives the same bits."""
    q = _storage(48 if tiles else 40, 80 if tiles else 48, tiles, size)
    pre = q.global_scale.reshape(1).float()
    staged = q.scaled_codes(torch.float16)
    vals = staged.t() if transposed else staged
    tiles_kw = dict(block_scales=q.scale, transposed=transposed, tiles=tiles)
    from_codes = ms_eden_quantize_tensors(q.data, pre, 5, 6, None, size=size, staged=False, **tiles_kw)
    from_vals = ms_eden_quantize_tensors(vals, pre, 5, 6, None, size=size, staged=False)
    for a, b in zip(from_codes, from_vals):
        assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())
    amax = ms_eden_amax_tensor(q.data, pre, 5, size=size, **tiles_kw)
    assert torch.equal(amax.cpu(), ms_eden_amax_tensor(vals, pre, 5, size=size).cpu())
    ref = ms_eden_operand(q, size=size, sign_seed=5, draw_seed=6, pre_scale=pre, transposed=transposed)
    same_bits(ref, ms_eden_operand(vals, size=size, sign_seed=5, draw_seed=6, pre_scale=pre), "reference")
    rows = vals.shape[0]
    from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor
    got = NVFP4Tensor(from_codes[0], from_codes[1], from_codes[2].reshape(()),
                      torch.Size((rows, from_codes[0].shape[1] * 2)), (1, 16))
    same_bits(got, ref, "kernel vs reference")
    assert torch.equal(ms_eden_operand_amax(q, size=size, sign_seed=5, pre_scale=pre, transposed=transposed).cpu(),
                       amax.cpu())
    if size == 128 and transposed:  # a given amax, staged output, through the op dispatch
        given = amax * 0.5
        a = quantize_ms_eden_operand(q, size=size, sign_seed=5, draw_seed=6, backend="emulated", pre_scale=pre,
                                     amax=given, staged=True, transposed=True)
        b = quantize_ms_eden_operand(vals, size=size, sign_seed=5, draw_seed=6, backend="emulated", pre_scale=pre,
                                     amax=given, staged=True)
        assert isinstance(a, StagedOperand) and _same_half_bits(a.values, b.values)
        assert torch.equal(a.global_scale.cpu(), b.global_scale.cpu())


def test_codes_mode_refuses_mismatched_scales_and_has_fake_shapes():
    """Block scales of the wrong shape or dtype for the codes are refused in one line; the fake implementations
    give the codes form's (transposed) output shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_nvfp4.ops import library

    q = _storage(32, 48, False, 0)
    seed = torch.tensor([1])
    for bad, tiles in ((q.scale[:, :2], False), (q.scale.view(torch.uint8), False), (q.scale, True)):
        with pytest.raises(ValueError, match="block scales of NVFP4 codes"):
            library.ms_eden_quantize(q.data, None, seed, seed, None, bad, size=16, staged=False, tiles=tiles)
    with pytest.raises(ValueError, match="NVFP4 codes must be a 2D uint8"):
        library.ms_eden_amax(q.data.float(), None, seed, q.scale, size=16)
    real = library.ms_eden_quantize(q.data, None, seed, seed, None, q.scale, size=32, staged=False, transposed=True)
    with FakeTensorMode() as mode:
        fd, fsc, fs = mode.from_tensor(q.data), mode.from_tensor(q.scale), mode.from_tensor(seed)
        fake = library.ms_eden_quantize(fd, None, fs, fs, None, fsc, size=32, staged=False, transposed=True)
        fake_staged = library.ms_eden_quantize(fd, None, fs, fs, None, fsc, size=32, staged=True)
    assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake] == [(48, 16), (48, 2), (1,)]
    assert tuple(fake_staged[0].shape) == (32, 64)
