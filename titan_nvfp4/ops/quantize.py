"""Quantization dispatch: the autograd functions call these; kernels register faster versions."""

from __future__ import annotations

import torch

from ..numerics.nvfp4 import NVFP4Tensor, quantize_nvfp4
from ..numerics.rht import rht


def quantize_rowwise(x2d: torch.Tensor, block_shape=(1, 16), stochastic: bool = False,
                     generator: torch.Generator | None = None) -> NVFP4Tensor:
    """NVFP4 of a 2D operand with blocks along its rows' contraction dim."""
    return quantize_nvfp4(x2d, block_shape=block_shape, stochastic=stochastic, generator=generator)


def quantize_wgrad_operand(x2d: torch.Tensor, signs: torch.Tensor | None, stochastic: bool = False,
                           generator: torch.Generator | None = None) -> NVFP4Tensor:
    """NVFP4 of x2dᵀ with 16-element blocks along the token dim (dim 0 of x2d), after the RHT
    when ``signs`` is given. Token counts that are not multiples of 16 are zero-padded: zero
    tokens add nothing to dW = dYᵀ X, so the product is unchanged."""
    tokens = x2d.shape[0]
    pad = (-tokens) % 16
    xt = x2d.t()
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    if signs is not None:
        xt = rht(xt, signs)
    return quantize_nvfp4(xt.contiguous(), block_shape=(1, 16), stochastic=stochastic, generator=generator)
