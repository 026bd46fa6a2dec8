"""TetraJet-v2's OutControl linear after its selection as one autograd function (modules/outcontrol.py picks the
channels): the selected input channels ``sel`` in MXFP8, the others ``rest`` in NVFP4, as the authors' code runs it
(thu-ml/TetraJet-v2-NVFP4Training, linear_mix.py; docs/recipe_sources.md §3.3).

| GEMM  | rest columns                                   | selected columns                          |
| fprop | NVFP4 with the recipe (+ bias), rounded        | MXFP8 fp32 sums added to it, one rounding |
| dgrad | one GEMM over **all** columns: dY in the recipe's backward format times Ŵ, the forward's quantized   |
|       | weight rebuilt from both parts and quantized again for dgrad (NVFP4: the recipe's weight quantizer,  |
|       | nearest; MS-EDEN with ``ms_eden``); dX comes out in the input's column order                        |
| wgrad | NVFP4 with the recipe (dYᵀ and Xᵀ after RHT)    | MXFP8, dYᵀ and Xᵀ blocked along the tokens |

Running dgrad over every column is the authors' choice, and the cheap one: a split dgrad needs dY in MXFP8 rows too
(a full pass over dY), a second dgrad GEMM, and a gather to put dX's two parts back in column order. The recipe's
other backwards keep their format over every column: ``backward = "mxfp8"`` is the MXFP8 backward of the whole
layer (blocks along N and along the tokens: per column, the same bits as split), ``"bf16"`` runs dgrad and the rest's
wgrad in the compute dtype (the selected columns' wgrad stays MXFP8). ``high_precision_forward``: the forward GEMM as
F.linear computes it over every column; the backward as above, from W and X quantized as the forward would have.
"""

from __future__ import annotations

import torch

from ..numerics.mxfp8 import MXFP8Tensor
from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import StagedOperand
from ..numerics.rht import signs_for_operand
from ..ops import (mxfp8_gemm, mxfp8_operands, nvfp4_gemm, quantize_activation, quantize_gradient, quantize_weight,
                   resolve_backend, staged_for_gemms)
from ..recipe.nvfp4_recipe import NVFP4Recipe
from .linear_function import autocast_out_dtype, mxfp8_backward, next_sr_seed, nvfp4_from_parts, nvfp4_parts
from .ms_eden_backward import ms_eden_backward, operand_values, saved_operand


def dequantized(op: NVFP4Tensor | StagedOperand) -> torch.Tensor:
    """The fp32 values q·e_b·s an NVFP4 operand stands for, in its storage layout (a staged operand's fp16 values are
    q·e_b exactly: numerics/operands.py)."""
    if isinstance(op, StagedOperand):
        return op.values.float() * op.global_scale.float()
    return op.dequantize(torch.float32)


def rebuilt_weight(w_rest: torch.Tensor, w_sel: torch.Tensor, rest: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Ŵ [N, K] in fp32: the rest columns' and the selected columns' quantized values put back in column order."""
    n, k = w_rest.shape[0], rest.numel() + sel.numel()
    out = torch.empty(n, k, dtype=torch.float32, device=w_rest.device)
    return out.index_copy_(1, rest, w_rest.float()).index_copy_(1, sel, w_sel.float())


class OutControlLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe,
                counter: torch.Tensor, signs: torch.Tensor | None, sel: torch.Tensor, rest: torch.Tensor,
                need_wgrad: bool, x_amax: torch.Tensor | None, high_precision_forward: bool) -> torch.Tensor:
        out_dtype = autocast_out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            y = OutControlLinearFunction._forward(ctx, x, weight, bias, recipe, counter, signs, sel, rest, need_wgrad,
                                                  x_amax, high_precision_forward, out_dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _forward(ctx, x, weight, bias, recipe, counter, signs, sel, rest, need_wgrad, x_amax, hp_forward, q):
        backend = resolve_backend(recipe.gemm_backend, x.device)
        k = weight.shape[1]
        x2d = x.reshape(-1, k).to(q)  # the autocast cast, as F.linear multiplies X
        x_rest, x_sel = x2d.index_select(1, rest), x2d.index_select(1, sel)
        w_rest, w_sel = weight.index_select(1, rest), weight.index_select(1, sel)
        saving = any(ctx.needs_input_grad[:3])
        need_dx = ctx.needs_input_grad[0]
        fp4_backward = recipe.backward == "nvfp4"
        ms_eden = recipe.ms_eden and fp4_backward
        fp4_wgrad = need_wgrad and fp4_backward and not ms_eden  # Xᵀ of the rest in NVFP4 from forward
        four_over_six = recipe.four_over_six
        # the forward's quantizations, which the backward's operands also come from (after a forward-only switch too,
        # except MS-EDEN's, which then re-quantizes X and W themselves, as NVFP4LinearFunction does)
        need_fp4 = not hp_forward or (saving and fp4_backward and not ms_eden)
        xq = x_col = wq = None
        if need_fp4:
            x_signs = signs_for_operand(signs, q, recipe.rht_round_to_input_dtype) if fp4_wgrad else None
            xq, x_col = quantize_activation(x_rest, fp4_wgrad, x_signs, backend, x_amax, four_over_six=four_over_six,
                                            row_staged=not ms_eden)  # MS-EDEN saves X̂'s codes
            wq, _ = quantize_weight(w_rest, recipe.weight_2d, backend, four_over_six=four_over_six, transposed=False)
        sel_wgrad = need_wgrad and recipe.backward != "mxfp8"  # mxfp8: Xᵀ of every column, below
        x_row8 = x_col8 = w_row8 = None
        if not hp_forward or sel_wgrad:
            x_row8, x_col8 = mxfp8_operands(x_sel, not hp_forward, sel_wgrad, backend)
        if need_fp4:
            w_row8, _ = mxfp8_operands(w_sel.to(q), True, False, backend, staged=True)
        if hp_forward:
            y = torch.nn.functional.linear(x2d, weight.to(q), None if bias is None else bias.to(q))
        else:
            x_gemm = staged_for_gemms(xq, backend) if ms_eden else xq
            y = mxfp8_gemm(x_row8, w_row8, q, addend=nvfp4_gemm(x_gemm, wq, out_dtype=q, bias=bias, backend=backend),
                           backend=backend)

        ctx.recipe, ctx.backend, ctx.counter, ctx.q_dtype = recipe, backend, counter, q
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.shape, x.dtype, weight.dtype, bias is not None
        ctx.fp4_backward, ctx.ms_eden = fp4_backward, ms_eden
        if not saving:
            return y
        # dgrad's weight: Ŵ rebuilt from both parts (an NVFP4 or MS-EDEN dgrad), else W itself (mxfp8 / bf16 backward)
        w_dgrad: tuple = ()
        if need_dx and fp4_backward:
            if ms_eden:
                w_dgrad = (weight.to(q) if hp_forward else rebuilt_weight(dequantized(wq), w_row8, rest, sel),)
            else:
                w_hat = rebuilt_weight(dequantized(wq), w_row8, rest, sel)
                _, w_t = quantize_weight(w_hat, recipe.weight_2d, backend, four_over_six=four_over_six, staged=False)
                w_dgrad = nvfp4_parts(w_t)
                ctx.w_t_meta = (w_t.shape, w_t.block_shape)
        # wgrad's X: the rest's Xᵀ in NVFP4 (MS-EDEN: X̂, or X after the switch), the selected columns' Xᵀ in MXFP8
        x_fp4: tuple = ()
        ctx.x_meta = None
        if need_wgrad and fp4_backward:
            if ms_eden:
                x_fp4, ctx.x_meta = saved_operand(x_rest if hp_forward else xq)
            else:
                x_fp4 = nvfp4_parts(x_col)
                ctx.x_meta = (x_col.shape, x_col.block_shape)
        elif need_wgrad and recipe.backward == "mxfp8":
            _, xc = mxfp8_operands(x2d, False, True, backend)  # every column's Xᵀ: the layer's whole MXFP8 wgrad
            x_fp4 = (xc.data, xc.scale)
        elif need_wgrad:
            x_fp4 = (x_rest,)
        x_mx = (x_col8.data, x_col8.scale) if x_col8 is not None else ()
        ctx.n_w, ctx.n_x, ctx.n_mx = len(w_dgrad), len(x_fp4), len(x_mx)
        keep_w = () if fp4_backward else (weight,)  # mxfp8 / bf16 dgrad reads W itself
        ctx.save_for_backward(signs, sel, rest, *w_dgrad, *x_fp4, *x_mx, *keep_w)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        with torch.autocast(dy.device.type, enabled=False):
            dx, dw, db = OutControlLinearFunction._backward(ctx, dy)
        return dx, dw, db, None, None, None, None, None, None, None, None

    @staticmethod
    def _backward(ctx, dy):
        signs, sel, rest, *saved = ctx.saved_tensors
        w_dgrad, saved = saved[:ctx.n_w], saved[ctx.n_w:]
        x_fp4, saved = saved[:ctx.n_x], saved[ctx.n_x:]
        x_mx, keep_w = saved[:ctx.n_mx], saved[ctx.n_mx:]
        recipe, backend, q = ctx.recipe, ctx.backend, ctx.q_dtype
        n = dy.shape[-1]
        dy2d = dy.reshape(-1, n).to(q)
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] and (ctx.n_x > 0)
        # dX in X's autocast dtype, widened in the GEMM's store in eager (as NVFP4LinearFunction does)
        widen = q != ctx.x_dtype and not torch.compiler.is_compiling()
        dx_dtype, dx_round = (ctx.x_dtype, q) if widen else (q, None)
        dx = dw = db = dw_rest = None
        if ctx.ms_eden:
            dx, dw_rest = ms_eden_backward(
                dy2d, operand_values(x_fp4, ctx.x_meta) if need_dw else None, (w_dgrad[0], None) if need_dx else None,
                call_seed=next_sr_seed(ctx.counter), size=recipe.rht_size, backend=backend, need_dx=need_dx,
                need_dw=need_dw, out_dtypes=(dx_dtype, ctx.w_dtype), dx_round=dx_round)
        elif ctx.fp4_backward:
            seed = next_sr_seed(ctx.counter) if recipe.stochastic_rounding else None
            dy_signs = signs_for_operand(signs, dy2d.dtype, recipe.rht_round_to_input_dtype)
            dyq, dy_col = quantize_gradient(dy2d, need_dx, need_dw, dy_signs, seed, backend,
                                            four_over_six=recipe.four_over_six, sr_block_scale=recipe.sr_block_scale)
            if need_dx:
                w_t = nvfp4_from_parts(*w_dgrad, *ctx.w_t_meta)
                dx = nvfp4_gemm(dyq, w_t, out_dtype=dx_dtype, backend=backend, round_to=dx_round)
            del dyq
            if need_dw:
                x_col = staged_for_gemms(nvfp4_from_parts(*x_fp4, *ctx.x_meta), backend)
                dw_rest = nvfp4_gemm(dy_col, x_col, out_dtype=ctx.w_dtype, backend=backend)
        elif recipe.backward == "mxfp8":  # the whole layer's MXFP8 backward: per column the split's bits
            dx, dw = mxfp8_backward(dy2d, MXFP8Tensor(*x_fp4) if need_dw else None, keep_w[0], backend,
                                    need_dx=need_dx, w_dtype=ctx.w_dtype)
        else:  # bf16: the compute dtype
            if need_dx:
                dx = dy2d @ keep_w[0].to(q)
            if need_dw:
                dw_rest = (dy2d.t() @ x_fp4[0]).to(ctx.w_dtype)
        if dw_rest is not None:  # the selected columns' wgrad in MXFP8, blocked along the tokens
            _, dy_col8 = mxfp8_operands(dy2d, False, True, backend, staged=True)
            dw_sel = mxfp8_gemm(dy_col8, MXFP8Tensor(*x_mx), ctx.w_dtype)
            dw = dw_rest.new_empty(n, rest.numel() + sel.numel())
            dw.index_copy_(1, rest, dw_rest).index_copy_(1, sel, dw_sel)
        if dx is not None:
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(dy.dtype)
        return dx, dw, db


def outcontrol_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe,
                      counter: torch.Tensor, signs: torch.Tensor | None, sel: torch.Tensor, rest: torch.Tensor, *,
                      x_amax: torch.Tensor | None = None, high_precision_forward: bool = False) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias) with the input channels ``sel`` (int64, a multiple of 32 of them) in MXFP8
    and ``rest`` (the others) in NVFP4 with ``recipe``: the module docstring. ``counter`` and ``signs``: the layer's
    stochastic-rounding counter and RHT signs (nvfp4_linear's); ``x_amax``: the rest columns' [row, column] amaxes
    to quantize them with (an amax history)."""
    k = weight.shape[-1]
    if weight.dim() != 2 or x.shape[-1] != k or sel.numel() + rest.numel() != k or sel.numel() % 32:
        raise ValueError(f"outcontrol_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, {sel.numel()} selected "
                         f"and {rest.numel()} other channels do not fit (x [..., K], weight [N, K], the two sets "
                         "partitioning K, the selected a multiple of 32)")
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    return OutControlLinearFunction.apply(x, weight, bias, recipe, counter, signs if recipe.rht else None, sel, rest,
                                          need_wgrad, x_amax, high_precision_forward)


__all__ = ["OutControlLinearFunction", "dequantized", "outcontrol_linear", "rebuilt_weight"]
