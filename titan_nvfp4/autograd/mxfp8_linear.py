"""The MXFP8 linear as an autograd function: Y = X Wᵀ with all three GEMMs in MXFP8 (OutControl's outlier channels).

| GEMM  | operands                                         | rounding     |
| fprop | X and W, 1×32 blocks along K                     | nearest-even |
| dgrad | dY 1×32 along N, W read transposed (along N)     | nearest-even |
| wgrad | dYᵀ and Xᵀ, 1×32 along the tokens (zero-padded)  | nearest-even |

E4M3 elements, E8M0 block scales rounded up (numerics/mxfp8.py), exact products and fp32 sums (ops.gemm.mxfp8_gemm),
as NVFP4LinearFunction's backward = "mxfp8" runs dgrad and wgrad. Forward saves Xᵀ in MXFP8 (blocks along the tokens)
and W. ``high_precision_forward``: the forward GEMM as F.linear computes it in the compute dtype (bf16_after_scope =
"forward" after the switch), the backward unchanged. No bias: the NVFP4 part beside it adds the layer's.
"""

from __future__ import annotations

import torch

from ..numerics.mxfp8 import MXFP8Tensor
from ..ops import mxfp8_gemm, mxfp8_operands, resolve_backend
from .linear_function import autocast_out_dtype, mxfp8_backward


class MXFP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, gemm_backend: str, need_wgrad: bool,
                high_precision_forward: bool = False) -> torch.Tensor:
        out_dtype = autocast_out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            backend = resolve_backend(gemm_backend, x.device)
            k = weight.shape[1]
            x2d = x.reshape(-1, k).to(out_dtype)  # the autocast cast, as F.linear multiplies X
            w = weight.to(out_dtype)
            if high_precision_forward:
                y = torch.nn.functional.linear(x2d, w)
                x_col = mxfp8_operands(x2d, False, True, backend)[1] if need_wgrad else None
            else:
                x_row, x_col = mxfp8_operands(x2d, True, need_wgrad, backend)
                w_row, _ = mxfp8_operands(w, True, False, backend, staged=True)
                y = mxfp8_gemm(x_row, w_row, out_dtype)
        ctx.backend, ctx.compute_dtype = backend, out_dtype
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.save_for_backward(*((x_col.data, x_col.scale) if x_col is not None else (None, None)), weight)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        """dX = dY·W and dW = dYᵀ·X, both operands in MXFP8 (blocks along N for dgrad, the tokens for wgrad)."""
        x_data, x_scale, weight = ctx.saved_tensors
        dt = ctx.compute_dtype
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and x_data is not None
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            dy2d = dy.reshape(-1, weight.shape[0]).to(dt)
            dx, dw = mxfp8_backward(dy2d, MXFP8Tensor(x_data, x_scale) if need_dw else None, weight, ctx.backend,
                                    need_dx=need_dx, w_dtype=ctx.w_dtype)
            if dx is not None:
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return dx, dw, None, None, None


def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor, gemm_backend: str = "auto", *,
                 high_precision_forward: bool = False) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ with forward, dgrad and wgrad in MXFP8 (K a multiple of 32: whole blocks); the
    output in X's autocast dtype, as F.linear's. ``gemm_backend``: the recipe's (auto, reference, ...)."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"mxfp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit: x [..., K] "
                         "times weight [N, K]")
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    return MXFP8LinearFunction.apply(x, weight, gemm_backend, need_wgrad, high_precision_forward)


__all__ = ["MXFP8LinearFunction", "mxfp8_linear"]
