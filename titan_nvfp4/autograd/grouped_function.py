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
    (ops/grouped.py, kernels/grouped_gemm.py); the offsets stay on the device, nothing syncs. A
    SwiGLU expert (nvfp4_grouped_swiglu) also gets its SwiGLU fused with the per-expert amaxes of h
    and, in backward, of dh1 and dh3 (kernels/swiglu.py), which then need no amax pass.
  * per expert (the "reference" backend, unaligned groups, and "native": PyTorch offers no NVFP4
    grouped GEMM, its scaled_grouped_mm takes FP8 and MXFP8 scales only): the dense quantize/GEMM
    dispatch expert after expert, after reading the offsets on the host.

Stochastic rounding draws differ between the two (one Philox stream over all experts' blocks vs one
seed per expert); with nearest-even rounding they are bit-identical.
"""

from __future__ import annotations

import functools

import torch

from .body_graphs import BodyGraphs, leaving
from ..distributed.amax import AmaxGroups, all_reduce_max, sharding_groups
from .linear_function import (autocast_input, autocast_out_dtype, cached_rht_signs, next_sr_seed, nvfp4_from_parts,
                              nvfp4_parts, sr_counter)
from ..numerics.rht import signs_for_operand
from ..ops import nvfp4_gemm, operand_amax, quantize_activation, quantize_gradient, quantize_weight, resolve_backend
from ..ops import grouped as G
from ..recipe.nvfp4_recipe import NVFP4Recipe

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
    """The per-expert loop (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                recipe: NVFP4Recipe, counter: torch.Tensor, signs: torch.Tensor | None,
                need_wgrad: bool, groups: AmaxGroups | None = None) -> torch.Tensor:
        out_dtype = autocast_out_dtype(x)  # see linear_function.py
        with torch.autocast(x.device.type, enabled=False):
            return NVFP4GroupedMMFunction._forward(ctx, x, weight, bias, offsets, recipe, counter, signs, out_dtype,
                                                   need_wgrad, groups if groups is not None else AmaxGroups())

    @staticmethod
    def _forward(ctx, x, weight, bias, offsets, recipe, counter, signs, out_dtype, need_wgrad, groups):
        backend = resolve_backend(recipe.gemm_backend, x.device)
        n_experts, out_features, in_features = weight.shape
        x2d = x.reshape(-1, in_features)
        bounds = expert_bounds(offsets, x2d.shape[0])  # one per expert: nvfp4_grouped_mm_shared checked it
        x_signs = signs_for_operand(signs, x.dtype, recipe.rht_round_to_input_dtype)
        x_amax = _expert_amaxes(x2d, bounds, need_wgrad, x_signs, backend, groups.x)
        w_amax = None
        if groups.weight is not None:  # every expert's weight amax, whole over the ranks sharding it
            w_amax = all_reduce_max(torch.stack([operand_amax(w, False, None, backend)[0] for w in weight]),
                                    groups.weight)
        pieces, saved, metas = [], [signs], []
        for e, (start, end) in enumerate(bounds):
            if end == start:
                metas.append(None)
                continue
            xq, x_col = quantize_activation(x2d[start:end], need_wgrad, x_signs, backend,
                                            None if x_amax is None else x_amax[e],
                                            four_over_six=recipe.four_over_six)
            wq, w_t = quantize_weight(weight[e], recipe.weight_2d, backend, None if w_amax is None else w_amax[e],
                                      four_over_six=recipe.four_over_six)
            pieces.append((start, nvfp4_gemm(xq, wq, out_dtype=out_dtype,
                                             bias=None if bias is None else bias[e], backend=backend)))
            operands = [w_t] + ([x_col] if x_col is not None else [])
            metas.append([(t.shape, t.block_shape) for t in operands])
            for t in operands:
                saved += list(nvfp4_parts(t))
        y = x2d.new_zeros((x2d.shape[0], out_features), dtype=out_dtype)
        for start, piece in pieces:
            y[start:start + piece.shape[0]] = piece
        ctx.counter = counter  # advanced in place by backward: see linear_function.py
        ctx.save_for_backward(*saved)
        ctx.bounds, ctx.metas = bounds, metas
        ctx.has_bias = bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_shape, ctx.w_dtype = x.shape, x.dtype, weight.shape, weight.dtype
        ctx.recipe, ctx.backend, ctx.groups = recipe, backend, groups
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        with torch.autocast(dy.device.type, enabled=False):
            return NVFP4GroupedMMFunction._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy: torch.Tensor):
        recipe: NVFP4Recipe = ctx.recipe
        signs, *saved = ctx.saved_tensors
        n_experts, out_features, in_features = ctx.w_shape
        dy2d = dy.reshape(-1, out_features)
        signs = signs_for_operand(signs, dy.dtype, recipe.rht_round_to_input_dtype)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        seed = next_sr_seed(ctx.counter) if recipe.stochastic_rounding else None
        dx = dy2d.new_zeros((dy2d.shape[0], in_features), dtype=ctx.x_dtype) if need_dx else None
        dw = dy2d.new_zeros(ctx.w_shape, dtype=ctx.w_dtype) if need_dw else None
        db = dy2d.new_zeros((n_experts, out_features), dtype=dy.dtype) if need_db else None
        dy_amax = _expert_amaxes(dy2d, ctx.bounds, need_dw, signs, ctx.backend, ctx.groups.grad)
        i = 0
        for e, ((start, end), meta) in enumerate(zip(ctx.bounds, ctx.metas)):
            if meta is None:
                continue
            w_t = nvfp4_from_parts(*saved[i:i + 3], *meta[0])
            x_col = nvfp4_from_parts(*saved[i + 3:i + 6], *meta[1]) if len(meta) > 1 else None
            i += 3 * len(meta)
            dy_e = dy2d[start:end]
            want_dw = need_dw and x_col is not None
            dyq, dy_col = quantize_gradient(dy_e, need_dx, want_dw, signs, _expert_seed(seed, e), ctx.backend,
                                            None if dy_amax is None else dy_amax[e],
                                            four_over_six=ctx.recipe.four_over_six, sr_block_scale=recipe.sr_block_scale)
            if need_dx:
                dx[start:end] = nvfp4_gemm(dyq, w_t, out_dtype=ctx.x_dtype, backend=ctx.backend)
            if want_dw:
                dw[e] = nvfp4_gemm(dy_col, x_col, out_dtype=ctx.w_dtype, backend=ctx.backend)
            if need_db:
                db[e] = dy_e.float().sum(0).to(dy.dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None


def _expert_amaxes(x2d: torch.Tensor, bounds, colwise: bool, signs: torch.Tensor | None, backend: str,
                   group) -> torch.Tensor | None:
    """fp32 [E, 2]: each expert's rows' (row, column) amaxes (operand_amax; 0 for an empty expert)
    all-reduced over ``group``, the ranks sharding the operand's features; None without a group."""
    if group is None:
        return None
    rows = [operand_amax(x2d[a:b], colwise, signs, backend) if b > a else x2d.new_zeros(2, dtype=torch.float32)
            for a, b in bounds]
    return all_reduce_max(torch.stack(rows), group)


#: NVFP4GroupedKernelFunction's arguments before ``params``
_FIXED_ARGS = 10


def _kernels_forward_body(x2d, offsets, x_amax=None, *, weights, biases, recipe, signs, need_wgrad, pair, out_dtype,
                          groups):
    """Forward's GPU work as tensors: the outputs (one [T, 2N] for a fused W1|W3 pair, else one per weight), X's
    wgrad operand when ``need_wgrad``, then each weight's Wᵀ; and their metadata. body_graphs.py may replay it as a
    CUDA graph, so it casts the ``signs`` it reads itself (a cast made outside would be freed after the capture)."""
    x_signs = signs_for_operand(signs, x2d.dtype, recipe.rht_round_to_input_dtype)
    if groups.x is not None:  # tokens whose features are sharded: per-expert amaxes over the ranks
        if x_amax is None:
            x_amax = G.token_amaxes(x2d, offsets, need_wgrad, x_signs)
        x_amax = all_reduce_max(x_amax, groups.x)
    xq, x_col = G.quantize_tokens(x2d, offsets, True, need_wgrad, x_signs, None,
                                  col_staged=recipe.staged_expert_activations,
                                  four_over_six=recipe.four_over_six, amaxes=x_amax)
    outs = []
    w_amaxes = [_weight_amax(w, groups) for w in weights]
    keep_t = not recipe.requantize_expert_weights  # else backward quantizes the weights again for dgrad
    if pair:  # W1|W3: one GEMM of both; the caller takes the halves as views
        both, *gws = G.quantize_expert_pair(*weights, *w_amaxes, four_over_six=recipe.four_over_six, transpose=keep_t)
        n_w = weights[0].shape[1]
        outs.append(G.gemm_rows(xq, both, offsets, 2 * n_w, 2 * n_w, 0, out_dtype, n_split=n_w))
    else:  # (a loop, not a comprehension: a closure over xq would keep dynamo from deleting it)
        gws = []
        for w, b, w_amax in zip(weights, biases, w_amaxes):
            gws.append(G.quantize_experts(w, recipe.weight_2d, w_amax, four_over_six=recipe.four_over_six,
                                          transpose=keep_t))
            outs.append(G.gemm_rows(xq, gws[-1].w, offsets, w.shape[1], w.shape[1], 0, out_dtype, b))
    saved = list(x_col.tensors()) if x_col is not None else []
    metas = [G.transpose_layout(recipe.weight_2d, *w.shape[1:]) for w in weights]
    for gw in gws if keep_t else ():
        saved += list(gw.t.tensors())  # Wᵀ for dgrad; X only in its wgrad form, as the dense linear
    del xq, gws
    return tuple(outs) + tuple(saved), (len(outs), x_col is not None, metas)


def _weight_amax(w: torch.Tensor, groups: AmaxGroups) -> torch.Tensor | None:
    """fp32 [E]: expert weights' amaxes all-reduced over the ranks sharding them; None (the quantizer's own) unsharded."""
    return all_reduce_max(G.expert_amaxes(w), groups.weight) if groups.weight is not None else None


def _kernels_backward_body(offsets, *grads, ctx, signs, saved, need_dx, wants_dw, need_dbs):
    """Backward's GPU work as tensors: (dX, dW per weight, db per weight), None where not needed, from ``grads``:
    the n dYs [T, N_j] and, with the amax carrier, its gradient (the dYs' per-expert amaxes). body_graphs.py may
    replay it: the SR seeds come from the counters on the device (next_sr_seed), advanced in place."""
    n, recipe = ctx.n, ctx.recipe
    x_col = G.GroupedOperand(*saved[:3]) if ctx.has_x_col else None
    saved = saved[3:] if ctx.has_x_col else saved
    dx, dws, dbs = None, [], []
    last_dw = -1  # (a loop: dynamo does not trace max() over a generator)
    for j in range(n):
        if wants_dw[j]:
            last_dw = j
    if wants_dw.count(True) > 1:  # saved as codes: staged once for all the wgrads that read it
        x_col = G.staged(x_col)
    dy_amaxes = list(grads[n]) if len(grads) > n else [None] * n
    for j in range(n):
        dy2d = grads[j]
        tiles, row_step, col_step = ctx.metas[j]
        dy_signs = signs_for_operand(signs, dy2d.dtype, recipe.rht_round_to_input_dtype)
        need_dw = wants_dw[j]
        seed = next_sr_seed(ctx.counters[j]) if recipe.stochastic_rounding else None
        dy_amax = dy_amaxes[j]
        if ctx.groups.grad is not None:  # dY's features sharded: per-expert amaxes over the ranks
            if dy_amax is None:
                dy_amax = G.token_amaxes(dy2d, offsets, need_dw, dy_signs)
            dy_amax = all_reduce_max(dy_amax, ctx.groups.grad)
        dyq, dy_col = G.quantize_tokens(dy2d, offsets, need_dx, need_dw, dy_signs, seed, col_staged=True,
                                        four_over_six=recipe.four_over_six, amaxes=dy_amax,
                                        sr_block_scale=recipe.sr_block_scale)
        # wgrad first, dY's staged column operand dropped before dgrad allocates its output
        dws.append(G.gemm_tokens(dy_col, x_col, offsets, ctx.w_dtypes[j]) if need_dw else None)
        del dy_col
        if j == last_dw:
            x_col = None  # freed before the last dgrad allocates its output
        if need_dx:  # summed in x's dtype (in the GEMM's epilogue), as autograd sums separate GEMMs'
            if recipe.requantize_expert_weights:  # saved: the weights; their Wᵀ made again (the forward's bits)
                w_t = G.expert_transposes(saved[j], recipe.weight_2d, _weight_amax(saved[j], ctx.groups),
                                          four_over_six=recipe.four_over_six)
            else:
                w_t = G.GroupedOperand(*saved[3 * j:3 * j + 3], tiles)
            dx = G.gemm_rows(dyq, w_t, offsets, ctx.x_shape[-1], row_step, col_step, ctx.x_dtype, add_to=dx)
            del w_t
        del dyq
        dbs.append(G.expert_bias_grad(dy2d, offsets).to(dy2d.dtype) if need_dbs[j] else None)
    return (dx, *dws, *dbs), None


class NVFP4GroupedKernelFunction(torch.autograd.Function):
    """The grouped kernels for ``n`` expert weights [E, N_i, K] that read the same routed tokens x (W1
    and W3 of a SwiGLU expert): x is quantized once for all of them; one output each. With the amax
    carrier (the fused SwiGLU), W1 and W3 run as one GEMM of 2·N outputs (ops.grouped.quantize_expert_pair)
    whose halves are the two outputs, as views. X's wgrad operand is saved staged (fp16 values,
    recipe.staged_expert_activations) or as codes, which backward then stages once for all the wgrads. Each weight's
    Wᵀ for dgrad is kept from forward, or with recipe.requantize_expert_weights quantized again in backward from
    the weight itself (saved instead: autograd's reference, no copy).
    ``params`` are the n weights, then their n biases (or None), then their n SR counters.

    ``x_amax``: x's per-expert amaxes (token_amaxes) from the kernel that produced x, so that x's
    quantization needs no amax pass. ``amax_carrier``: one more output, fp32 zeros [n, 2, E + 1],
    whose gradient is taken as the per-expert amaxes of the n dYs: the consumer of the outputs (the
    fused SwiGLU, _SwiGLUAmaxFunction) computes them with the dYs and hands them back this way, so
    dY's quantization needs no amax pass either, while each function frees its own saved tensors.

    ``graphs``: the call's BodyGraphs (eager_graphs; body_graphs.py), which replay the forward and backward bodies
    as CUDA graphs, the offsets copied in as an input (their values change every step, the token count does not);
    None, or a sharded operand (its amaxes all-reduced between the kernels), runs them eagerly."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, recipe: NVFP4Recipe, signs: torch.Tensor | None,
                need_wgrad: bool, n: int, groups: AmaxGroups | None, amax_carrier: bool,
                x_amax: torch.Tensor | None, graphs: BodyGraphs | None, *params):
        weights, biases, counters = params[:n], params[n:2 * n], params[2 * n:3 * n]
        groups = groups if groups is not None else AmaxGroups()
        out_dtype = autocast_out_dtype(x)  # see linear_function.py
        in_features = weights[0].shape[2]
        with torch.autocast(x.device.type, enabled=False):
            x2d = x.reshape(-1, in_features)
            pair = amax_carrier and _pair_fusable(recipe, weights, biases)
            kw = dict(weights=weights, biases=biases, recipe=recipe, signs=signs, need_wgrad=need_wgrad, pair=pair,
                      out_dtype=out_dtype, groups=groups)
            copied = [x2d, offsets] + ([x_amax] if x_amax is not None else [])
            ctx.graphs = ctx.fwd_key = None
            if graphs is not None and not groups.sharded:
                saving = any(ctx.needs_input_grad)  # backward will run and read what forward saves
                key = ("fwd", x2d.shape, x2d.stride(), x2d.dtype, offsets.shape, out_dtype, need_wgrad,
                       x_amax is not None, pair, saving)
                tensors, meta, replayed = graphs.run(key, functools.partial(_kernels_forward_body, **kw), copied,
                                                     [*weights, *biases, signs], ctx if saving else None)
                tensors = leaving(tensors[:meta[0]], replayed) + tuple(tensors[meta[0]:])  # the rest: for backward
                ctx.graphs, ctx.fwd_key = graphs, (key if replayed and saving else None)
            else:
                tensors, meta = _kernels_forward_body(*copied, **kw)
            n_outs, has_x_col, metas = meta
            outs, saved = list(tensors[:n_outs]), [offsets, signs, *tensors[n_outs:]]
            if recipe.requantize_expert_weights:  # backward quantizes them again for dgrad
                saved += weights
            if pair:
                n_w = weights[0].shape[1]
                outs = [outs[0][:, :n_w], outs[0][:, n_w:]]
            outs = [o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs]
            if amax_carrier:  # an absent gradient must stay None (no amaxes), not become zeros
                outs.append(x2d.new_zeros((n, 2, offsets.numel() + 1), dtype=torch.float32))
                ctx.set_materialize_grads(False)
        ctx.counters = counters  # advanced in place by backward: see linear_function.py
        ctx.save_for_backward(*saved)
        ctx.n, ctx.metas, ctx.has_x_col, ctx.has_bias = n, metas, has_x_col, [b is not None for b in biases]
        ctx.x_shape, ctx.x_dtype, ctx.recipe, ctx.groups = x.shape, x.dtype, recipe, groups
        ctx.w_dtypes, ctx.carrier = [w.dtype for w in weights], amax_carrier
        ctx.out_shapes, ctx.out_dtype = [(*x.shape[:-1], w.shape[1]) for w in weights], out_dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        offsets, signs, *saved = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        wants_dw = [ctx.needs_input_grad[_FIXED_ARGS + j] and ctx.has_x_col for j in range(n)]
        need_dbs = [ctx.has_bias[j] and ctx.needs_input_grad[_FIXED_ARGS + n + j] for j in range(n)]
        with torch.autocast(offsets.device.type, enabled=False):
            dys, carrier = grads[:n], None
            if ctx.carrier:  # the dYs' amaxes came as the carrier's gradient; a dY not given is zeros
                carrier = grads[n]
                dys = [dy if dy is not None else offsets.new_zeros(shape, dtype=ctx.out_dtype)
                       for dy, shape in zip(dys, ctx.out_shapes)]
            copied = [offsets, *(dy.reshape(-1, dy.shape[-1]) for dy in dys)]
            if carrier is not None:
                copied.append(carrier)
            kw = dict(ctx=ctx, signs=signs, saved=saved, need_dx=need_dx, wants_dw=wants_dw, need_dbs=need_dbs)
            if ctx.graphs is not None:
                key = ("bwd", tuple((t.shape, t.stride(), t.dtype) for t in copied), need_dx, tuple(wants_dw),
                       tuple(need_dbs))
                tensors, _, replayed = ctx.graphs.run(key, functools.partial(_kernels_backward_body, **kw), copied,
                                                      [*ctx.counters, signs, *saved])
                if ctx.fwd_key is not None:
                    ctx.graphs.release(ctx.fwd_key)  # the forward graph's outputs are read: free to overwrite
                tensors = leaving(tensors, replayed)
            else:
                tensors, _ = _kernels_backward_body(*copied, **kw)
        dx, dws, dbs = tensors[0], tensors[1:1 + n], tensors[1 + n:]
        return (dx.reshape(ctx.x_shape) if dx is not None else None, *([None] * (_FIXED_ARGS - 1)),
                *dws, *dbs, *([None] * n))


class _SwiGLUAmaxFunction(torch.autograd.Function):
    """h = silu(y1) ⊙ y2 and h's per-expert amaxes (not differentiable) from one fused pass; backward
    gives dy1, dy2 and, as the gradient of ``carrier`` (NVFP4GroupedKernelFunction's amax carrier),
    their per-expert amaxes [2, 2, E + 1] from one pass over dh. A function of its own, so that y1 and
    y2 are freed before the GEMMs' backward runs, as with the eager SwiGLU."""

    @staticmethod
    def forward(ctx, y1: torch.Tensor, y2: torch.Tensor, carrier: torch.Tensor, offsets: torch.Tensor,
                signs: torch.Tensor | None, h_colwise: bool, dy_colwise: bool):
        lead = y1.shape[:-1]
        h, h_amax = G.swiglu(y1.reshape(-1, y1.shape[-1]), y2.reshape(-1, y2.shape[-1]), offsets, h_colwise, signs)
        ctx.mark_non_differentiable(h_amax)
        ctx.save_for_backward(y1, y2, offsets, signs)
        ctx.dy_colwise = dy_colwise
        return h.reshape(*lead, h.shape[-1]), h_amax

    @staticmethod
    def backward(ctx, dh: torch.Tensor, _):
        y1, y2, offsets, signs = ctx.saved_tensors
        n = y1.shape[-1]
        d1, d2, a1, a2 = G.swiglu_backward(dh.reshape(-1, n).contiguous(), y1.reshape(-1, n), y2.reshape(-1, n),
                                           offsets, ctx.dy_colwise, signs)
        return d1.reshape(y1.shape), d2.reshape(y2.shape), torch.stack([a1, a2]), None, None, None, None


#: Whether SwiGLU experts run W1 and W3 as one grouped GEMM of both (off: two GEMMs, for A/B timing).
FUSE_W1_W3 = True


def _pair_fusable(recipe: NVFP4Recipe, weights, biases) -> bool:
    """W1 and W3 go through one GEMM (quantize_expert_pair): two bias-free weights of one shape, 16×16
    blocks (staged forward values). Hidden 1408 is 5.5 output tiles of 256 each but 11 together."""
    return (FUSE_W1_W3 and recipe.weight_2d and len(weights) == 2 and weights[0].shape == weights[1].shape
            and all(b is None for b in biases))


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


def _check(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("weight", weight), ("offsets", offsets), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            raise TypeError(f"grouped GEMM: {name} must be a torch.Tensor, got {type(t).__name__}")
    if weight.dim() != 3:
        raise ValueError(f"grouped GEMM: expected 3D expert weights [E, N, K], got {tuple(weight.shape)}")
    if weight.shape[1] % 16 or weight.shape[2] % 16:
        raise ValueError(f"grouped GEMM: NVFP4 needs expert weight dims that are multiples of 16, got "
                         f"{tuple(weight.shape)}")
    if offsets.dim() != 1 or offsets.numel() != weight.shape[0]:
        raise ValueError(f"grouped GEMM: expected {weight.shape[0]} offsets (one per expert), got shape "
                         f"{tuple(offsets.shape)}")
    if x.shape[-1] != weight.shape[2]:
        raise ValueError(f"grouped GEMM: input features {x.shape[-1]} do not match expert weights {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:2]):
        raise ValueError(f"grouped GEMM: bias of shape {tuple(bias.shape)}, expected {tuple(weight.shape[:2])} (one "
                         f"row per expert) for expert weights {tuple(weight.shape)}")


def nvfp4_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                     recipe: NVFP4Recipe, counter: torch.Tensor | None = None,
                     signs: torch.Tensor | None = None, aligned: bool | None = None,
                     groups: AmaxGroups | None = None, graphs: BodyGraphs | None = None) -> torch.Tensor:
    """Functional NVFP4 grouped GEMM: x [T, K], weight [E, N, K] (nn.Linear layout per expert), bias
    [E, N] or None, offsets int [E] cumulative token counts; returns [T, N] (see the module docstring).
    ``aligned``: the caller guarantees token groups aligned to 16 (None: look at the offsets).
    ``groups``: the process groups sharding X's features, the weights and dY's features (tensor
    parallelism of the experts), whose per-expert amaxes are then all-reduced over them. ``graphs``: the call's
    BodyGraphs, to replay the grouped kernels' bodies as CUDA graphs in eager mode (eager_graphs; body_graphs.py)."""
    return nvfp4_grouped_mm_shared(x, (weight,), offsets, (bias,), recipe, (counter,), signs, aligned, groups,
                                   graphs=graphs)[0]


def nvfp4_grouped_mm_shared(x: torch.Tensor, weights, offsets: torch.Tensor, biases, recipe: NVFP4Recipe,
                            counters=None, signs: torch.Tensor | None = None,
                            aligned: bool | None = None, groups: AmaxGroups | None = None,
                            x_amax: torch.Tensor | None = None, graphs: BodyGraphs | None = None) -> list[torch.Tensor]:
    """[nvfp4_grouped_mm(x, w_i, offsets, b_i, ...) for each i], with x quantized once on the grouped
    kernels (bit-identical to the separate calls). ``counters``: one SR counter per weight; ``groups``
    as in nvfp4_grouped_mm, one for all the weights. ``x_amax``: x's per-expert amaxes as
    ops.grouped.token_amaxes gives them, from the kernel that produced x (nvfp4_grouped_swiglu): the
    grouped kernels then skip their amax pass; the per-expert path reduces its own. ``graphs`` as in
    nvfp4_grouped_mm (the grouped kernels only)."""
    return _grouped(x, weights, offsets, biases, recipe, counters, signs, aligned, groups, False, x_amax, graphs)


def nvfp4_grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offsets: torch.Tensor,
                         recipe: NVFP4Recipe, counters=None, signs: torch.Tensor | None = None,
                         aligned: bool | None = None, groups: AmaxGroups | None = None,
                         h_colwise: bool = True, graphs: BodyGraphs | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h = silu(nvfp4_grouped_mm(x, w1)) ⊙ nvfp4_grouped_mm(x, w3), h's per-expert amaxes or None):
    the first half of a SwiGLU expert. On the grouped kernels the SwiGLU runs fused with the amaxes
    of h (column ones iff ``h_colwise``, i.e. W2 needs its wgrad) for W2's nvfp4_grouped_mm_shared
    ``x_amax``, and its backward with those of dy1, dy3; elsewhere as eager ops, amaxes None. ``graphs``: the
    BodyGraphs of the W1|W3 GEMM (nvfp4_grouped_mm); the SwiGLU between the GEMMs runs eagerly."""
    signs = _rht_signs(recipe, signs, x.device)
    if not _use_grouped_kernels(resolve_backend(recipe.gemm_backend, x.device), offsets, aligned):
        h1, h3 = _grouped(x, (w1, w3), offsets, (None, None), recipe, counters, signs, False, groups, False, None,
                          None)
        return torch.nn.functional.silu(h1) * h3, None
    h1, h3, carrier = _grouped(x, (w1, w3), offsets, (None, None), recipe, counters, signs, True, groups, True, None,
                               graphs)
    need_wgrad = torch.is_grad_enabled() and (w1.requires_grad or w3.requires_grad)
    # h, and dh's products dy1, dy3, take h1's dtype: their transforms round to it under the recipe's knob
    h_signs = signs_for_operand(signs, h1.dtype, recipe.rht_round_to_input_dtype)
    return _SwiGLUAmaxFunction.apply(h1, h3, carrier, offsets, h_signs, h_colwise, need_wgrad)


def _rht_signs(recipe: NVFP4Recipe, signs: torch.Tensor | None, device) -> torch.Tensor | None:
    """The RHT signs the recipe uses (the given ones, or its seed's), None without the RHT."""
    if not recipe.rht:
        return None
    return signs if signs is not None else cached_rht_signs(recipe.rht_seed, device)


def _grouped(x, weights, offsets, biases, recipe, counters, signs, aligned, groups, amax_carrier, x_amax, graphs):
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"grouped GEMM: recipe must be an NVFP4Recipe, got {type(recipe).__name__}")
    weights, biases = tuple(weights), tuple(biases)
    for w, b in zip(weights, biases):
        _check(x, w, offsets, b)
    x = autocast_input(x)  # see linear_function.py
    counters = tuple(counters) if counters is not None else (None,) * len(weights)
    need_wgrad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
    counters = tuple(c if c is not None else sr_counter(recipe, i, x.device) for i, c in enumerate(counters))
    signs = _rht_signs(recipe, signs, x.device)
    groups = sharding_groups(groups)
    if graphs is not None and torch.compiler.is_compiling():  # compiled: inductor's own CUDA graphs, if any
        graphs = None
    if amax_carrier or _use_grouped_kernels(resolve_backend(recipe.gemm_backend, x.device), offsets, aligned):
        return list(NVFP4GroupedKernelFunction.apply(x, offsets, recipe, signs, need_wgrad, len(weights),
                                                     groups, amax_carrier, x_amax, graphs, *weights,
                                                     *biases, *counters))
    return [NVFP4GroupedMMFunction.apply(x, w, b, offsets, recipe, c, signs,
                                         torch.is_grad_enabled() and w.requires_grad, groups)
            for w, b, c in zip(weights, biases, counters)]


__all__ = ["NVFP4GroupedKernelFunction", "NVFP4GroupedMMFunction", "expert_bounds", "nvfp4_grouped_mm",
           "nvfp4_grouped_mm_shared", "nvfp4_grouped_swiglu"]
