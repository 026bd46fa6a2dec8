"""Quantization dispatch: what the autograd functions call to turn an operand into NVFP4.

Each function returns NVFP4Tensors in the reference layout whatever the backend, so the GEMM
dispatch and the tests never see a difference: bits are identical for nearest-even; stochastic
rounding draws from torch's generator (reference) or Philox (kernels), both seeded by ``seed``.
"""

from __future__ import annotations

import torch

from ..numerics.nvfp4 import NVFP4Tensor, quantize_nvfp4
from ..numerics.rht import rht


def quantize_rowwise(x2d: torch.Tensor, block_shape=(1, 16), stochastic: bool = False,
                     generator: torch.Generator | None = None) -> NVFP4Tensor:
    """Reference: NVFP4 of a 2D operand with blocks along its rows' contraction dim."""
    return quantize_nvfp4(x2d, block_shape=block_shape, stochastic=stochastic, generator=generator)


def quantize_wgrad_operand(x2d: torch.Tensor, signs: torch.Tensor | None, stochastic: bool = False,
                           generator: torch.Generator | None = None) -> NVFP4Tensor:
    """Reference: NVFP4 of x2dᵀ with 16-element blocks along the token dim (dim 0 of x2d), after the
    RHT when ``signs`` is given. Token counts that are not multiples of 16 are zero-padded: zero
    tokens add nothing to dW = dYᵀ X, so the product is unchanged."""
    tokens = x2d.shape[0]
    pad = (-tokens) % 16
    xt = x2d.t()
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    if signs is not None:
        xt = rht(xt, signs)
    return quantize_nvfp4(xt.contiguous(), block_shape=(1, 16), stochastic=stochastic, generator=generator)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _seed_tensor(seed: int | None, device: torch.device) -> torch.Tensor | None:
    # torch.full fills on the device: no host-to-device copy, no sync
    return None if seed is None else torch.full((1,), seed, dtype=torch.int64, device=device)


def quantize_activation(x2d: torch.Tensor, need_col: bool, signs: torch.Tensor | None,
                        backend: str) -> tuple[NVFP4Tensor, NVFP4Tensor | None]:
    """Forward operand X (1×16, nearest-even) and, when ``need_col``, its wgrad operand Xᵀ."""
    if backend == "reference":
        return quantize_rowwise(x2d), (quantize_wgrad_operand(x2d, signs) if need_col else None)
    from ..kernels.quantize import quantize_operand
    return quantize_operand(x2d, rowwise=True, colwise=need_col, signs=signs)


def quantize_gradient(dy2d: torch.Tensor, need_row: bool, need_col: bool, signs: torch.Tensor | None,
                      seed: int | None, backend: str) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """dgrad operand dY (1×16) and wgrad operand dYᵀ (RHT, 16 along tokens); stochastic iff seed is set."""
    sr = seed is not None
    if backend == "reference":
        gen = _generator(seed, dy2d.device)  # one stream: the row draws, then the column draws
        row = quantize_rowwise(dy2d, stochastic=sr, generator=gen) if need_row else None
        col = quantize_wgrad_operand(dy2d, signs, stochastic=sr, generator=gen) if need_col else None
        return row, col
    from ..kernels.quantize import quantize_operand
    return quantize_operand(dy2d, rowwise=need_row, colwise=need_col, signs=signs, stochastic_row=sr,
                            stochastic_col=sr, seed=_seed_tensor(seed, dy2d.device))


def quantize_weight(w: torch.Tensor, weight_2d: bool, backend: str) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """The weight for forward (W, blocks along K) and for dgrad (Wᵀ, blocks along N): with 16×16 blocks
    the same quantization read both ways; with 1×16 blocks two separate quantizations."""
    if backend == "reference":
        if weight_2d:
            wq = quantize_rowwise(w, block_shape=(16, 16))
            return wq, wq.t()
        return quantize_rowwise(w), quantize_rowwise(w.t().contiguous())
    from ..kernels.quantize import quantize_operand, quantize_weight_2d
    if weight_2d:
        return quantize_weight_2d(w)
    return quantize_operand(w)[0], quantize_operand(w.t())[0]
