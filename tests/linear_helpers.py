"""float64 references of the NVFP4 Linear's three GEMMs and their comparison, shared by the Linear tests."""

from __future__ import annotations
import torch
import torch.nn.functional as F
from titan_nvfp4 import NVFP4Recipe, quantize_nvfp4, rht, rht_signs
from titan_nvfp4.autograd.linear_function import sr_seed


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32 results: within 1e-5 relative. 16-bit results: the float64 reference rounded once."""
    ref = ref.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), what
    if got.dtype == torch.float32:
        err = rel(got, ref)
        assert err < 1e-5, f"{what}: relative error {err:.3g}"
        return
    # One rounding of ref to the output format: at most half an ulp (2^-8 relative for bf16).
    half_ulp = torch.finfo(got.dtype).eps / 2
    slack = 1e-6 * ref.abs().max()
    bad = (got.double() - ref).abs() > ref.abs() * half_ulp * (1 + 1e-3) + slack
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than half an ulp"
    same = (got == ref.to(got.dtype)).double().mean().item()
    assert same > 0.98, f"{what}: only {same:.3f} of elements equal the correctly rounded reference"


def wgrad_operand_ref(t2d: torch.Tensor, signs, **kw):
    """t2d^T (features, tokens) zero-padded to a multiple of 16 tokens, RHT'd, 1x16 NVFP4."""
    tt = F.pad(t2d.t(), (0, (-t2d.shape[0]) % 16))
    if signs is not None:
        tt = rht(tt, signs)
    return quantize_nvfp4(tt.contiguous(), (1, 16), **kw)


def reference(x2d, w, b, dy2d, recipe: NVFP4Recipe, layer_id: int, call: int) -> dict:
    """float64 y, dX, dW, db from the exact NVFP4 operands of the recipe."""
    xq = quantize_nvfp4(x2d, (1, 16))
    wq = quantize_nvfp4(w, (16, 16) if recipe.weight_2d else (1, 16))
    y = xq.dequantize().double() @ wq.dequantize().double().t()
    if b is not None:
        y = y + b.double()

    sr = recipe.stochastic_rounding
    gen = torch.Generator(device=x2d.device).manual_seed(sr_seed(recipe, layer_id, call)) if sr else None
    dyq = quantize_nvfp4(dy2d, (1, 16), stochastic=sr, generator=gen, sr_block_scale=recipe.sr_block_scale)
    if recipe.weight_2d:
        wt = wq.t()  # the very same 16x16 tiles, transposed
        assert torch.equal(wt.dequantize(), wq.dequantize().t())
    else:
        wt = quantize_nvfp4(w.t().contiguous(), (1, 16))
    dx = dyq.dequantize().double() @ wt.dequantize().double().t()

    signs = rht_signs(recipe.rht_seed) if recipe.rht else None
    dy_col = wgrad_operand_ref(dy2d, signs, stochastic=sr, generator=gen,  # same generator, continued
                               sr_block_scale=recipe.sr_block_scale)
    x_col = wgrad_operand_ref(x2d, signs)
    dw = dy_col.dequantize().double() @ x_col.dequantize().double().t()
    db = dy2d.double().sum(0) if b is not None else None
    return {"y": y, "dx": dx, "dw": dw, "db": db, "x_col": x_col}
