"""Four Over Six block scales (block_scale_rule = "four_over_six"; arXiv 2512.02010): the reference
against float64, the Triton kernels against the reference bit for bit (interpreter on CPU, compiled on
a GPU), stochastic rounding on top of the choice, and the knob end to end through NVFP4Linear."""

import pytest
import torch

from titan_nvfp4.kernels.quantize import quantize_operand, quantize_operand_tensors, quantize_weight_2d
from titan_nvfp4.numerics.formats import e2m1_decode, e2m1_encode_rne
from titan_nvfp4.numerics.nvfp4 import (block_decode_scale, block_encode_factor, four_over_six_error,
                                        global_encode_scale, quantize_nvfp4)
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.quantize import quantize_wgrad_operand

from kernel_helpers import DEV, GPU, inputs, same_bits, same_values


def _candidates(blocks: torch.Tensor, s_enc: torch.Tensor):
    """float64 squared error of each block under the "6" and the "4" candidate, and the two scales."""
    bamax = blocks.abs().amax(-1)
    out = []
    for four in (False, True):
        e = block_decode_scale(bamax, s_enc, to_four=four)
        q = e2m1_decode(e2m1_encode_rne(blocks * block_encode_factor(e, s_enc).unsqueeze(-1)))
        deq = q.double() * e.double().unsqueeze(-1) / s_enc.double()
        out.append((((deq - blocks.double()) ** 2).sum(-1), e))
    return out


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform"])
def test_each_block_keeps_the_candidate_with_the_lower_error(dist):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 256, generator=g)
    if dist == "laplace":
        x = torch.sign(x) * -torch.log(torch.rand(512, 256, generator=g)) * torch.exp2(torch.randint(-8, 8, (512, 1), generator=g))
    elif dist == "uniform":
        x = torch.rand(512, 256, generator=g) * 2 - 1
    q = quantize_nvfp4(x, four_over_six=True)
    s_enc = global_encode_scale(x.abs().amax(), four_over_six=True)
    assert torch.equal(q.global_scale, torch.reciprocal(s_enc))
    blocks = x.view(512, 16, 16)
    (err6, e6), (err4, e4) = _candidates(blocks, s_enc)
    chose4 = q.scale.view(torch.uint8) == e4.view(torch.uint8)
    chose4 &= q.scale.view(torch.uint8) != e6.view(torch.uint8)
    chosen, other = torch.where(chose4, err4, err6), torch.where(chose4, err6, err4)
    # the integer error is the float64 error up to truncation at 2^-10 of the block's magnitude:
    # the choice is float64's best except at near-ties, and then within 1% of it
    assert float((chosen <= other).double().mean()) > 0.99
    assert bool((chosen <= other * 1.01 + 1e-30).all())
    assert 0.05 < float(chose4.double().mean()) < 0.95  # both candidates get picked
    # exactly what it claims: the integer error of the kept scale is never above the other one's
    bamax = blocks.abs().amax(-1)
    i6, i4 = (four_over_six_error(blocks, e, s_enc, bamax) for e in (e6, e4))
    assert bool((torch.where(chose4, i4, i6) <= torch.where(chose4, i6, i4)).all())
    assert bool((chose4 == (i4 < i6)).all())
    # and the tensor as a whole: lower error than the six rule
    six = quantize_nvfp4(x)
    assert float(((q.dequantize() - x) ** 2).sum()) < float(((six.dequantize() - x) ** 2).sum())


def test_hand_made_blocks_choose_as_expected():
    """A block of near-maximal values (4.6/6 of the max lands between 4 and 6 when scaled to 6, on 3
    when scaled to 4) keeps "4"; a block of 6, 3, 1.5, 0.75 ladders is exact under "6" and keeps it."""
    near = torch.tensor([6.0] + [4.6] * 15)
    ladder = torch.tensor([6.0, 3.0, 1.5, 0.75, 0.5, 1.0, 2.0, 4.0] * 2)
    x = torch.stack([near, ladder, torch.zeros(16)]) * 0.01
    x = torch.cat([x, torch.full((1, 16), 0.06)])  # the tensor amax sits in a block of its own
    q = quantize_nvfp4(x, four_over_six=True)
    s_enc = global_encode_scale(x.abs().amax(), four_over_six=True)
    bamax = x.abs().amax(-1)
    e6, e4 = block_decode_scale(bamax, s_enc), block_decode_scale(bamax, s_enc, to_four=True)
    assert q.scale[0, 0].view(torch.uint8) == e4[0].view(torch.uint8)
    assert q.scale[1, 0].view(torch.uint8) == e6[1].view(torch.uint8)
    assert float(q.scale[2, 0].float()) == 0.0 and not q.dequantize()[2].any()  # zero block: scale 0
    assert float(e4.float().max()) <= 384.0  # the "4" scale stays inside E4M3 under S = 1536/amax


def test_edge_cases_and_sixteen_by_sixteen_tiles():
    x = inputs(64, 64, "adversarial", torch.float32).cpu()
    q = quantize_nvfp4(x, four_over_six=True)
    assert torch.isfinite(q.dequantize()).all() and not q.dequantize()[:, :16].any()
    z = quantize_nvfp4(torch.zeros(16, 32), four_over_six=True)
    assert float(z.global_scale) == 1.0 and not z.data.any() and not z.scale.float().any()
    bad = x.clone()
    bad[3, 20] = float("nan")
    qb = quantize_nvfp4(bad, amax=x.abs().amax(), four_over_six=True)  # a given finite amax
    nan_blocks = qb.scale.float().isnan()
    assert nan_blocks.sum() == 1 and nan_blocks[3, 1] and torch.isnan(qb.dequantize()[3, 16:32]).all()
    small = x.abs().amax() / 8  # a given amax below the data's: saturates, stays finite
    assert torch.isfinite(quantize_nvfp4(x, amax=small, four_over_six=True).dequantize()).all()
    w = inputs(48, 64, "heavy", torch.float32).cpu()
    t = quantize_nvfp4(w, (16, 16), four_over_six=True)
    assert torch.equal(t.t().dequantize(), t.dequantize().t())  # tiles stay transpose-symmetric
    s_enc = global_encode_scale(w.abs().amax(), four_over_six=True)
    tiles = w.view(3, 16, 4, 16).permute(0, 2, 1, 3).reshape(3, 4, 256)
    (err6, e6), (err4, e4) = _candidates(tiles, s_enc)
    chose4 = (t.scale.view(torch.uint8) == e4.view(torch.uint8)) & (e4.view(torch.uint8) != e6.view(torch.uint8))
    assert bool((torch.where(chose4, err4, err6) <= torch.where(chose4, err6, err4) * 1.01).all())


@pytest.mark.parametrize("shape", [(50, 96), (16, 16), (130, 80)] + ([(4096, 1024)] if GPU else []))
@pytest.mark.parametrize("kind", ["normal", "heavy", "adversarial"])
def test_kernels_bit_identical_to_the_reference(shape, kind):
    x = inputs(*shape, kind)
    signs = rht_signs(3, DEV)
    row, col = quantize_operand(x, rowwise=True, colwise=True, signs=signs, four_over_six=True)
    same_bits(row, quantize_nvfp4(x, four_over_six=True), "rowwise 4/6")
    same_bits(col, quantize_wgrad_operand(x, signs, four_over_six=True), "wgrad operand (RHT) 4/6")
    if shape[0] % 16 == 0:
        wq, wt = quantize_weight_2d(x, four_over_six=True)
        ref = quantize_nvfp4(x, block_shape=(16, 16), four_over_six=True)
        same_bits(wq, ref, "W 16x16 4/6")
        same_bits(wt, ref.t(), "W^T 16x16 4/6")


@pytest.mark.parametrize("kind", ["normal", "heavy", "adversarial"])
def test_staged_kernels_emit_the_references_values(kind):
    """The staged outputs of the 4/6 kernels (the forward's fp16 row operand, the RHT column operand as
    fp16, the fp16 weight) equal the reference's q·e_b, and the code outputs match it bit for bit.
    (tests/test_kernels.py covers a non-finite block for both block-scale rules.)"""
    from titan_nvfp4.kernels.quantize import quantize_weight_2d_tensors

    x = inputs(64, 96, kind).float()
    signs = rht_signs(5, DEV)
    ref_row = quantize_nvfp4(x, four_over_six=True)
    ref_col = quantize_wgrad_operand(x, signs, four_over_six=True)
    for fp16 in (False, True):
        rd, rs, cd, cs, _ = quantize_operand_tensors(x, rowwise=True, colwise=True, signs=signs, row_staged=fp16,
                                                     col_staged=fp16, four_over_six=True)
        for got, scales, ref, what in ((rd, rs, ref_row, "row"), (cd, cs, ref_col, "column")):
            if fp16:
                want = ref.scaled_codes(torch.float16).cpu()
                assert got.dtype == torch.float16 and scales.numel() == 0, what
                assert same_values(got, want), what
                assert torch.equal(got.cpu().signbit(), want.signbit()), what
            else:
                assert torch.equal(got.cpu(), ref.data.cpu()), what
                assert torch.equal(scales.view(torch.uint8).cpu(), ref.scale.view(torch.uint8).cpu()), what
    ref_w = quantize_nvfp4(x, block_shape=(16, 16), four_over_six=True)
    d16, s16, dt16, st16, _ = quantize_weight_2d_tensors(x, staged=True, four_over_six=True)
    want = ref_w.scaled_codes(torch.float16).cpu()
    assert d16.dtype == torch.float16 and torch.equal(d16.cpu(), want)
    assert torch.equal(dt16.cpu(), ref_w.t().data.cpu())


def test_grouped_kernels_take_one_tensor_scale_per_expert():
    from titan_nvfp4.kernels.quantize import quantize_weight_2d_tensors

    x = inputs(96, 64, "heavy")
    offsets = torch.tensor([32, 32, 80], dtype=torch.int32, device=DEV)  # an empty expert, a 16-row tail
    rd, rs, _, _, gs = quantize_operand_tensors(x, groups=offsets, four_over_six=True)
    for e, (a, b) in enumerate(((0, 32), (32, 32), (32, 80), (80, 96))):
        if a == b:
            continue
        ref = quantize_nvfp4(x[a:b], four_over_six=True)
        assert torch.equal(rd[a:b].cpu(), ref.data.cpu()) and torch.equal(rs[a:b].view(torch.uint8).cpu(),
                                                                            ref.scale.view(torch.uint8).cpu())
        assert torch.equal(gs[0, e].cpu(), ref.global_scale.cpu())
    d, s, _, _, gw = quantize_weight_2d_tensors(x, experts=2, four_over_six=True)
    for e in range(2):
        ref = quantize_nvfp4(x[48 * e:48 * (e + 1)], (16, 16), four_over_six=True)
        assert torch.equal(d[48 * e:48 * (e + 1)].cpu(), ref.data.cpu()) and torch.equal(gw[e].cpu(), ref.global_scale.cpu())


def test_stochastic_rounding_keeps_the_nearest_even_choice_and_stays_unbiased():
    x = inputs(64, 64, "normal", torch.float32)
    rne = quantize_nvfp4(x, four_over_six=True)

    def sr(seed):
        s = torch.full((1,), seed, dtype=torch.int64, device=DEV)
        return quantize_operand(x, stochastic_row=True, seed=s, four_over_six=True)[0]

    a = sr(1)
    assert torch.equal(a.scale.view(torch.uint8).cpu(), rne.scale.view(torch.uint8).cpu())
    ref = quantize_nvfp4(x, stochastic=True, seed=1, four_over_six=True)
    assert torch.equal(ref.scale.view(torch.uint8).cpu(), rne.scale.view(torch.uint8).cpu())
    n = 48 if GPU else 16
    mean = sum(sr(100 + i).dequantize() for i in range(n)) / n
    gap = 2.0 * rne.row_scales().float().repeat_interleave(16, 1) * rne.global_scale
    blocks = x.view(64, 4, 16).abs()
    not_max = (blocks < blocks.amax(-1, keepdim=True)).view(64, 64)
    err = (mean - x)[not_max].abs() / gap[not_max]
    assert float(err.mean()) < 0.5 / n ** 0.5 * 1.5


@pytest.mark.parametrize("backend", ["reference", "emulated"])
def test_linear_with_four_over_six_on_every_backend(backend):
    """The knob reaches every GEMM operand: the emulated backend equals the reference one, and the
    forward output is closer to float64 than with the six rule on heavy-tailed inputs."""
    from titan_nvfp4 import NVFP4Linear, NVFP4Recipe

    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-3, 4, (64, 128), generator=g))).to(DEV)
    w0 = torch.randn(96, 128, generator=g).to(DEV)
    dy = torch.randn(64, 96, generator=g).to(DEV)
    outs = {}
    for rule in ("six", "four_over_six"):
        for be in ("reference", backend):
            recipe = NVFP4Recipe(gemm_backend=be, block_scale_rule=rule, stochastic_rounding=False)
            lin = NVFP4Linear(128, 96, bias=False, recipe=recipe).to(DEV)
            with torch.no_grad():
                lin.weight.copy_(w0)
            x = x0.clone().requires_grad_(True)
            y = lin(x)
            y.backward(dy)
            outs[rule, be] = (y.detach(), x.grad, lin.weight.grad)
        for r, e in zip(outs[rule, "reference"], outs[rule, backend]):
            assert torch.allclose(r, e, rtol=1e-5, atol=1e-6), rule
    exact = x0.double() @ w0.double().t()
    err = {rule: float(((outs[rule, backend][0].double() - exact) ** 2).sum()) for rule in ("six", "four_over_six")}
    assert err["four_over_six"] < err["six"], err
    assert not torch.equal(outs["six", backend][1], outs["four_over_six", backend][1])  # dgrad changed too


def test_knob_validation_and_the_refused_combination():
    from titan_nvfp4 import NVFP4Recipe
    from titan_nvfp4.integration.job_config import NVFP4GroupedMMConfig, NVFP4LinearConfig

    assert NVFP4LinearConfig(block_scale_rule="four_over_six").build_recipe().four_over_six
    assert NVFP4GroupedMMConfig(block_scale_rule="four_over_six").build_recipe().four_over_six
    assert not NVFP4Recipe().four_over_six
    with pytest.raises(ValueError, match=r"block_scale_rule must be one of \['six', 'four_over_six'\], got '4/6'"):
        NVFP4LinearConfig(block_scale_rule="4/6")
    with pytest.raises(ValueError, match="fsdp_nvfp4_all_gather.*four_over_six"):
        NVFP4LinearConfig(block_scale_rule="four_over_six", fsdp_nvfp4_all_gather=True)
