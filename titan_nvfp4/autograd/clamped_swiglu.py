"""gpt-oss's clamped SwiGLU between the expert GEMMs, keeping only its input for backward.

TorchTitan's gpt-oss experts compute swiglu(x) = (c · σ(α·c)) · (l + 1) in eager ops, where c and l are x's even and
odd columns clamped to the limit (c from above, l on both sides); TorchTitan 0.3 forms the last product as
addcmul(g, g, l) with g = c · σ(α·c) (one rounding instead of two: ``addcmul=True``). Autograd then keeps x and four
more tensors of half x's size (c, σ(α·c), g, l + 1 or l) from forward to backward: three times x in all. This
function keeps x alone and recomputes those four in backward with the same ops, then applies the derivative of each
op as autograd defines it: the output and the gradient are the same bits as autograd's of TorchTitan's formula
(tests/test_clamped_swiglu.py), for one more pass over x in backward. It is what the fused SwiGLU of the other
experts (nvfp4_grouped_swiglu) already does for theirs.
"""

from __future__ import annotations

import torch

#: TorchTitan's gpt-oss defaults (models/gpt_oss/model/moe.py: swiglu), checked against it by the tests
ALPHA = 1.702
LIMIT = 7.0


def _intermediates(x: torch.Tensor, alpha: float, limit: float, addcmul: bool):
    """c, σ(α·c), g = c·σ(α·c) and the last product's other factor (l + 1, or l for 0.3's ``addcmul``), op for op
    as TorchTitan's swiglu forms them."""
    c = x[..., ::2].clamp(min=None, max=limit)
    lin = x[..., 1::2].clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * c)
    return c, s, c * s, (lin if addcmul else lin + 1)


def _forward(x: torch.Tensor, alpha: float, limit: float, addcmul: bool) -> torch.Tensor:
    """TorchTitan's swiglu, op for op (0.2's, or 0.3's with ``addcmul``)."""
    _, _, out_glu, lin1 = _intermediates(x, alpha, limit, addcmul)
    return torch.addcmul(out_glu, out_glu, lin1) if addcmul else out_glu * lin1


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float, limit: float, addcmul: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.alpha, ctx.limit, ctx.addcmul = alpha, limit, addcmul
        with torch.no_grad():
            return _forward(x, alpha, limit, addcmul)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        alpha, limit = ctx.alpha, ctx.limit
        with torch.no_grad():
            c, s, out_glu, lin1 = _intermediates(x, alpha, limit, ctx.addcmul)
            # out_glu * lin1 (or addcmul(out_glu, out_glu, lin1), lin1 then the clamped l, whose self and tensor1
            # gradients autograd sums), then out_glu = c * s and s = sigmoid(alpha * c): each op's derivative as
            # autograd's
            g_out_glu, g_lin1 = g * lin1, g * out_glu
            if ctx.addcmul:
                g_out_glu = g + g_out_glu
            g_c = g_out_glu * s
            g_s = g_out_glu * c
            del out_glu, lin1
            g_c = g_c + torch.ops.aten.sigmoid_backward(g_s, s) * alpha  # c's two uses, summed as autograd does
            del g_s, s, c
            zero = torch.zeros((), dtype=g.dtype, device=g.device)
            x_glu, x_lin = x[..., ::2], x[..., 1::2]
            # the clamps' derivative (autograd's clamp_backward), interleaved back into x's columns; autograd adds
            # the two column slices' zero-filled gradients, which turns a -0 into +0: so does the final + 0
            dx = torch.stack((torch.where(x_glu <= limit, g_c, zero),
                              torch.where((x_lin >= -limit).logical_and_(x_lin <= limit), g_lin1, zero)), dim=-1)
            dx = dx.view(x.shape).add_(0)
        return dx, None, None, None


def clamped_swiglu(x: torch.Tensor, alpha: float = ALPHA, limit: float = LIMIT, addcmul: bool = False) -> torch.Tensor:
    """TorchTitan's gpt-oss swiglu(x, alpha, limit) (0.3's with ``addcmul``), the same bits forward and backward,
    keeping only x for backward."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return _forward(x, alpha, limit, addcmul)
    return _ClampedSwiGLU.apply(x, alpha, limit, addcmul)
