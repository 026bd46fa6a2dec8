"""The recipe's ``rht_round_to_input_dtype`` against Transformer Engine's published NVFP4 reference quantizer.

TE rounds the Hadamard-transformed wgrad operands to the input's dtype (bf16) before their amax and
quantization; with the knob on, our reference and our kernels give TE's codes, block scales and tensor amax
bit for bit; with it off (the default, fp32) about 1% of the codes differ.
"""

import pytest
import torch

import te_reference
from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.autograd.linear_function import nvfp4_linear
from titan_nvfp4.numerics.formats import unpack_nibbles
from titan_nvfp4.numerics.rht import rht, rht_signs, signs_for_operand
from titan_nvfp4.ops.backends import interpreting
from titan_nvfp4.ops.quantize import operand_amax, quantize_wgrad_operand

DEV = "cuda" if torch.cuda.is_available() else "cpu"
kernels_here = pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")

te = te_reference.load()
needs_te = pytest.mark.skipif(te is None, reason="the transformer_engine wheel (test extra) is not installed")


def bf16_operand(kind: str, seed: int, m: int = 128, k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if kind == "channel_outliers":  # magnitudes over 2^±12 across features
        x = x * torch.exp2(torch.randint(-12, 13, (1, k), generator=g).float())
    elif kind == "ties":  # many equal magnitudes and exact zeros: transforms with cancellations and ties
        x = torch.randint(-2, 3, (m, k), generator=g).float() * 0.5
    elif kind == "zero_blocks":
        x[16:48] = 0
    return x.bfloat16()


KINDS = ("gaussian", "channel_outliers", "ties", "zero_blocks")


@needs_te
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rounding_on_gives_te_reference_bits(kind, seed):
    x = bf16_operand(kind, seed)
    signs = rht_signs(seed + 7)
    te_codes, te_scales, te_amax = te_reference.wgrad_operand(x, signs)
    ours = quantize_wgrad_operand(x, signs_for_operand(signs, x.dtype, True))
    # (TE writes an exact -0 as code 0, we as 8: the same value; compare the decoded magnitudes' codes)
    a, b = unpack_nibbles(ours.data), unpack_nibbles(te_codes)
    zero = (a & 7) == 0
    assert torch.equal(torch.where(zero, 0, a), torch.where((b & 7) == 0, 0, b))
    assert torch.equal(ours.scale.view(torch.uint8), te_scales.view(torch.uint8))
    assert torch.equal(operand_amax(x, True, signs_for_operand(signs, x.dtype, True), "reference")[1:], te_amax)


@needs_te
def test_rounding_off_differs_from_te_in_about_one_percent_of_codes():
    x = bf16_operand("gaussian", 3, m=512, k=128)
    signs = rht_signs(0)
    te_codes, _, _ = te_reference.wgrad_operand(x, signs)
    ours = quantize_wgrad_operand(x, signs_for_operand(signs, x.dtype, False))
    share = (unpack_nibbles(ours.data) != unpack_nibbles(te_codes)).float().mean().item()
    assert 0.002 < share < 0.03


def test_signs_dtype_follows_the_knob_and_the_operand():
    s = rht_signs(0)
    assert signs_for_operand(s, torch.bfloat16, True).dtype == torch.bfloat16
    assert signs_for_operand(s, torch.float16, True).dtype == torch.float16
    assert signs_for_operand(s, torch.float32, True).dtype == torch.float32  # fp32 inputs: nothing to round
    assert signs_for_operand(s.bfloat16(), torch.bfloat16, False).dtype == torch.float32
    assert signs_for_operand(None, torch.bfloat16, True) is None
    x = bf16_operand("gaussian", 0)
    y = rht(x.t().contiguous(), signs_for_operand(s, x.dtype, True))
    assert y.dtype == torch.float32 and torch.equal(y, y.bfloat16().float())
    assert not torch.equal(rht(x.t().contiguous(), s), y)


@kernels_here
@pytest.mark.parametrize("kind", ["gaussian", "channel_outliers"])
def test_kernels_equal_the_reference_with_rounding(kind):
    """Codes, scales and amaxes of the kernels (nearest-even) as the reference's; with stochastic rounding
    the same block scales (SR changes codes only)."""
    from titan_nvfp4.kernels.quantize import operand_amax_tensors, quantize_operand

    x = bf16_operand(kind, 5, m=40, k=32).to(DEV)  # 40 tokens: zero-padded to whole blocks
    signs = signs_for_operand(rht_signs(1), x.dtype, True).to(DEV)
    ref = quantize_wgrad_operand(x.cpu(), signs.cpu())
    for sr in (False, True):
        seed = torch.tensor([11], dtype=torch.int64, device=DEV) if sr else None
        _, col = quantize_operand(x, rowwise=False, colwise=True, signs=signs, stochastic_col=sr, seed=seed)
        assert torch.equal(col.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8))
        assert sr or torch.equal(col.data.cpu(), ref.data)
    assert torch.equal(operand_amax_tensors(x, True, signs).cpu(), operand_amax(x.cpu(), True, signs.cpu(), "reference"))


@kernels_here
def test_grouped_kernels_round_as_the_per_expert_reference():
    """MoE experts: with the knob on, the grouped kernels (one launch for all experts) give the per-expert
    reference's dW bit for bit (fp32 weights: dW in fp32, whose GEMMs the backends sum alike), and the knob
    changes dW."""
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([32, 32, 64], dtype=torch.int32, device=DEV)  # an empty expert; groups of 16
    x = torch.randn(64, 32, generator=g).bfloat16().to(DEV).requires_grad_()
    w = torch.randn(3, 32, 32, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(64, 32, generator=g).bfloat16().to(DEV)
    dws = {}
    for on, backend in ((True, "reference"), (True, "emulated"), (False, "reference")):
        r = NVFP4Recipe(gemm_backend=backend, stochastic_rounding=False, rht_round_to_input_dtype=on)
        x.grad = w.grad = None
        nvfp4_grouped_mm(x, w, offsets, None, r).backward(dy)
        dws[on, backend] = w.grad.clone()
    assert torch.equal(dws[True, "reference"], dws[True, "emulated"])
    assert not torch.equal(dws[False, "reference"], dws[True, "reference"])
