"""The NVFP4 linear as an autograd function: Y = X Wᵀ (+ b) with all three GEMMs in NVFP4.

| GEMM  | operands                                   | rounding                 |
| fprop | X 1×16 along K, W 16×16 (or 1×16 along K)  | nearest-even             |
| dgrad | dY 1×16 along N, W read transposed         | dY stochastic, W nearest |
| wgrad | dYᵀ, Xᵀ: 16 along tokens, both after RHT   | dY stochastic, X nearest |

Forward saves X only in its wgrad-ready NVFP4 form (plus the quantized weight), never in BF16.
``recipe.backward`` = "mxfp8" or "bf16" keeps the NVFP4 forward and runs dgrad and wgrad in MXFP8
(ops.gemm.mxfp8_gemm: 1×32 blocks along each contraction dim) or in the compute dtype; forward then
saves the weight and X (MXFP8 Xᵀ blocked along the tokens, or X in the compute dtype).

``high_precision_forward`` (``bf16_after_scope = "forward"`` after the switch, NVIDIA arXiv 2509.25149) runs the
forward GEMM as F.linear does, in the compute dtype, while dgrad and wgrad stay as above: forward still quantizes
W and X (from the high-precision operands, as before the switch) for the backward only.
"""

from __future__ import annotations

import functools

import torch

from .body_graphs import BodyGraphs, leaving
from .ms_eden_backward import ms_eden_backward, operand_values, saved_operand
from ..distributed.amax import AmaxGroups, all_reduce_max, sharding_groups
from ..distributed.fsdp_all_gather import NVFP4GatheredWeight, gathered_nvfp4
from ..numerics.mxfp8 import MXFP8Tensor
from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.rht import rht_signs, signs_for_operand
from ..ops import (mxfp8_gemm, mxfp8_operands, nvfp4_gemm, operand_amax, quantize_activation, quantize_gradient,
                  quantize_weight, resolve_backend, staged_for_gemms)
from ..recipe.nvfp4_recipe import NVFP4Recipe
from .sibling_x import plain_eager, shared_staging, shared_x_operands


@functools.lru_cache(maxsize=None)
def cached_rht_signs(seed: int, device: torch.device) -> torch.Tensor:
    """The RHT signs of ``seed`` on ``device``, made once: the tensor every layer's signs buffer points at
    (layer_state.py), and the signs of callers that hold none. Never written in place; a normal tensor even
    when first asked for under inference mode (autograd may save it)."""
    with torch.inference_mode(False):
        return rht_signs(seed, device)


_SEED_MASK = 2**62 - 1
_SEED_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def sr_seed(recipe: NVFP4Recipe, layer_id: int, call: int) -> int:
    """The Philox / generator seed of backward call ``call`` of layer ``layer_id``: distinct per
    (sr_seed, layer, call) and reproducible. Python twin of ``next_sr_seed``."""
    base = (recipe.sr_seed * _SEED_MIX[0] + layer_id * _SEED_MIX[1]) & _SEED_MASK
    return (base + call * _SEED_MIX[2]) & _SEED_MASK


def sr_counter(recipe: NVFP4Recipe, layer_id: int, device: torch.device | str = "cpu", rank: int = 0) -> torch.Tensor:
    """A layer's stochastic-rounding state: int64 [per-layer base, backward calls so far]. It lives on
    the device so that the seed is computed there: a compiled backward reads and advances it instead
    of baking one Python int into the graph. ``rank`` (the global rank) gives every rank a stream of its
    own: data-parallel ranks round different gradients, tensor-parallel ranks different shards, and
    neither should reuse another's random numbers. Rank 0's stream is the single-process one."""
    base = (sr_seed(recipe, layer_id, 0) + rank * _SEED_MIX[0] * _SEED_MIX[2]) & _SEED_MASK
    return torch.tensor([base, 0], dtype=torch.int64, device=device)


def next_sr_seed(counter: torch.Tensor) -> torch.Tensor:
    """The seed of this call as an int64 tensor [1] (sr_seed's formula), and advance the call count."""
    seed = (counter[0:1] + counter[1:2] * _SEED_MIX[2]) & _SEED_MASK
    counter[1:2].add_(1)
    return seed


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype under autocast, as F.linear (and TorchAO's Float8Linear, before it quantizes)
    casts its input: NVFP4 then quantizes what a BF16 Linear would multiply, the same whether the model runs
    under autocast (one GPU, fp32 parameters) or in BF16 (FSDP2's mixed precision). Else ``x`` itself."""
    dev = x.device.type
    if dev == "meta" or not x.is_floating_point() or not torch.is_autocast_enabled(dev):
        return x
    return x.to(torch.get_autocast_dtype(dev))


def autocast_out_dtype(x: torch.Tensor) -> torch.dtype:
    """Under autocast the output takes the autocast dtype, as nn.Linear's would; the NVFP4 math itself
    then runs with autocast off (its fp32 accumulator must not be rounded to 16 bits)."""
    dev = x.device.type
    if dev == "meta":  # no autocast there (shape inference): the input's dtype
        return x.dtype
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def x_amaxes(x: torch.Tensor, out_dtype: torch.dtype, signs: torch.Tensor | None, recipe: NVFP4Recipe, backend: str,
             need_wgrad: bool) -> torch.Tensor:
    """fp32 [row, column] tensor amaxes of X as forward quantizes it: x [..., K] in ``out_dtype`` (the autocast
    cast, autocast_out_dtype), the column amax that of RHT(X)ᵀ (``signs`` as the recipe rounds them) when wgrad
    reads X in NVFP4, else 0. The one computation of X's amax for both of its users, which must agree bit for
    bit: the cross-rank all-reduce of tensor parallelism (_forward) and the amax history (NVFP4Linear)."""
    x2d = x.detach().reshape(-1, x.shape[-1]).to(out_dtype)
    # else backward reads X itself (MXFP8 / BF16) or re-quantizes X̂ (ms_eden): no Xᵀ operand from forward
    fp4_wgrad = need_wgrad and recipe.backward == "nvfp4" and not recipe.ms_eden
    x_signs = signs_for_operand(signs, x2d.dtype, recipe.rht_round_to_input_dtype) if fp4_wgrad else None
    return operand_amax(x2d, fp4_wgrad, x_signs, backend)


def nvfp4_parts(t: NVFP4Tensor) -> tuple[torch.Tensor, ...]:
    """An NVFP4Tensor's tensors (codes, scales, global scale), as save_for_backward takes them."""
    return (t.data, t.scale, t.global_scale)


def nvfp4_from_parts(data, scale, gs, like_shape, block_shape) -> NVFP4Tensor:
    """The NVFP4Tensor of nvfp4_parts' tensors and its shape and block shape."""
    return NVFP4Tensor(data=data, scale=scale, global_scale=gs, shape=like_shape, block_shape=block_shape)


def _quantized_x(x2d, x_amax, *, recipe, signs, out_dtype, need_col, backend, shared_x, reader, row_staged=True):
    """X's forward operand and, when ``need_col``, its wgrad operand Xᵀ: X cast to ``out_dtype`` (the autocast cast,
    see _forward) and quantized, once per ``shared_x`` for sibling Linears (sibling_x.py; ``reader`` names the
    layer), whichever forward body asks. ``row_staged``: X staged on the emulated backend, else its codes
    (quantize_activation)."""
    four_over_six = recipe.four_over_six

    def quantize_x():
        xc = x2d.to(out_dtype)
        x_signs = signs_for_operand(signs, xc.dtype, recipe.rht_round_to_input_dtype)
        return quantize_activation(xc, need_col, x_signs, backend, x_amax, four_over_six=four_over_six,
                                   row_staged=row_staged)

    if shared_x is None:
        return quantize_x()
    key = (x2d.shape, out_dtype, need_col, backend, four_over_six, recipe.rht_round_to_input_dtype, row_staged)
    return shared_x_operands(shared_x, signs, key, quantize_x, reader)


def _forward_body(x2d, x_amax=None, *, weight, bias, recipe, signs, out_dtype, need_col, backend, w_amax,
                  shared_x=None, reader=None):
    """Forward's GPU work as tensors: (Y, Wᵀ's codes, scales and decode scale, then Xᵀ's when ``need_col``)
    and their (shape, block shape) metadata; body_graphs.py may replay it as a CUDA graph. It takes the
    layer's ``signs`` and casts them here: a graph replays its reads at their captured addresses, and a cast
    made outside the body would be freed after the capture. ``shared_x``: the eager X that x2d views, whose
    quantization sibling Linears share (sibling_x.py), read by the layer ``reader`` identifies."""
    four_over_six = recipe.four_over_six
    xq, x_col = _quantized_x(x2d, x_amax, recipe=recipe, signs=signs, out_dtype=out_dtype, need_col=need_col,
                             backend=backend, shared_x=shared_x, reader=reader)
    if isinstance(weight, NVFP4GatheredWeight):  # FSDP2 gathered it as NVFP4: distributed/fsdp_all_gather.py
        wq = gathered_nvfp4(weight)
        w_t = wq.t()
    else:
        wq, w_t = quantize_weight(weight, recipe.weight_2d, backend, w_amax, four_over_six=four_over_six)
    y = nvfp4_gemm(xq, wq, out_dtype=out_dtype, bias=bias, backend=backend)
    tensors = (y, *nvfp4_parts(w_t)) + (nvfp4_parts(x_col) if x_col is not None else ())
    return tensors, ((w_t.shape, w_t.block_shape), (x_col.shape, x_col.block_shape) if x_col is not None else None)


def _forward_body_high_precision(x2d, x_amax=None, *, weight, bias, recipe, signs, out_dtype, need_col, backend,
                                 w_amax, need_w_t, shared_x=None, reader=None):
    """_forward_body after a forward-only switch (``high_precision_forward``): Y as F.linear computes it in
    ``out_dtype``, then, for an NVFP4 backward only, Wᵀ for dgrad (when ``need_w_t``: backward will run) and Xᵀ
    in its wgrad form (when ``need_col``), quantized from W and X exactly as _forward_body quantizes them, so the
    backward is unchanged. Returns what _forward_body returns (Y alone when nothing is quantized)."""
    if isinstance(weight, NVFP4GatheredWeight):
        raise RuntimeError("NVFP4 linear: a forward in high precision (bf16_after_scope = \"forward\") cannot read "
                           "a weight all-gathered as NVFP4 codes (fsdp_nvfp4_all_gather)")
    xc = x2d.to(out_dtype)
    y = torch.nn.functional.linear(xc, weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
    if not need_w_t:
        return (y,), (None, None)
    x_col = None
    if need_col:  # siblings share one quantization of X whichever forward they run
        _, x_col = _quantized_x(x2d, x_amax, recipe=recipe, signs=signs, out_dtype=out_dtype, need_col=True,
                                backend=backend, shared_x=shared_x, reader=reader)
    _, w_t = quantize_weight(weight, recipe.weight_2d, backend, w_amax, four_over_six=recipe.four_over_six)
    tensors = (y, *nvfp4_parts(w_t)) + (nvfp4_parts(x_col) if x_col is not None else ())
    return tensors, ((w_t.shape, w_t.block_shape), (x_col.shape, x_col.block_shape) if x_col is not None else None)


def _forward_body_ms_eden(x2d, x_amax=None, *, weight, bias, recipe, out_dtype, backend, w_amax, saving,
                          high_precision_forward, shared_x=None, reader=None):
    """Forward under ``recipe.ms_eden`` (ms_eden_backward.py): Y from X (1×16 along K) and W quantized as the recipe
    says, nearest; returns (Y, what backward re-quantizes of X̂ and of Ŵ) as (tensors, metadata): the forward's
    quantizations themselves (saved_operand: X̂ as NVFP4 codes on every backend), or X and W in the compute dtype
    after a forward-only switch."""
    xc = x2d.to(out_dtype)
    if high_precision_forward:
        y = torch.nn.functional.linear(xc, weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
        x_saved, w_saved = saved_operand(xc), saved_operand(weight.to(out_dtype))
    else:
        xq, _ = _quantized_x(x2d, x_amax, recipe=recipe, signs=None, out_dtype=out_dtype, need_col=False,
                             backend=backend, shared_x=shared_x, reader=reader, row_staged=False)
        if isinstance(weight, NVFP4GatheredWeight):
            wq = gathered_nvfp4(weight)
        else:
            wq, _ = quantize_weight(weight, recipe.weight_2d, backend, w_amax, four_over_six=recipe.four_over_six,
                                    transposed=False, staged=False)
        # X̂ and Ŵ as codes (saved: 0.56 bytes per element), staged for the GEMM on the emulated backend as their
        # quantizers would have staged them (the same values); a 1×16 Ŵ the GEMM stages itself, as it always did
        w_gemm = staged_for_gemms(wq, backend) if recipe.weight_2d else wq
        y = nvfp4_gemm(staged_for_gemms(xq, backend), w_gemm, out_dtype=out_dtype, bias=bias, backend=backend)
        x_saved, w_saved = saved_operand(xq), saved_operand(wq)
    if not saving:
        return (y,), None
    return (y, *x_saved[0], *w_saved[0]), (len(x_saved[0]), x_saved[1], w_saved[1])


def _staged_x_col(x_col: NVFP4Tensor, ctx):
    """wgrad's Xᵀ operand, staged by its own op (ops/gemm.py): sibling layers on one X stage it once, under
    compile by CSE and in eager through sibling_x.shared_staging (not inside a body graph, nor under a mode)."""
    def stage():
        return staged_for_gemms(x_col, ctx.backend)

    if ctx.backend != "emulated" or ctx.graphs is not None or not plain_eager() or type(x_col.data) is not torch.Tensor:
        return stage()
    return shared_staging(x_col.data, x_col.scale, (tuple(x_col.shape), tuple(x_col.block_shape)), stage)


def _backward_body(dy2d, dy_amax=None, *, ctx, saved, need_dx, need_dw, need_db, out_dtypes, dx_round=None):
    """Backward's GPU work as tensors: (dX, dW, db), None where not needed; body_graphs.py may replay it."""
    recipe: NVFP4Recipe = ctx.recipe
    signs, *saved = saved
    w_t = nvfp4_from_parts(*saved[:3], *ctx.w_t_meta)
    out_features = w_t.shape[1]
    signs = signs_for_operand(signs, dy2d.dtype, recipe.rht_round_to_input_dtype)
    seed = next_sr_seed(ctx.counter) if recipe.stochastic_rounding else None
    dyq, dy_col = quantize_gradient(dy2d, need_dx, need_dw, signs, seed, ctx.backend, dy_amax,
                                    four_over_six=recipe.four_over_six, sr_block_scale=recipe.sr_block_scale)

    # Each dY operand is dropped right after its GEMM, and the GEMM that leaves the lower peak
    # memory runs first (_wgrad_first); the two are independent, so the bits do not depend on it.
    dx = dw = db = None
    m, k = dy2d.shape[0], w_t.shape[0]
    x_dtype, w_dtype = out_dtypes
    for gemm in (("dw", "dx") if _wgrad_first(m, k, out_features) else ("dx", "dw")):
        if gemm == "dw":
            if need_dw:
                x_col = _staged_x_col(nvfp4_from_parts(*saved[3:6], *ctx.x_col_meta), ctx)
                dw = nvfp4_gemm(dy_col, x_col, out_dtype=w_dtype, backend=ctx.backend)
                del x_col
            dy_col = None
        else:
            if need_dx:
                dx = nvfp4_gemm(dyq, w_t, out_dtype=x_dtype, backend=ctx.backend, round_to=dx_round)
            dyq = None
    if need_db:
        db = dy2d.float().sum(0).to(dy2d.dtype)
    return (dx, dw, db), None


def mxfp8_backward(dy2d: torch.Tensor, x_col: MXFP8Tensor | None, weight: torch.Tensor, backend: str, *,
                   need_dx: bool, w_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An MXFP8 backward: dX [M, K] = dY·W in dY's dtype (blocks along N) when ``need_dx``, and dW = dYᵀ·X (blocks
    along the tokens) in ``w_dtype`` when ``x_col`` (Xᵀ in MXFP8, saved by forward) is given; fp32 accumulation.
    dY and Wᵀ feed one GEMM each at once: staged (dequantized by the kernel), not codes."""
    dt = dy2d.dtype
    dy_row, dy_col = mxfp8_operands(dy2d, need_dx, x_col is not None, backend, staged=True)
    dx = dw = None
    if need_dx:
        _, w_col = mxfp8_operands(weight.to(dt), False, True, backend, staged=True)
        dx = mxfp8_gemm(dy_row, w_col, dt)
    if x_col is not None:
        dw = mxfp8_gemm(dy_col, x_col, w_dtype)
    return dx, dw


class NVFP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe,
                counter: torch.Tensor, signs: torch.Tensor | None, need_wgrad: bool,
                groups: AmaxGroups | None = None, x_amax: torch.Tensor | None = None,
                graphs: BodyGraphs | None = None, high_precision_forward: bool = False) -> torch.Tensor:
        out_dtype = autocast_out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return NVFP4LinearFunction._forward(ctx, x, weight, bias, recipe, counter, signs, out_dtype, need_wgrad,
                                                groups if groups is not None else AmaxGroups(), x_amax, graphs,
                                                high_precision_forward)

    @staticmethod
    def _forward(ctx, x, weight, bias, recipe, counter, signs, out_dtype, need_wgrad, groups, x_amax, graphs,
                 high_precision_forward=False):
        backend = resolve_backend(recipe.gemm_backend, x.device)
        in_features = weight.shape[1]
        # X as F.linear multiplies it under autocast: cast to the autocast dtype (out_dtype), here rather than
        # before the Function so that sibling layers' casts of one X stay separate autograd-wise (each dX is
        # widened on its own, as for BF16 Linears) while compile's CSE merges their forward casts. Eager siblings
        # on one X made in this forward share its cast and quantization (sibling_x.py): _forward_body casts then.
        x2d = x.reshape(-1, in_features)
        share = (plain_eager() and graphs is None and not groups.sharded and x_amax is None
                 and type(x) is torch.Tensor and not x.is_inference())  # an inference tensor has no version counter
        if not share:
            x2d = x2d.to(out_dtype)
        # a sharded operand (tensor parallelism) takes the amax of the whole operand: distributed/amax.py
        fp4_wgrad = need_wgrad and recipe.backward == "nvfp4"  # else backward reads X itself (MXFP8 / BF16)
        w_amax = None
        if x_amax is None and groups.x is not None:
            x_amax = all_reduce_max(x_amaxes(x2d, out_dtype, signs, recipe, backend, need_wgrad), groups.x)
        if groups.weight is not None and not isinstance(weight, NVFP4GatheredWeight):  # gathered: scales reduced
            w_amax = all_reduce_max(operand_amax(weight, False, None, backend)[:1], groups.weight)
        body = functools.partial(_forward_body, weight=weight, bias=bias, recipe=recipe, signs=signs,
                                 out_dtype=out_dtype, need_col=fp4_wgrad, backend=backend, w_amax=w_amax)
        copied = [x2d] if x_amax is None else [x2d, x_amax]
        saving = any(ctx.needs_input_grad[:3])  # backward will run and read what forward saves
        if high_precision_forward:  # bf16_after_scope = "forward": Y in the compute dtype, W and X for backward
            body = functools.partial(_forward_body_high_precision, **body.keywords,
                                     need_w_t=saving and recipe.backward == "nvfp4")
        ctx.fwd_key = ctx.graphs = None
        ctx.ms_eden = recipe.ms_eden and recipe.backward == "nvfp4"
        if ctx.ms_eden:  # Quartet II: forward saves X̂ and Ŵ for a backward that re-quantizes them (no body graphs)
            reader = counter.data_ptr() if share else None
            tensors, meta = _forward_body_ms_eden(
                *copied, weight=weight, bias=bias, recipe=recipe, out_dtype=out_dtype, backend=backend, w_amax=w_amax,
                saving=saving, high_precision_forward=high_precision_forward, shared_x=x if share else None,
                reader=reader)
            ctx.recipe, ctx.backend, ctx.groups, ctx.hp_backward, ctx.has_bias = recipe, backend, groups, False, bias is not None
            ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.q_dtype = x.shape, x.dtype, weight.dtype, out_dtype
            ctx.counter, ctx.ms_meta, ctx.need_wgrad = counter, meta, need_wgrad
            if saving:
                ctx.save_for_backward(*tensors[1:])
            return tensors[0].reshape(*x.shape[:-1], weight.shape[0])
        if graphs is not None and not groups.sharded and backend == "emulated" and recipe.backward == "nvfp4" \
                and not isinstance(weight, NVFP4GatheredWeight):
            key = ("fwd", x2d.shape, x2d.stride(), x2d.dtype, out_dtype, fp4_wgrad, x_amax is not None, saving,
                   high_precision_forward)
            tensors, meta, replayed = graphs.run(key, body, copied, [weight, bias, signs], ctx if saving else None)
            if replayed:
                tensors = leaving(tensors[:1], True) + tuple(tensors[1:])  # y leaves; the rest stays for backward
                ctx.fwd_key = key if saving else None
            ctx.graphs = graphs
        else:
            reader = counter.data_ptr() if share else None  # the layer's SR counter: one storage per layer
            tensors, meta = body(*copied, shared_x=x if share else None, reader=reader)
        y, saved_w_t, saved_x_col = tensors[0], tensors[1:4], tensors[4:]
        ctx.has_bias, ctx.hp_backward = bias is not None, recipe.backward != "nvfp4"
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.q_dtype = x.shape, x.dtype, weight.dtype, out_dtype
        ctx.recipe, ctx.backend, ctx.groups = recipe, backend, groups
        if ctx.hp_backward:  # MXFP8 / BF16 backward: X for wgrad (Xᵀ in MXFP8, or in the compute dtype) and W
            ctx.compute_dtype = out_dtype
            x_saved: tuple = (None, None)
            if need_wgrad and recipe.backward == "mxfp8":  # blocks along the tokens: ~half the bytes of BF16 X
                _, x_col = mxfp8_operands(x2d.to(out_dtype), False, True, backend)
                x_saved = (x_col.data, x_col.scale)
            elif need_wgrad:
                x_saved = (x2d.to(out_dtype), None)
            ctx.save_for_backward(*x_saved, weight)
            return y.reshape(*x.shape[:-1], weight.shape[0])

        # Saved for backward: Wᵀ quantized for dgrad and Xᵀ in its wgrad form, never X in BF16.
        ctx.w_t_meta, ctx.x_col_meta = meta
        # The SR counter rides on ctx, not in save_for_backward: backward advances it in place, and
        # with several forwards before their backwards (pipeline microbatches, a shared layer)
        # saved-tensor version checks would reject the later backward.
        ctx.counter = counter
        ctx.save_for_backward(signs, *saved_w_t, *saved_x_col)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _backward_hp(ctx, dy: torch.Tensor):
        """dX = dY·W and dW = dYᵀ·X in MXFP8 (blocks along N for dgrad, along the tokens for wgrad) or
        in the compute dtype (BF16 under mixed precision), fp32 accumulation either way."""
        x_a, x_b, weight = ctx.saved_tensors
        dt = ctx.compute_dtype
        dy2d = dy.reshape(-1, weight.shape[0]).to(dt)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and x_a is not None
        dx = dw = db = None
        if ctx.recipe.backward == "mxfp8":
            dx, dw = mxfp8_backward(dy2d, MXFP8Tensor(x_a, x_b) if need_dw else None, weight, ctx.backend,
                                    need_dx=need_dx, w_dtype=ctx.w_dtype)
            if dx is not None:
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        else:
            if need_dx:
                dx = (dy2d @ weight.to(dt)).to(ctx.x_dtype).reshape(ctx.x_shape)
            if need_dw:
                dw = (dy2d.t() @ x_a).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.hp_backward:
                return NVFP4LinearFunction._backward_hp(ctx, dy)
            if ctx.ms_eden:
                return NVFP4LinearFunction._backward_ms_eden(ctx, dy)
            return NVFP4LinearFunction._backward(ctx, dy)

    @staticmethod
    def _backward_ms_eden(ctx, dy: torch.Tensor):
        """dX and dW by Quartet II's backward (ms_eden_backward.py), db as the sum of dY."""
        n_x, x_meta, w_meta = ctx.ms_meta
        saved = ctx.saved_tensors
        x_saved, w_saved = operand_values(saved[:n_x], x_meta), operand_values(saved[n_x:], w_meta)
        n_out = w_saved[0].shape[0]
        dy2d = dy.reshape(-1, n_out).to(ctx.q_dtype)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.need_wgrad
        widen_in_gemm = ctx.q_dtype != ctx.x_dtype and not torch.compiler.is_compiling()
        dx, dw = ms_eden_backward(dy2d, x_saved, w_saved, call_seed=next_sr_seed(ctx.counter),
                                  size=ctx.recipe.rht_size, backend=ctx.backend, need_dx=need_dx, need_dw=need_dw,
                                  out_dtypes=(ctx.x_dtype if widen_in_gemm else ctx.q_dtype, ctx.w_dtype),
                                  dx_round=ctx.q_dtype if widen_in_gemm else None,
                                  groups=ctx.groups if ctx.groups.sharded else None)
        db = dy2d.float().sum(0).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if dx is not None:
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None, None, None

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        saved = ctx.saved_tensors
        out_features = ctx.w_t_meta[0][1]
        dy2d = dy.reshape(-1, out_features)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and len(saved) > 4
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        dy_amax = None
        if ctx.groups.grad is not None:
            signs = signs_for_operand(saved[0], dy.dtype, ctx.recipe.rht_round_to_input_dtype)
            dy_amax = all_reduce_max(operand_amax(dy2d, need_dw, signs, ctx.backend), ctx.groups.grad)
        # dX in X's autocast dtype, widened to X's: compiled, the GEMM writes the 16-bit dX and inductor fuses the
        # widening into its consumer; eager, the GEMM stores the widened values itself (no widening kernel)
        widen_in_gemm = ctx.q_dtype != ctx.x_dtype and not torch.compiler.is_compiling()
        body = functools.partial(_backward_body, ctx=ctx, saved=saved, need_dx=need_dx, need_dw=need_dw,
                                 need_db=need_db, out_dtypes=(ctx.x_dtype if widen_in_gemm else ctx.q_dtype,
                                                              ctx.w_dtype),
                                 dx_round=ctx.q_dtype if widen_in_gemm else None)
        if ctx.graphs is not None and dy_amax is None:
            key = ("bwd", dy2d.shape, dy2d.stride(), dy2d.dtype, need_dx, need_dw, need_db)
            (dx, dw, db), _, replayed = ctx.graphs.run(key, body, [dy2d], [ctx.counter, *saved])
            if ctx.fwd_key is not None:
                ctx.graphs.release(ctx.fwd_key)  # the forward graph's outputs are read: free to overwrite
            if replayed:  # the graph's outputs are rewritten by its next replay
                dx, dw, db = leaving((dx, dw, db), True)
        else:
            (dx, dw, db), _ = body(dy2d, dy_amax)
        if dx is not None:  # in X's autocast dtype, widened as the backward of F.linear's input cast widens it
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)  # a no-op where the GEMM widened it
        return dx, dw, db, None, None, None, None, None, None, None, None


def _wgrad_first(m: int, k: int, n: int) -> bool:
    """Whether backward should run wgrad before dgrad: the order whose peak is lower, counting what the
    emulated backend holds (bytes of fp16 = 2 per element): dY staged both ways (m·n each), dX (m·k),
    dW (n·k), dgrad's staging chunk of Wᵀ (at most STAGE_BYTES) and wgrad's staged Xᵀ (m·k, whole:
    staged_for_gemms). dgrad first: max(dY + dYᵀ + Wᵀ chunk + dX, dYᵀ + dX + Xᵀ + dW); wgrad first:
    max(dY + dYᵀ + Xᵀ + dW, dY + dW + Wᵀ chunk + dX)."""
    from ..kernels.gemm import STAGE_BYTES  # here: the kernels load only when a kernel backend runs

    dy, dx, dw = 2 * m * n, 2 * m * k, 2 * n * k
    sd, sw = min(STAGE_BYTES, dw), dx
    return max(2 * dy + sw + dw, dy + dw + sd + dx) < max(2 * dy + sd + dx, dy + dx + sw + dw)


def meta_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Shape inference for a meta-device x: Y [..., N] on meta in x's dtype (differentiable), nothing quantized."""
    meta = dict(device="meta", dtype=x.dtype)
    return torch.nn.functional.linear(x, weight.to(**meta), None if bias is None else bias.to(**meta))


def _check_linear_args(x, weight, bias, recipe, counter, signs) -> None:
    """nvfp4_linear's operands: floating-point tensors of matching shapes (x [..., K], weight [N, K], bias [N]) on
    one device, an NVFP4Recipe, and a counter and signs as sr_counter and rht_signs make them."""
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"nvfp4_linear: recipe must be an NVFP4Recipe, got {type(recipe).__name__}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("counter", counter), ("signs", signs)):
        if not isinstance(t, torch.Tensor) and not (name != "x" and name != "weight" and t is None):
            raise TypeError(f"nvfp4_linear: {name} must be a torch.Tensor, got {type(t).__name__}")
        if name in ("x", "weight", "bias") and t is not None and not t.is_floating_point():
            raise TypeError(f"nvfp4_linear: {name} must be a floating-point tensor, got {t.dtype}")
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"nvfp4_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit: x [..., K] "
                         "times weight [N, K]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"nvfp4_linear: bias of shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if counter is not None and (counter.dtype != torch.int64 or tuple(counter.shape) != (2,)):
        raise ValueError(f"nvfp4_linear: counter must be an int64 tensor of shape (2,) (sr_counter), got {counter.dtype} "
                         f"{tuple(counter.shape)}")
    if signs is not None and (tuple(signs.shape) != (16,) or not signs.is_floating_point()):
        raise ValueError(f"nvfp4_linear: signs must be a floating-point tensor of shape (16,) (rht_signs), got "
                         f"{signs.dtype} {tuple(signs.shape)}")
    if not x.is_meta:
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.device != x.device:
                hint = " (not materialized: to_empty() and initialize it first)" if t.is_meta else ""
                raise ValueError(f"nvfp4_linear: x is on {x.device} but {name} on {t.device}{hint}")


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe,
                 counter: torch.Tensor | None = None, signs: torch.Tensor | None = None,
                 groups: AmaxGroups | None = None, x_amax: torch.Tensor | None = None,
                 graphs: BodyGraphs | None = None, *, high_precision_forward: bool = False) -> torch.Tensor:
    """Functional NVFP4 linear (see the module docstring for the recipe). ``counter``: the layer's
    ``sr_counter`` (a fresh layer-0 one if None); ``signs``: the RHT signs (from recipe.rht_seed if None);
    ``groups``: the process groups sharding X, W and dY (tensor parallelism), whose tensor amaxes are
    then all-reduced so that every rank quantizes with the whole operand's tensor scale; ``x_amax``:
    fp32 [row, column] amaxes to quantize X with instead of its own (an amax history: amax_history.py);
    ``graphs``: the layer's BodyGraphs, to replay its bodies as CUDA graphs in eager mode (body_graphs.py);
    ``high_precision_forward``: the forward GEMM in the compute dtype, dgrad and wgrad in NVFP4 (bf16_after_scope).
    Under autocast X is quantized in the autocast dtype, as F.linear casts it, and dX leaves in it, widened."""
    _check_linear_args(x, weight, bias, recipe, counter, signs)
    if x.is_meta:
        return meta_linear(x, weight, bias)
    # Grad mode is off inside Function.forward, so decide here whether the wgrad operand is needed:
    # under no_grad / inference_mode the RHT + quantization of X would be thrown away.
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    if counter is None:
        counter = sr_counter(recipe, 0, x.device)
    if signs is None and recipe.rht:
        signs = cached_rht_signs(recipe.rht_seed, x.device)
    if graphs is not None and torch.compiler.is_compiling():  # compiled: inductor's own CUDA graphs, if any
        graphs = None
    return NVFP4LinearFunction.apply(x, weight, bias, recipe, counter, signs if recipe.rht else None, need_wgrad,
                                     sharding_groups(groups), x_amax, graphs, high_precision_forward)
