"""The NVFP4 linear as an autograd function: Y = X Wᵀ (+ b) with all three GEMMs in NVFP4.

| GEMM  | operands                                   | rounding                 |
| fprop | X 1×16 along K, W 16×16 (or 1×16 along K)  | nearest-even             |
| dgrad | dY 1×16 along N, W read transposed         | dY stochastic, W nearest |
| wgrad | dYᵀ, Xᵀ: 16 along tokens, both after RHT   | dY stochastic, X nearest |

Forward saves X only in its wgrad-ready NVFP4 form (plus the quantized weight), never in BF16.
"""

from __future__ import annotations

import functools

import torch

from .numerics.nvfp4 import NVFP4Tensor
from .numerics.rht import rht_signs
from .ops import nvfp4_gemm, quantize_activation, quantize_gradient, quantize_weight, resolve_backend
from .recipe import NVFP4Recipe


@functools.lru_cache(maxsize=None)
def _signs(seed: int, device: torch.device) -> torch.Tensor:
    return rht_signs(seed, device)


def sr_seed(recipe: NVFP4Recipe, layer_id: int, call: int) -> int:
    """A seed distinct per (sr_seed, layer, backward call) and reproducible."""
    return (recipe.sr_seed * 0x9E3779B1 + layer_id * 0x85EBCA77 + call * 0xC2B2AE3D) % (2**63 - 1)


class SRState:
    """Per-layer stochastic-rounding bookkeeping: a stable layer index and a backward counter."""

    def __init__(self, layer_id: int = 0) -> None:
        self.layer_id = layer_id
        self.calls = 0

    def next_seed(self, recipe: NVFP4Recipe) -> int:
        seed = sr_seed(recipe, self.layer_id, self.calls)
        self.calls += 1
        return seed


def _unpack(t: NVFP4Tensor) -> tuple[torch.Tensor, ...]:
    return (t.data, t.scale, t.global_scale)


def _repack(data, scale, gs, like_shape, block_shape) -> NVFP4Tensor:
    return NVFP4Tensor(data=data, scale=scale, global_scale=gs, shape=like_shape, block_shape=block_shape)


class NVFP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                recipe: NVFP4Recipe, sr_state: SRState, need_wgrad: bool) -> torch.Tensor:
        # Under autocast the output takes the autocast dtype, as nn.Linear's would; the NVFP4 math
        # itself must not be autocast (its fp32 accumulator would be rounded to 16 bits).
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            return NVFP4LinearFunction._forward(ctx, x, weight, bias, recipe, sr_state, out_dtype, need_wgrad)

    @staticmethod
    def _forward(ctx, x, weight, bias, recipe, sr_state, out_dtype, need_wgrad):
        backend = resolve_backend(recipe.gemm_backend, x.device)
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        signs = _signs(recipe.rht_seed, x.device) if recipe.rht else None
        xq, x_col = quantize_activation(x2d, need_wgrad, signs, backend)
        wq, w_t = quantize_weight(weight, recipe.weight_2d, backend)
        y = nvfp4_gemm(xq, wq, out_dtype=out_dtype, bias=bias, backend=backend)

        # Saved for backward: Wᵀ quantized for dgrad and Xᵀ in its wgrad form, never X in BF16.
        ctx.w_t_meta = (w_t.shape, w_t.block_shape)
        saved = list(_unpack(w_t))
        if x_col is not None:
            ctx.x_col_meta = (x_col.shape, x_col.block_shape)
            saved += list(_unpack(x_col))
        ctx.save_for_backward(*saved)
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.recipe, ctx.sr_state, ctx.backend = recipe, sr_state, backend
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        with torch.autocast(dy.device.type, enabled=False):
            return NVFP4LinearFunction._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        recipe: NVFP4Recipe = ctx.recipe
        saved = ctx.saved_tensors
        w_t = _repack(*saved[:3], *ctx.w_t_meta)
        out_features = w_t.shape[1]
        dy2d = dy.reshape(-1, out_features)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and len(saved) > 3
        seed = ctx.sr_state.next_seed(recipe) if recipe.stochastic_rounding else None
        signs = _signs(recipe.rht_seed, dy.device) if recipe.rht else None
        dyq, dy_col = quantize_gradient(dy2d, need_dx, need_dw, signs, seed, ctx.backend)

        dx = dw = db = None
        if need_dx:
            dx = nvfp4_gemm(dyq, w_t, out_dtype=ctx.x_dtype, backend=ctx.backend).reshape(ctx.x_shape)
        if need_dw:
            x_col = _repack(*saved[3:6], *ctx.x_col_meta)
            dw = nvfp4_gemm(dy_col, x_col, out_dtype=ctx.w_dtype, backend=ctx.backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None, None


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 recipe: NVFP4Recipe, sr_state: SRState | None = None) -> torch.Tensor:
    """Functional NVFP4 linear (see the module docstring for the recipe)."""
    # Grad mode is off inside Function.forward, so decide here whether the wgrad operand is needed:
    # under no_grad / inference_mode the RHT + quantization of X would be thrown away.
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    return NVFP4LinearFunction.apply(x, weight, bias, recipe, sr_state or SRState(), need_wgrad)
