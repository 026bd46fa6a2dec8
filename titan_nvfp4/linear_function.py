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
from .ops import nvfp4_gemm, quantize_rowwise, quantize_wgrad_operand
from .recipe import NVFP4Recipe


@functools.lru_cache(maxsize=None)
def _signs(seed: int, device: torch.device) -> torch.Tensor:
    return rht_signs(seed, device)


def _sr_generator(recipe: NVFP4Recipe, layer_id: int, call: int, device: torch.device) -> torch.Generator:
    """A generator whose stream is distinct per (sr_seed, layer, backward call) and reproducible."""
    seed = (recipe.sr_seed * 0x9E3779B1 + layer_id * 0x85EBCA77 + call * 0xC2B2AE3D) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)


class SRState:
    """Per-layer stochastic-rounding bookkeeping: a stable layer index and a backward counter."""

    def __init__(self, layer_id: int = 0) -> None:
        self.layer_id = layer_id
        self.calls = 0

    def next_generator(self, recipe: NVFP4Recipe, device: torch.device) -> torch.Generator:
        gen = _sr_generator(recipe, self.layer_id, self.calls, device)
        self.calls += 1
        return gen


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
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        w_blocks = (16, 16) if recipe.weight_2d else (1, 16)
        xq = quantize_rowwise(x2d)
        wq = quantize_rowwise(weight, block_shape=w_blocks)
        y = nvfp4_gemm(xq, wq, out_dtype=out_dtype, bias=bias, backend=recipe.gemm_backend)

        if need_wgrad:
            signs = _signs(recipe.rht_seed, x.device) if recipe.rht else None
            x_col = quantize_wgrad_operand(x2d, signs)
            ctx.x_col_meta = (x_col.shape, x_col.block_shape)
        else:
            x_col = None
        ctx.wq_meta = (wq.shape, wq.block_shape)
        saved = list(_unpack(wq)) + (list(_unpack(x_col)) if x_col is not None else [])
        ctx.save_for_backward(weight, *saved)
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.recipe, ctx.sr_state = recipe, sr_state
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        with torch.autocast(dy.device.type, enabled=False):
            return NVFP4LinearFunction._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        recipe: NVFP4Recipe = ctx.recipe
        weight, *saved = ctx.saved_tensors
        wq = _repack(*saved[:3], *ctx.wq_meta)
        out_features = weight.shape[0]
        dy2d = dy.reshape(-1, out_features)
        sr = recipe.stochastic_rounding
        gen = ctx.sr_state.next_generator(recipe, dy.device) if sr else None

        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dyq = quantize_rowwise(dy2d, stochastic=sr, generator=gen)
            if recipe.weight_2d:
                w_t = wq.t()  # the same 16×16-quantized weight, read along N
            else:
                w_t = quantize_rowwise(weight.t().contiguous())
            dx = nvfp4_gemm(dyq, w_t, out_dtype=ctx.x_dtype, backend=recipe.gemm_backend).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_col = _repack(*saved[3:6], *ctx.x_col_meta)
            signs = _signs(recipe.rht_seed, dy.device) if recipe.rht else None
            dy_col = quantize_wgrad_operand(dy2d, signs, stochastic=sr, generator=gen)
            dw = nvfp4_gemm(dy_col, x_col, out_dtype=weight.dtype, backend=recipe.gemm_backend)
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
