"""The NVFP4 grouped GEMM of MoE experts as an autograd function: Y[rows of expert e] = X_e W_eᵀ (+ b_e).

Definition: each expert's rows are an NVFP4 linear of their own (linear_function.py), so every
quantized operand has a per-expert tensor scale:

| GEMM  | operands of expert e                                  | rounding                 |
| fprop | X_e 1×16 along K, W_e 16×16 (or 1×16 along K)         | nearest-even             |
| dgrad | dY_e 1×16 along N, W_e read transposed                | dY stochastic, W nearest |
| wgrad | dY_eᵀ, X_eᵀ: 16 along the expert's tokens, after RHT  | dY stochastic, X nearest |

``offsets`` (int32, [E]) are the cumulative token counts, as TorchTitan passes to torch._grouped_mm;
rows past offsets[-1] (TorchTitan's padding slack) belong to no expert: their output and gradient
are zero. An empty expert gets a zero weight (and bias) gradient. Token groups aligned to 16
(TorchTitan's token-group alignment, set by the converter) keep the wgrad blocks inside one expert
without padding; other sizes are zero-padded per expert, which leaves dW unchanged.

Two implementations of that definition:

  * grouped (the "emulated" backend, groups aligned to 16): each operand of all experts quantized in
    one launch with per-expert tensor scales, and one grouped GEMM launch per product
    (ops/grouped.py, kernels/grouped_gemm.py); the offsets stay on the device, nothing syncs.
  * per expert (the "reference" backend, unaligned groups, and "native": PyTorch offers no NVFP4
    grouped GEMM, its scaled_grouped_mm takes FP8 and MXFP8 scales only): the dense quantize/GEMM
    dispatch expert after expert, after reading the offsets on the host.

Stochastic rounding draws differ between the two (one Philox stream over all experts' blocks vs one
seed per expert); with nearest-even rounding they are bit-identical.
"""

from __future__ import annotations

import torch

from .linear_function import _repack, _signs, _unpack, autocast_out_dtype, next_sr_seed, sr_counter
from .ops import nvfp4_gemm, quantize_activation, quantize_gradient, quantize_weight, resolve_backend
from .ops import grouped as G
from .recipe import NVFP4Recipe

_SEED_MASK = 2**62 - 1
_EXPERT_MIX = 0xD6E8FEB86659FD93 & _SEED_MASK


def expert_bounds(offsets: torch.Tensor, rows: int, name: str = "grouped GEMM") -> list[tuple[int, int]]:
    """[(start, end)] per expert from the cumulative ``offsets``, checked against the row count."""
    ends = [int(v) for v in offsets.tolist()]
    bounds, start = [], 0
    for e, end in enumerate(ends):
        if end < start:
            raise ValueError(f"{name}: offsets must be non-decreasing, got {ends}")
        bounds.append((start, end))
        start = end
    if start > rows:
        raise ValueError(f"{name}: offsets end at {start} but the input has only {rows} rows")
    return bounds


def _expert_seed(seed: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert e's SR seed: the call's seed plus a per-expert offset, both below 2^62 (no int64 overflow)."""
    return None if seed is None else (seed + ((e * _EXPERT_MIX) & _SEED_MASK)) & _SEED_MASK


class NVFP4GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                recipe: NVFP4Recipe, counter: torch.Tensor, signs: torch.Tensor | None,
                need_wgrad: bool, grouped: bool) -> torch.Tensor:
        out_dtype = autocast_out_dtype(x)  # see linear_function.py
        ctx.grouped = grouped
        run = NVFP4GroupedMMFunction._forward_grouped if grouped else NVFP4GroupedMMFunction._forward
        with torch.autocast(x.device.type, enabled=False):
            return run(ctx, x, weight, bias, offsets, recipe, counter, signs, out_dtype, need_wgrad)

    @staticmethod
    def _forward_grouped(ctx, x, weight, bias, offsets, recipe, counter, signs, out_dtype, need_wgrad):
        n_experts, out_features, in_features = weight.shape
        x2d = x.reshape(-1, in_features)
        xq, x_col = G.quantize_tokens(x2d, offsets, True, need_wgrad, signs, None)
        w = G.quantize_experts(weight, recipe.weight_2d)
        y = G.gemm_rows(xq, w.w, offsets, out_features, out_features, 0, out_dtype, bias)
        ctx.counter = counter  # advanced in place by backward: see linear_function.py
        saved = [offsets, signs, *w.t.tensors()] + (list(x_col.tensors()) if x_col is not None else [])
        ctx.save_for_backward(*saved)
        ctx.w_t_meta = (w.t.tiles, w.row_step, w.col_step)
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_shape, ctx.w_dtype = x.shape, x.dtype, weight.shape, weight.dtype
        ctx.recipe = recipe
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def _forward(ctx, x, weight, bias, offsets, recipe, counter, signs, out_dtype, need_wgrad):
        backend = resolve_backend(recipe.gemm_backend, x.device)
        n_experts, out_features, in_features = weight.shape
        x2d = x.reshape(-1, in_features)
        bounds = expert_bounds(offsets, x2d.shape[0])
        if len(bounds) != n_experts:
            raise ValueError(f"grouped GEMM: {len(bounds)} offsets for {n_experts} experts")
        pieces, saved, metas = [], [signs], []
        for e, (start, end) in enumerate(bounds):
            if end == start:
                metas.append(None)
                continue
            xq, x_col = quantize_activation(x2d[start:end], need_wgrad, signs, backend)
            wq, w_t = quantize_weight(weight[e], recipe.weight_2d, backend)
            pieces.append((start, nvfp4_gemm(xq, wq, out_dtype=out_dtype,
                                             bias=None if bias is None else bias[e], backend=backend)))
            operands = [w_t] + ([x_col] if x_col is not None else [])
            metas.append([(t.shape, t.block_shape) for t in operands])
            for t in operands:
                saved += list(_unpack(t))
        y = x2d.new_zeros((x2d.shape[0], out_features), dtype=out_dtype)
        for start, piece in pieces:
            y[start:start + piece.shape[0]] = piece
        ctx.counter = counter  # advanced in place by backward: see linear_function.py
        ctx.save_for_backward(*saved)
        ctx.bounds, ctx.metas = bounds, metas
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_shape, ctx.w_dtype = x.shape, x.dtype, weight.shape, weight.dtype
        ctx.recipe, ctx.backend = recipe, backend
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        run = NVFP4GroupedMMFunction._backward_grouped if ctx.grouped else NVFP4GroupedMMFunction._backward
        with torch.autocast(dy.device.type, enabled=False):
            return run(ctx, dy)

    @staticmethod
    def _backward_grouped(ctx, dy: torch.Tensor):
        recipe: NVFP4Recipe = ctx.recipe
        offsets, signs, *saved = ctx.saved_tensors
        n_experts, out_features, in_features = ctx.w_shape
        dy2d = dy.reshape(-1, out_features)
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] and len(saved) > 3
        seed = next_sr_seed(ctx.counter) if recipe.stochastic_rounding else None
        dyq, dy_col = G.quantize_tokens(dy2d, offsets, need_dx, need_dw, signs, seed)
        dx = dw = db = None
        if need_dx:
            tiles, row_step, col_step = ctx.w_t_meta
            w_t = G.GroupedOperand(*saved[:3], tiles)
            dx = G.gemm_rows(dyq, w_t, offsets, in_features, row_step, col_step, ctx.x_dtype).reshape(ctx.x_shape)
        if need_dw:
            dw = G.gemm_tokens(dy_col, G.GroupedOperand(*saved[3:6]), offsets, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = G.expert_bias_grad(dy2d, offsets).to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        recipe: NVFP4Recipe = ctx.recipe
        signs, *saved = ctx.saved_tensors
        n_experts, out_features, in_features = ctx.w_shape
        dy2d = dy.reshape(-1, out_features)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        seed = next_sr_seed(ctx.counter) if recipe.stochastic_rounding else None
        dx = dy2d.new_zeros((dy2d.shape[0], in_features), dtype=ctx.x_dtype) if need_dx else None
        dw = dy2d.new_zeros(ctx.w_shape, dtype=ctx.w_dtype) if need_dw else None
        db = dy2d.new_zeros((n_experts, out_features), dtype=dy.dtype) if need_db else None
        i = 0
        for e, ((start, end), meta) in enumerate(zip(ctx.bounds, ctx.metas)):
            if meta is None:
                continue
            w_t = _repack(*saved[i:i + 3], *meta[0])
            x_col = _repack(*saved[i + 3:i + 6], *meta[1]) if len(meta) > 1 else None
            i += 3 * len(meta)
            dy_e = dy2d[start:end]
            want_dw = need_dw and x_col is not None
            dyq, dy_col = quantize_gradient(dy_e, need_dx, want_dw, signs, _expert_seed(seed, e), ctx.backend)
            if need_dx:
                dx[start:end] = nvfp4_gemm(dyq, w_t, out_dtype=ctx.x_dtype, backend=ctx.backend)
            if want_dw:
                dw[e] = nvfp4_gemm(dy_col, x_col, out_dtype=ctx.w_dtype, backend=ctx.backend)
            if need_db:
                db[e] = dy_e.float().sum(0).to(dy.dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None


def _use_grouped_kernels(backend: str, offsets: torch.Tensor, aligned: bool | None) -> bool:
    """The grouped kernels run on the emulated backend when every token group starts at a multiple
    of 16: ``aligned`` True (the caller knows it; checked on the device), else checked on the host."""
    if backend != "emulated":
        return False
    if aligned is None:
        return bool((offsets % 16 == 0).all())
    if aligned:
        torch._assert_async((offsets % 16 == 0).all(), "NVFP4 grouped GEMM: token groups must be aligned to 16")
    return aligned


def nvfp4_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                     recipe: NVFP4Recipe, counter: torch.Tensor | None = None,
                     signs: torch.Tensor | None = None, aligned: bool | None = None) -> torch.Tensor:
    """Functional NVFP4 grouped GEMM: x [T, K], weight [E, N, K] (nn.Linear layout per expert), bias
    [E, N] or None, offsets int [E] cumulative token counts; returns [T, N] (see the module docstring).
    ``aligned``: the caller guarantees token groups aligned to 16 (None: look at the offsets)."""
    if weight.dim() != 3:
        raise ValueError(f"grouped GEMM: expected 3D expert weights [E, N, K], got {tuple(weight.shape)}")
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    if counter is None:
        counter = sr_counter(recipe, 0, x.device)
    if signs is None and recipe.rht:
        signs = _signs(recipe.rht_seed, x.device)
    if weight.shape[1] % 16 or weight.shape[2] % 16:
        raise ValueError(f"grouped GEMM: NVFP4 needs expert weight dims that are multiples of 16, got "
                         f"{tuple(weight.shape)}")
    if offsets.dim() != 1 or offsets.numel() != weight.shape[0]:
        raise ValueError(f"grouped GEMM: expected {weight.shape[0]} offsets (one per expert), got shape "
                         f"{tuple(offsets.shape)}")
    grouped = _use_grouped_kernels(resolve_backend(recipe.gemm_backend, x.device), offsets, aligned)
    return NVFP4GroupedMMFunction.apply(x, weight, bias, offsets, recipe, counter, signs if recipe.rht else None,
                                        need_wgrad, grouped)


__all__ = ["NVFP4GroupedMMFunction", "expert_bounds", "nvfp4_grouped_mm"]
