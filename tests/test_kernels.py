"""Triton kernels against their reference twins (titan_nvfp4/numerics, ops/gemm.gemm_reference).

On a CPU machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) at
small shapes; on a GPU the same tests run compiled, plus larger shapes. Nearest-even quantization
must be bit-identical (codes, scales, global scale); the GEMM must match float64 on the dequantized
operands within 1e-5 relative (fp32 accumulation order is the only freedom).
"""

import pytest
import torch
import triton
import triton.language as tl

from titan_nvfp4.kernels.gemm import nvfp4_gemm_triton
from titan_nvfp4.kernels.nvfp4_jit import (e2m1_code, e2m1_staged, e2m1_stochastic_code, e2m1_stochastic_staged,
                                           philox4x32)
from titan_nvfp4.kernels.native import native_operands, swizzle_scales, unswizzle_scales
from titan_nvfp4.kernels.quantize import ordered_tiles, quantize_operand, quantize_weight_2d
from titan_nvfp4.numerics.formats import SR_BITS, e2m1_decode, e2m1_encode_rne, e2m1_encode_stochastic
from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor, quantize_nvfp4
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.backends import resolve_backend
from titan_nvfp4.ops.gemm import gemm_reference
from titan_nvfp4.ops.quantize import operand_amax, quantize_wgrad_operand

from kernel_helpers import DEV, GPU, inputs, same_bits, same_values
from pairwise import cpu_pairwise  # tests/pairwise.py

SHAPES = [(50, 96), (16, 16), (1, 48), (130, 80)] + ([(4096, 1024), (1000, 2000 + 48)] if GPU else [])


@triton.jit
def _encoder_probe(V, U, C, S, SR, SRS, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(V + i, mask=i < N, other=0.0)
    u = tl.load(U + i, mask=i < N, other=0)
    tl.store(SR + i, e2m1_stochastic_code(v, u), mask=i < N)
    tl.store(SRS + i, e2m1_stochastic_staged(v, u, 0.375), mask=i < N)
    tl.store(C + i, e2m1_code(v), mask=i < N)
    tl.store(S + i, e2m1_staged(v, 0.375), mask=i < N)  # times an E4M3 scale (3·2⁻³)


def _encoder_probe_values() -> torch.Tensor:
    """Every E2M1 grid point and midpoint with its two fp32 neighbours, both signs, ±0, values past the
    saturation point, ±inf, and random fp32 values over 0-8 and over many binades."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30])
    near = torch.cat([torch.nextafter(pts, torch.tensor(-1.0)), pts, torch.nextafter(pts, torch.tensor(1e38))])
    g = torch.Generator().manual_seed(5)
    rand = torch.cat([torch.rand(4000, generator=g) * 8, torch.randn(4000, generator=g) * torch.exp2(
        torch.randint(-140, 30, (4000,), generator=g).float())])
    v = torch.cat([near, rand, torch.tensor([float("inf"), 1e-45, 3e-39])]).clamp(min=0)
    return torch.cat([v, -v])


@triton.jit
def _philox_probe(SEED, OUT, BLOCK: tl.constexpr):
    seed = tl.load(SEED)
    i = tl.arange(0, BLOCK)
    c = (i * 7919 - 3).to(tl.int32)  # negative counters included
    ours = philox4x32(seed, c)
    theirs = tl.randint4x(seed, c)
    for j in tl.static_range(4):
        tl.store(OUT + j * BLOCK + i, ours[j].to(tl.int32, bitcast=True))
        tl.store(OUT + (4 + j) * BLOCK + i, theirs[j].to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5, -(2**62) + 12345])
def test_philox_equals_triton_randint4x(seed):
    """The kernels' Philox (one wide multiply per product) draws Triton's own Philox4x32-10 words."""
    out = torch.empty(8 * 256, dtype=torch.int32, device=DEV)
    _philox_probe[(1,)](torch.tensor([seed], dtype=torch.int64, device=DEV), out, BLOCK=256)
    ours, theirs = out.view(2, 4, 256)
    assert torch.equal(ours, theirs)
    assert len(torch.unique(ours)) > 1000  # distinct words, not a constant


def test_e2m1_encoder_and_staged_value_bit_identical_to_the_reference():
    """The kernels' one-add E2M1 rounding (nvfp4_jit.e2m1_code / e2m1_staged) element by element against
    formats.e2m1_encode_rne and its decode: ties to even, the signs of zeros, saturation; and the
    stochastic encoder against formats.e2m1_encode_stochastic for the same random bits, including
    those on either side of each value's rounding threshold."""
    v = _encoder_probe_values()
    v_all = v.to(DEV)
    g = torch.Generator().manual_seed(9)
    one = 2**SR_BITS
    r = torch.randint(0, one, (v_all.numel(),), generator=g, dtype=torch.int32)
    a = v.abs().clamp(max=6.0).double()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    steps = torch.round((a / step - torch.floor(a / step)) * one).int()  # the fraction in 2⁻⁸, as the reference
    r[::3] = (one - steps[::3]).clamp(max=one - 1)  # the smallest bits that round up
    r[1::3] = (one - 1 - steps[1::3]).clamp(min=0)  # the largest that stay down
    u = r.to(DEV)
    codes, sr = (torch.empty(v_all.numel(), dtype=torch.uint8, device=DEV) for _ in range(2))
    staged, sr_staged = (torch.empty(v_all.numel(), dtype=torch.float32, device=DEV) for _ in range(2))
    _encoder_probe[(triton.cdiv(v_all.numel(), 1024),)](v_all, u, codes, staged, sr, sr_staged, v_all.numel(),
                                                        BLOCK=1024)
    want_sr = e2m1_encode_stochastic(v, u.cpu())
    assert torch.equal(sr.cpu(), want_sr)
    ref_sr = e2m1_decode(want_sr) * 0.375
    assert torch.equal(sr_staged.cpu(), ref_sr) and torch.equal(torch.signbit(sr_staged.cpu()),
                                                                      torch.signbit(ref_sr))
    want = e2m1_encode_rne(v)
    assert torch.equal(codes.cpu(), want)
    ref = e2m1_decode(want) * 0.375
    assert torch.equal(staged.cpu(), ref) and torch.equal(torch.signbit(staged.cpu()), torch.signbit(ref))


@pytest.mark.parametrize("shape,kind,dtype", cpu_pairwise(SHAPES, ["normal", "heavy", "adversarial"],
                                                           [torch.bfloat16, torch.float32]))
def test_rowwise_and_wgrad_operand_bit_identical(shape, kind, dtype):
    x = inputs(*shape, kind, dtype)
    signs = rht_signs(3, DEV)
    row, col = quantize_operand(x, rowwise=True, colwise=True, signs=signs)
    same_bits(row, quantize_nvfp4(x), "rowwise")
    same_bits(col, quantize_wgrad_operand(x, signs), "wgrad operand (RHT)")
    _, col_plain = quantize_operand(x, rowwise=False, colwise=True, signs=None)
    same_bits(col_plain, quantize_wgrad_operand(x, None), "wgrad operand (no RHT)")


def test_strided_input_and_given_amax():
    x = inputs(64, 96, "normal", torch.float32)
    xt = x.t()  # strided view: the weight_2d=False dgrad operand reads W like this
    same_bits(quantize_operand(xt)[0], quantize_nvfp4(xt.contiguous()), "strided")
    amax = x.abs().amax() * 4
    same_bits(quantize_operand(x, amax=amax)[0], quantize_nvfp4(x, amax=amax), "given amax")
    small = x.abs().amax() / 4  # smaller than the data's: scales and codes saturate, as the reference
    same_bits(quantize_operand(x, amax=small)[0], quantize_nvfp4(x, amax=small), "saturating amax")


@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("bad", [None, float("nan"), -float("inf")])
def test_operand_amax_kernel_equals_reference(shape, bad):
    """The amaxes a sharded operand all-reduces (distributed/amax.py): the kernel's equal the reference's,
    non-finite as +inf, and quantizing with them gives the bits of quantizing on its own."""
    x = inputs(*shape, "heavy", torch.float32)
    if bad is not None:
        x[0, 0] = bad
    signs = rht_signs(3, DEV)
    for colwise, s in ((True, signs), (True, None), (False, None)):
        got = operand_amax(x, colwise, s, "emulated")
        want = operand_amax(x.cpu(), colwise, None if s is None else s.cpu(), "reference")
        assert torch.equal(got.cpu(), want), (colwise, s is not None)
    if bad is None:
        a = operand_amax(x, True, signs, "emulated")
        row, col = quantize_operand(x, rowwise=True, colwise=True, signs=signs, amax=a[0], amax_col=a[1])
        same_bits(row, quantize_nvfp4(x), "rowwise with its own amax given")
        same_bits(col, quantize_wgrad_operand(x, signs), "wgrad operand with its own amax given")
        _, col = quantize_operand(x, rowwise=False, colwise=True, signs=signs, amax_col=2 * a[1])
        same_bits(col, quantize_wgrad_operand(x, signs, amax=2 * a[1]), "wgrad operand alone, amax given")
        _, col = quantize_operand(x, rowwise=True, colwise=True, amax=a[0])  # no RHT: the row amax serves both
        same_bits(col, quantize_wgrad_operand(x, None), "wgrad operand without RHT, row amax given")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_poisons_like_the_reference(bad):
    x = inputs(32, 64, "normal", torch.float32)
    x[2, 20] = bad
    row, col = quantize_operand(x, rowwise=True, colwise=True, signs=rht_signs(0, DEV))
    ref = quantize_nvfp4(x)
    assert torch.isnan(row.global_scale) and torch.isnan(ref.global_scale)
    assert torch.equal(row.scale.float().isnan().cpu(), ref.scale.float().isnan().cpu())
    assert torch.isnan(row.dequantize()).all() and torch.isnan(col.dequantize()).all()


@pytest.mark.parametrize("four_over_six", [False, True], ids=["six", "four_over_six"])
def test_one_non_finite_block_under_a_given_amax(four_over_six):
    """A NaN under a given finite amax (a sharded tensor's all-reduced one, or an amax history) poisons its
    own block only, as in the reference: scale NaN, codes 0, staged values NaN, in every output of the
    operand and weight kernels. (The interpreter decodes E4M3 NaN as a finite value; the kernels must not
    rely on that decode.)"""
    from titan_nvfp4.kernels.gemm import dequantize_fp16
    from titan_nvfp4.kernels.quantize import quantize_operand_tensors, quantize_weight_2d_tensors

    x = inputs(64, 96, "normal", torch.float32)
    amax = x.abs().amax()
    amax_col = quantize_wgrad_operand(x, None).dequantize().abs().amax()
    x[37, 50] = float("nan")
    ref_row = quantize_nvfp4(x, amax=amax, four_over_six=four_over_six)
    ref_col = quantize_wgrad_operand(x, None, amax=amax_col, four_over_six=four_over_six)
    assert int(ref_row.scale.float().isnan().sum()) == 1 and int(ref_col.scale.float().isnan().sum()) == 1
    for fp16 in (False, True):
        rd, rs, cd, cs, _ = quantize_operand_tensors(x, rowwise=True, colwise=True, amax=amax, amax_col=amax_col,
                                                     row_staged=fp16, col_staged=fp16, four_over_six=four_over_six)
        for got, scales, ref, what in ((rd, rs, ref_row, "row"), (cd, cs, ref_col, "column")):
            if fp16:
                want = ref.scaled_codes(torch.float16).cpu()
                assert same_values(got, want), what
                assert int(got.isnan().sum()) == 16, what
            else:
                assert torch.equal(got.cpu(), ref.data.cpu()), what
                assert torch.equal(scales.view(torch.uint8).cpu(), ref.scale.view(torch.uint8).cpu()), what
    ref_w = quantize_nvfp4(x, block_shape=(16, 16), amax=amax, four_over_six=four_over_six)
    d, s, dt, st, _ = quantize_weight_2d_tensors(x, amax, four_over_six=four_over_six)
    assert torch.equal(d.cpu(), ref_w.data.cpu()) and torch.equal(dt.cpu(), ref_w.t().data.cpu())
    assert torch.equal(s.view(torch.uint8).cpu(), ref_w.scale.view(torch.uint8).cpu())
    d16 = quantize_weight_2d_tensors(x, amax, staged=True, four_over_six=four_over_six)[0]
    want = ref_w.scaled_codes(torch.float16).cpu()
    assert same_values(d16, want) and int(d16.isnan().sum()) == 256
    staged = dequantize_fp16(ref_row).cpu()  # the GEMM's staging decodes the NaN scale too
    want = ref_row.scaled_codes(torch.float16).cpu()
    assert same_values(staged, want) and int(staged.isnan().sum()) == 16


def test_all_zero_and_empty():
    z = torch.zeros(32, 64, device=DEV)
    row, col = quantize_operand(z, rowwise=True, colwise=True, signs=rht_signs(0, DEV))
    same_bits(row, quantize_nvfp4(z), "zeros")
    assert float(row.global_scale) == 1.0 and not col.data.any()
    e = torch.zeros(0, 64, device=DEV)
    row, col = quantize_operand(e, rowwise=True, colwise=True)
    assert row.data.shape == (0, 32) and col.data.shape == (64, 0)


@pytest.mark.parametrize("shape", [(64, 96), (16, 48), (48, 16)] + ([(4096, 4096), (1024, 14336)] if GPU else []))
@pytest.mark.parametrize("kind", ["normal", "heavy", "adversarial"])
def test_weight_2d_and_its_transpose_bit_identical(shape, kind):
    w = inputs(*shape, kind, torch.float32)
    wq, wt = quantize_weight_2d(w)
    ref = quantize_nvfp4(w, block_shape=(16, 16))
    same_bits(wq, ref, "W 16x16")
    same_bits(wt, ref.t(), "W^T 16x16")
    assert torch.equal(wt.dequantize(), wq.dequantize().t())


_HEAVY_SLOW = pytest.mark.slow(reason="6 s on 2 cores; the adversarial input in CI")


@pytest.mark.parametrize("kind", [pytest.param("heavy", marks=_HEAVY_SLOW), "adversarial"])
def test_amax_and_weight_kernels_every_tile_config_bit_identical(kind):
    """Each config the amax pass's and the 16×16 weight kernel's autotuners may pick, launched directly
    on ragged shapes (partial row and feature tiles), against the reference: the amaxes of x and of
    its RHT'd columns, and W's and Wᵀ's codes and scales."""
    from titan_nvfp4.kernels import quantize as q
    from titan_nvfp4.kernels.launch import tune_bucket

    x = inputs(72, 96, kind, torch.float32)  # partial tiles of 16 to 128 rows
    x[37, 10] = float("-inf")  # non-finite in x, not in x[:, 48:]: both amaxes of x become +inf
    signs = rht_signs(0, DEV)
    w = inputs(96, 208, kind, torch.float32)
    ref_w = quantize_nvfp4(w, block_shape=(16, 16))
    w_amax = w.abs().amax().float().reshape(1).view(torch.int32)
    for xin, want in ((x[:, 48:], None), (x, torch.tensor([float("inf")] * 2))):
        want = operand_amax(xin, True, signs, "reference").cpu() if want is None else want
        for cfg in q._amax_autotuned.configs:
            g, bk = cfg.kwargs["G"], cfg.kwargs["BK"]
            buf = torch.zeros(2, dtype=torch.int32, device=DEV)
            M, K = xin.shape
            q._amax_kernel[q.launch_grid(M, K, g, bk, cfg.kwargs["COLS_FIRST"])](
                xin, M, K, xin.stride(0), xin.stride(1), buf, signs, buf, 1, tune_bucket(M), ROW=True, COL=True,
                RHT=True, GROUPED=False, **cfg.kwargs, num_warps=cfg.num_warps)
            assert torch.equal(buf.view(torch.float32).cpu(), want), cfg
    N, K = w.shape
    for cfg in q._quantize_2d_autotuned.configs:
        g, bk = cfg.kwargs["G"], cfg.kwargs["BK"]
        d = torch.empty((N, K // 2), dtype=torch.uint8, device=DEV)
        s = torch.empty((N // 16, K // 16), dtype=torch.float8_e4m3fn, device=DEV)
        dt = torch.empty((K, N // 2), dtype=torch.uint8, device=DEV)
        st = torch.empty((K // 16, N // 16), dtype=torch.float8_e4m3fn, device=DEV)
        gs = torch.empty(1, device=DEV)
        q._quantize_2d_kernel[q.launch_grid(N, K, g, bk, cfg.kwargs["COLS_FIRST"])](
            w, N, K, w.stride(0), w.stride(1), w_amax, gs, d, s, dt, st, w_amax, 1, N, N * K, tune_bucket(N),
            EMIT_T=True, GROUPED=False, EMIT_STAGED=False, NSP2=1, FOUR_OVER_SIX=False, **cfg.kwargs,
            num_warps=cfg.num_warps)
        same_bits(NVFP4Tensor(d, s, gs[0], w.shape, (16, 16)), ref_w, f"W 16x16 {cfg}")
        same_bits(NVFP4Tensor(dt, st, gs[0], torch.Size((K, N)), (16, 16)), ref_w.t(), f"W^T 16x16 {cfg}")


@pytest.mark.parametrize("sr", [True] + ([False] if GPU else []))
def test_operand_kernel_every_tile_config_bit_identical(sr):
    """Each config (tile and program order) the operand kernel's autotuner may pick, launched directly
    on a ragged shape (partial row tiles, tokens padded to 16) with a non-finite block: the row codes and
    the RHT'd column codes equal the fixed-tile launch's (checked against the reference elsewhere). On a
    CPU with stochastic rounding only: its draws are indexed by element, so they also check that every
    tile visits each element once; nearest-even differs only in the elementwise rounding."""
    from titan_nvfp4.kernels import quantize as q
    from titan_nvfp4.kernels.launch import tune_bucket

    x = inputs(72, 96, "adversarial", torch.float32)  # 80 padded tokens: partial tiles of 32 and 64 rows
    x[37, 10] = float("nan")
    signs = rht_signs(0, DEV)
    seed = torch.tensor([11], device=DEV)
    kw = dict(colwise=True, signs=signs, stochastic_row=sr, stochastic_col=sr, seed=seed)
    want = q.quantize_operand_tensors(x, **kw)
    amax = q.operand_amax_tensors(x, True, signs)
    M, K = x.shape
    Mpad = M + (-M) % 16
    for cfg in q._quantize_autotuned.configs:
        g, bk = cfg.kwargs["G"], cfg.kwargs["BK"]
        got = [torch.full_like(t.view(torch.uint8), 0x55).view(t.dtype) for t in want[:4]]  # stale bytes
        gs = torch.empty(2, device=DEV)
        q._quantize_kernel[q.launch_grid(Mpad, K, g, bk, cfg.kwargs["COLS_FIRST"])](
            x, M, K, x.stride(0), x.stride(1), amax.view(torch.int32), gs, *got, signs, seed, Mpad, seed, 1,
            tune_bucket(Mpad), ROW=True, COL=True, RHT=True, STOCHASTIC_ROW=sr, STOCHASTIC_COL=sr, GROUPED=False,
            ROW_STAGED=False, COL_STAGED=False, NSP2=2, **cfg.kwargs, num_warps=cfg.num_warps)
        for a, b, name in zip(got, want[:4], ("row codes", "row scales", "column codes", "column scales")):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, cfg)
        assert same_values(gs, want[4]), cfg


@triton.jit
def _tile_order_kernel(OUT, n, ta, tq, E, LEAD: tl.constexpr):
    for t in range(0, n):
        e, loc, quant = ordered_tiles(t, ta, tq, E, LEAD)
        tl.store(OUT + 3 * t, e)
        tl.store(OUT + 3 * t + 1, loc)
        tl.store(OUT + 3 * t + 2, quant.to(tl.int32))


def test_fused_kernels_tile_order_covers_every_tile_after_its_amaxes():
    """ordered_tiles, what the fused amax kernels' waits rely on: every amax and quantization tile of
    every expert exactly once, each expert's amax tiles all before its first quantization tile, and
    LEAD experts' amax tiles in between where there are that many."""
    for E, ta, tq, lead in ((1, 1, 3, 1), (5, 1, 4, 1), (4, 2, 3, 0), (6, 3, 5, 2), (3, 2, 2, 5)):
        n = E * (ta + tq)
        out = torch.zeros(3 * n, dtype=torch.int32, device=DEV)
        _tile_order_kernel[(1,)](out, n, ta, tq, E, LEAD=lead)
        seq = [tuple(r) for r in out.view(-1, 3).tolist()]
        assert sorted(seq) == sorted([(e, i, 0) for e in range(E) for i in range(ta)]
                                     + [(e, i, 1) for e in range(E) for i in range(tq)]), (E, ta, tq, lead)
        for e in range(E):
            last_a = max(i for i, (x, _, q) in enumerate(seq) if x == e and not q)
            first_q = min(i for i, (x, _, q) in enumerate(seq) if x == e and q)
            assert last_a < first_q
            ahead = {x for x, _, q in seq[last_a + 1:first_q] if not q}  # amax tiles of later experts between
            assert len(ahead) == min(lead, E - 1 - e), (E, ta, tq, lead, e)


@pytest.mark.parametrize("experts,n,k,span", [(3, 48, 80, 1), (3, 48, 80, 3)]
                         + ([(64, 1408, 2048, 1), (16, 2048, 1408, 4)] if GPU else []))
def test_stacked_experts_fused_amax_kernel_bit_identical(experts, n, k, span, monkeypatch):
    """Stacked expert weights with no amax given take _quantize_2d_fused_kernel (amaxes reduced in the
    quantizing launch, in the tile order of ordered_tiles; ``span`` quantization tiles per amax tile):
    each expert's codes, scales, Wᵀ codes and decode scale equal the reference's on that expert alone,
    with an expert of zeros, one with a NaN and scales 2²⁰ apart; the staged fp16 W equals the
    two-pass path (amax pass, then the amaxes given)."""
    from titan_nvfp4.kernels import launch as L
    from titan_nvfp4.kernels import quantize as q

    monkeypatch.setitem(q._FUSED_2D, "SPAN", span)
    monkeypatch.setattr(q, "FUSED_2D_IN_INTERPRETER", True)

    g = torch.Generator().manual_seed(7)
    scale = torch.logspace(-10, 10, experts, base=2.0)[torch.randperm(experts, generator=g)]
    w = (torch.randn(experts, n, k, generator=g) * scale[:, None, None]).to(torch.bfloat16)
    w[0] = 0.0
    w[-1, n // 2, 3] = float("nan")
    w = w.reshape(experts * n, k).to(DEV)
    launched = sum(L.stats().get("_quantize_2d_fused_kernel", (0, 0))) if GPU else None
    d, s, dt, st, gs = q.quantize_weight_2d_tensors(w, experts=experts)
    for e in range(experts) if experts < 8 else (0, 1, experts // 2, experts - 1):
        ref = quantize_nvfp4(w[e * n:(e + 1) * n].float(), block_shape=(16, 16))
        got = NVFP4Tensor(d[e * n:(e + 1) * n], s[e * n // 16:(e + 1) * n // 16], gs[e], ref.shape, (16, 16))
        same_bits(got, ref, f"expert {e}")
        assert torch.equal(dt[:, e * n // 2:(e + 1) * n // 2], ref.t().data), e
        got_st = st[:, e * n // 16:(e + 1) * n // 16]
        assert torch.equal(got_st.view(torch.uint8), ref.t().scale.view(torch.uint8)), e
    amax = q.expert_amax_tensors(w, experts)
    two_pass = q.quantize_weight_2d_tensors(w, amax, experts=experts, staged=True)
    fused = q.quantize_weight_2d_tensors(w, experts=experts, staged=True)
    assert torch.equal(fused[0].view(torch.int16), two_pass[0].view(torch.int16))  # NaN-safe
    assert torch.equal(fused[2], two_pass[2]) and torch.equal(fused[4].view(torch.int32), two_pass[4].view(torch.int32))
    if GPU:
        assert sum(L.stats()["_quantize_2d_fused_kernel"]) > launched  # the fused kernel ran (launch cache)


def test_stochastic_rounding_reproducible_unbiased_and_neighbouring():
    x = inputs(64, 64, "normal", torch.float32)
    signs = rht_signs(0, DEV)

    def sr(seed, colwise=True):
        s = torch.full((1,), seed, dtype=torch.int64, device=DEV)
        return quantize_operand(x, rowwise=True, colwise=colwise, signs=signs, stochastic_row=True,
                                stochastic_col=colwise, seed=s)

    a, b, c = sr(1), sr(1), sr(2)
    assert torch.equal(a[0].data, b[0].data) and torch.equal(a[1].data, b[1].data)
    assert not torch.equal(a[0].data, c[0].data)
    rne = quantize_nvfp4(x)
    assert torch.equal(a[0].scale.view(torch.uint8), rne.scale.view(torch.uint8))  # scales never stochastic
    # every SR code is one of the two grid neighbours of x·r: at most one E2M1 gap from the RNE value
    d_sr, d_rne = a[0].dequantize(), rne.dequantize()
    gap = 2.0 * rne.row_scales().float().repeat_interleave(16, 1) * rne.global_scale  # largest gap (2) per block
    assert ((d_sr - d_rne).abs() <= gap * (1 + 1e-6)).all()
    # unbiased: the mean over many seeds converges to x (excluding each block's saturating maximum)
    assert torch.equal(sr(1, colwise=False)[0].data, a[0].data)  # the row draws do not depend on the columns
    n = 64 if GPU else 24
    mean = sum(sr(100 + i, colwise=False)[0].dequantize() for i in range(n)) / n
    blocks = x.view(64, 4, 16).abs()
    not_max = (blocks < blocks.amax(-1, keepdim=True)).view(64, 64)
    err = (mean - x)[not_max].abs() / gap[not_max]
    assert float(err.mean()) < 0.5 / n ** 0.5 * 1.5  # each rounding's error has std <= gap/2


@pytest.mark.parametrize("mnk,bias,out_dtype,use_tma,stage_a", cpu_pairwise(
    [(50, 48, 96), (16, 16, 16), (33, 70 + 2, 48 * 3)] + ([(1000, 1000, 2048 + 16), (4096, 4096, 4096)] if GPU else []),
    [False, True], [torch.float32, torch.bfloat16], [False, True], [False, True]))
def test_emulated_gemm_matches_float64(mnk, bias, out_dtype, use_tma, stage_a):
    if use_tma and GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    m, n, k = mnk
    a = quantize_nvfp4(inputs(m, k, "heavy", torch.float32))
    b = quantize_nvfp4(inputs(n, k, "normal", torch.float32))
    bvec = torch.randn(n, device=DEV) if bias else None
    y = nvfp4_gemm_triton(a, b, out_dtype, bvec, use_tma=use_tma, stage_a=stage_a)
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    if bias:
        exact = exact + bvec.double()
    if out_dtype == torch.float32:
        rel = (y.double() - exact).norm() / exact.norm()
        assert rel < 1e-5
    ref = gemm_reference(a, b, out_dtype, bvec)
    close = torch.isclose(y.float(), ref.float(), rtol=1e-5 if out_dtype == torch.float32 else 8e-3, atol=1e-6)
    assert close.float().mean() > 0.999


def test_persistent_gemm_matches_the_tile_kernel(monkeypatch):
    """Both operands staged with TMA: the persistent kernel (TMA store of C) gives the tile kernel's
    sums (same K steps of 32: bit for bit in the interpreter; compiled, within fp32 accumulation
    order); a C whose rows cannot take a TMA store (a 40-byte bf16 row) falls back to the tile kernel."""
    from titan_nvfp4.kernels import gemm as g

    if GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    launched = []
    real = g._launch_persistent
    monkeypatch.setattr(g, "_launch_persistent", lambda *a, **k: launched.append(a[-1].shape) or real(*a, **k))
    for n, out_dtype, block in ((80, torch.float32, (16, 16)), (20, torch.bfloat16, (1, 16))):
        a = quantize_nvfp4(inputs(50, 96, "heavy", torch.float32))
        b = quantize_nvfp4(inputs(n, 96, "normal", torch.float32), block_shape=block)
        bvec = torch.randn(n, device=DEV)
        tile = nvfp4_gemm_triton(a, b, out_dtype, bvec, use_tma=False, stage_a=True)
        got = nvfp4_gemm_triton(a, b, out_dtype, bvec, use_tma=True, stage_a=True)
        if GPU:
            torch.testing.assert_close(got, tile, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, tile)
    assert launched == [torch.Size((50, 80))]


def test_prestaged_operands_are_not_chunked(monkeypatch):
    """Operands that arrive staged (StagedOperand) go to one persistent launch over the whole output,
    whatever the staging budget; packed ones are staged in row chunks. Same sums either way."""
    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.ops.library import StagedOperand

    if GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    monkeypatch.setattr(g, "STAGE_BYTES", 256 * 2 * 64)  # 256-row chunks
    launched = []
    real = g._launch_persistent
    monkeypatch.setattr(g, "_launch_persistent", lambda *a, **k: launched.append(tuple(a[-1].shape)) or real(*a, **k))
    a = quantize_nvfp4(inputs(272, 64, "heavy", torch.float32))
    b = quantize_nvfp4(inputs(48, 64, "normal", torch.float32), block_shape=(16, 16))
    packed = nvfp4_gemm_triton(a, b, torch.float32, use_tma=True, stage_a=True)
    assert launched == [(256, 48), (16, 48)]
    launched.clear()
    staged = [StagedOperand(t.scaled_codes(torch.float16), t.global_scale) for t in (a, b)]
    got = nvfp4_gemm_triton(*staged, torch.float32, use_tma=True)
    assert launched == [(272, 48)]
    torch.testing.assert_close(got, packed, rtol=0 if not GPU else 1e-6, atol=0 if not GPU else 1e-6)


@pytest.mark.parametrize("use_tma,split_k", [(False, False), (True, False), (False, True)],
                         ids=["tile", "persistent", "k_split"])
def test_round_to_stores_a_16bit_result_widened(monkeypatch, use_tma, split_k):
    """round_to = bf16 with an fp32 out: bit for bit the bf16 result widened, in each kernel path and the
    no-contraction fill, and through ops.nvfp4_gemm on the reference backend too."""
    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.ops import nvfp4_gemm

    if use_tma and GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90+")
    if split_k:
        monkeypatch.setattr(g, "STAGE_BYTES", 2 * 1024 * 12)  # wgrad-like: K chunks with fp32 partials
        monkeypatch.setattr(g, "MIN_CHUNK_ROWS", 64)
    k = 1024 if split_k else 96
    a = quantize_nvfp4(inputs(40, k, "heavy", torch.float32))
    b = quantize_nvfp4(inputs(48, k, "normal", torch.float32), block_shape=(16, 16))
    bvec = torch.randn(48, device=DEV)
    for bias in (None, bvec):
        want = nvfp4_gemm_triton(a, b, torch.bfloat16, bias, use_tma=use_tma, stage_a=True).float()
        got = nvfp4_gemm_triton(a, b, torch.float32, bias, use_tma=use_tma, stage_a=True, round_to=torch.bfloat16)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert not torch.equal(got, nvfp4_gemm_triton(a, b, torch.float32, bias, use_tma=use_tma, stage_a=True))
    ref = nvfp4_gemm(a, b, torch.float32, bvec, backend="reference", round_to=torch.bfloat16)
    assert torch.equal(ref, nvfp4_gemm(a, b, torch.bfloat16, bvec, backend="reference").float())
    empty = quantize_nvfp4(torch.zeros(40, 0, device=DEV)), quantize_nvfp4(torch.zeros(48, 0, device=DEV))
    fill = nvfp4_gemm_triton(*empty, torch.float32, bvec, round_to=torch.bfloat16)
    assert torch.equal(fill, bvec.to(torch.bfloat16).float().expand(40, 48))


@pytest.mark.skipif(not GPU, reason="autotuned large-tile configs only run compiled")
def test_emulated_gemm_autotuned_tiles_on_gpu():
    a = quantize_nvfp4(inputs(2048, 4096, "heavy", torch.bfloat16))
    b = quantize_nvfp4(inputs(3072 + 16, 4096, "normal", torch.bfloat16), block_shape=(16, 16))
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    y = nvfp4_gemm_triton(a, b, torch.float32, autotune=True)
    assert (y.double() - exact).norm() / exact.norm() < 1e-5


def test_gemm_with_16x16_weight_and_its_transpose():
    w = inputs(48, 96, "normal", torch.float32)
    wq = quantize_nvfp4(w, block_shape=(16, 16))
    x = quantize_nvfp4(inputs(20, 96, "normal", torch.float32))
    dy = quantize_nvfp4(inputs(20, 48, "normal", torch.float32))
    y = nvfp4_gemm_triton(x, wq, torch.float32)
    dx = nvfp4_gemm_triton(dy, wq.t(), torch.float32)
    for got, a, b in ((y, x, wq), (dx, dy, wq.t())):
        exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
        assert (got.double() - exact).norm() / exact.norm() < 1e-5


def test_staged_operand_is_exact_and_chunking_is_invisible(monkeypatch):
    from titan_nvfp4.kernels import gemm as g

    for block in ((1, 16), (16, 16)):
        b = quantize_nvfp4(inputs(64, 96, "adversarial", torch.float32), block_shape=block)
        staged = g.dequantize_fp16(b)
        assert staged.dtype == torch.float16
        ref = b.scaled_codes(torch.float64)
        same = (staged.double() == ref) | (staged.isnan() & ref.isnan())
        assert bool(same.all())  # exact: no rounding in the fp16 staging
        assert torch.equal(g.dequantize_fp16(b, slice(16, 48)).view(torch.int16), staged[16:48].view(torch.int16))
    a = quantize_nvfp4(inputs(300, 96, "normal", torch.float32))
    b = quantize_nvfp4(inputs(304, 96, "normal", torch.float32), block_shape=(16, 16))
    whole = nvfp4_gemm_triton(a, b, torch.float32, stage_a=False)
    assert torch.equal(nvfp4_gemm_triton(a, b, torch.float32, stage_a=True), whole)  # same fp16 values, same sums
    monkeypatch.setattr(g, "STAGE_BYTES", 96 * 2 * 16)  # forces 256-row chunks: two launches per operand
    assert torch.equal(nvfp4_gemm_triton(a, b, torch.float32, stage_a=False), whole)
    assert torch.equal(nvfp4_gemm_triton(a, b, torch.float32, stage_a=True), whole)
    # a one-chunk B: A's chunks go in the outer loop and B is staged once
    small_b = quantize_nvfp4(inputs(48, 96, "normal", torch.float32), block_shape=(16, 16))
    assert torch.equal(nvfp4_gemm_triton(a, small_b, torch.float32, stage_a=True),
                       nvfp4_gemm_triton(a, small_b, torch.float32, stage_a=False))


@pytest.mark.parametrize("kind", ["normal", "adversarial"])
@pytest.mark.parametrize("sr", [False, True])
def test_quantization_kernel_emits_the_staged_operand_exactly(kind, sr, monkeypatch):
    """row_staged / col_staged: the quantization kernel writes the GEMM's fp16 values q·e_b itself, of the
    rows and of the RHT'd columns. They must be the staging of the codes it would otherwise write (same
    SR draws: same seed, same counters), NaN blocks included, and the GEMM must give the same bits
    from either."""
    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.kernels.quantize import quantize_operand_tensors
    from titan_nvfp4.ops.library import StagedOperand, operand_pair

    x = inputs(80, 96, kind).to(DEV)
    seed = torch.tensor([5], device=DEV) if sr else None
    kw = dict(stochastic_row=sr, stochastic_col=sr, seed=seed, colwise=True, signs=rht_signs(0, DEV))
    codes, codes_col = operand_pair(quantize_operand_tensors(x, **kw), x.shape, True, True)
    staged, staged_col = operand_pair(quantize_operand_tensors(x, row_staged=True, col_staged=True, **kw), x.shape,
                                      True, True)
    for s, c in ((staged, codes), (staged_col, codes_col)):  # the rows [80, 96]; the RHT'd columns [96, 80]
        assert isinstance(s, StagedOperand) and s.values.dtype == torch.float16
        want = g.dequantize_fp16(c)
        same = (s.values == want) | (s.values.isnan() & want.isnan())
        assert bool(same.all()) and torch.equal(s.global_scale, c.global_scale)
    assert staged_col.values.shape == (96, 80)
    if kind == "normal":
        b = quantize_nvfp4(inputs(48, 96, "normal", torch.float32).to(DEV), block_shape=(16, 16))
        assert torch.equal(nvfp4_gemm_triton(staged, b, torch.float32), nvfp4_gemm_triton(codes, b, torch.float32))
        monkeypatch.setattr(g, "STAGE_BYTES", 96 * 2 * 16)  # row chunks of a staged A: views, same sums
        assert torch.equal(nvfp4_gemm_triton(staged, b, torch.float32), nvfp4_gemm_triton(codes, b, torch.float32))


@pytest.mark.parametrize("kind", ["normal", "adversarial"])
def test_weight_kernel_emits_the_staged_weight_exactly(kind):
    """16×16 weights with ``staged``: W as the GEMM's fp16 values (the staging of the codes it would
    write), Wᵀ still as the same codes and scales; for one weight and for stacked experts."""
    from titan_nvfp4.kernels import gemm as g
    from titan_nvfp4.kernels.quantize import quantize_weight_2d_tensors

    w = inputs(96, 64, kind).to(DEV)
    for experts in (1, 3):
        d, s, dt, st, gs = quantize_weight_2d_tensors(w, experts=experts)
        d16, s16, dt16, st16, gs16 = quantize_weight_2d_tensors(w, experts=experts, staged=True)
        codes = NVFP4Tensor(d, s, gs[0], w.shape, (16, 16))
        want = g.dequantize_fp16(codes)
        assert d16.dtype == torch.float16 and s16.numel() == 0
        assert same_values(d16, want)
        assert torch.equal(dt16, dt) and torch.equal(st16.view(torch.uint8), st.view(torch.uint8)) and torch.equal(gs16, gs)


def test_native_layouts_round_trip_and_match_torchao():
    from torchao.prototype.mx_formats.utils import to_blocked  # independent implementation (test oracle)

    for rows, cols in ((128, 4), (130, 7), (300, 20), (16, 1)):
        s = (torch.rand(rows, cols) * 400).to(torch.float8_e4m3fn)
        flat = swizzle_scales(s)
        assert torch.equal(flat.view(torch.uint8), to_blocked(s).reshape(-1).view(torch.uint8))
        assert torch.equal(unswizzle_scales(flat, rows, cols).view(torch.uint8), s.view(torch.uint8))
    # the operands handed to F.scaled_mm decode to the reference's values
    a = quantize_nvfp4(torch.randn(40, 64))
    b = quantize_nvfp4(torch.randn(48, 64), block_shape=(16, 16))
    mat_a, mat_b, sa, sb = native_operands(a, b)
    assert mat_a.dtype == torch.float4_e2m1fn_x2 and mat_a.shape == (40, 32) and mat_b.shape == (32, 48)
    assert torch.equal(mat_b.view(torch.uint8).t(), b.data)  # column-major B, same bytes
    assert torch.equal(unswizzle_scales(sb[0], 48, 4).view(torch.uint8), b.row_scales().view(torch.uint8))
    assert float(sa[1]) == float(a.global_scale) and sa[1].dtype == torch.float32


def test_backend_resolution_and_errors(monkeypatch):
    assert resolve_backend("reference", torch.device("cpu")) == "reference"
    if not GPU:
        assert resolve_backend("auto", torch.device("cpu")) == "reference"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="emulated.*not on cpu"):
            resolve_backend("emulated", torch.device("cpu"))
        with pytest.raises(RuntimeError, match="native.*sm_100"):
            resolve_backend("native", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown NVFP4 gemm_backend 'fast'"):
        resolve_backend("fast", torch.device(DEV))


@pytest.mark.parametrize("weight_2d", [True, False])
def test_linear_on_emulated_backend_equals_reference_backend(weight_2d):
    from titan_nvfp4 import NVFP4Linear, NVFP4Recipe

    outs = {}
    for backend in ("reference", "emulated"):
        torch.manual_seed(0)
        recipe = NVFP4Recipe(weight_2d=weight_2d, stochastic_rounding=False, gemm_backend=backend)
        lin = NVFP4Linear(64, 48, bias=True, recipe=recipe).to(DEV)
        x = torch.randn(3, 10, 64, device=DEV, requires_grad=True)  # 30 tokens: wgrad pads to 32
        y = lin(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV))
        outs[backend] = (y.detach(), x.grad, lin.weight.grad, lin.bias.grad)
    for name, r, e in zip(("y", "dx", "dw", "db"), outs["reference"], outs["emulated"]):
        assert torch.allclose(r, e, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("bias", [False, True])
def test_long_contraction_splits_k_with_fp32_partials(monkeypatch, bias):
    """wgrad-like shapes (K >= M, N) past the staging budget run as K chunks with fp32 partial sums:
    the same fp32 accumulation in another order, so float64-close rather than bit-equal."""
    from titan_nvfp4.kernels import gemm as g

    a = quantize_nvfp4(inputs(40, 1024, "heavy", torch.float32))
    b = quantize_nvfp4(inputs(48, 1024, "normal", torch.float32))
    bvec = torch.randn(48, device=DEV) if bias else None
    monkeypatch.setattr(g, "STAGE_BYTES", 2 * 1024 * 12)  # 256-column chunks: four launches
    monkeypatch.setattr(g, "MIN_CHUNK_ROWS", 64)  # row chunks of 256 rows would hold all 48: only K splits
    calls = []
    real = g._launch_gemm
    monkeypatch.setattr(g, "_launch_gemm", lambda *args: (calls.append(args[2]), real(*args)))
    y = nvfp4_gemm_triton(a, b, torch.float32, bvec, stage_a=True)
    assert [(c["ACC_IN"], c["FINAL"]) for c in calls] == [(False, False), (True, False), (True, False), (True, True)]
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    if bias:
        exact = exact + bvec.double()
    assert (y.double() - exact).norm() / exact.norm() < 1e-5
    ref = gemm_reference(a, b, torch.float32, bvec)
    assert torch.isclose(y, ref, rtol=1e-5, atol=1e-6).float().mean() > 0.999


@pytest.mark.skipif(not GPU, reason="autotuned large-tile configs only run compiled")
def test_autotuned_k_split_is_not_corrupted_by_benchmark_reruns(monkeypatch):
    """The autotuner runs each config several times; a K chunk that adds into the fp32 partial sums
    must start from the same partial sums every time (restore_value), on a fresh autotuning key."""
    from titan_nvfp4.kernels import gemm as g

    a = quantize_nvfp4(inputs(512 + 16, 8192, "heavy", torch.bfloat16))
    b = quantize_nvfp4(inputs(384, 8192, "normal", torch.bfloat16))
    monkeypatch.setattr(g, "STAGE_BYTES", 2 * 8192 * 64)  # 64-row budget: K splits into 768-column chunks
    y = nvfp4_gemm_triton(a, b, torch.float32, autotune=True, stage_a=True)
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    assert (y.double() - exact).norm() / exact.norm() < 1e-5
