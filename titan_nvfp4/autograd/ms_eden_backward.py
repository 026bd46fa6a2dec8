"""Quartet II's backward for the NVFP4 linear (recipe ``ms_eden``, arXiv 2601.22813).

| GEMM  | operands, each rotated along the GEMM's inner dim, then MS-EDEN  |
| dgrad | dY [M, N] and Ŵᵀ [K, N]: RHT of rht_size along N                 |
| wgrad | dYᵀ [N, M] and X̂ᵀ [K, M]: RHT of rht_size along the tokens M     |

Ŵ and X̂ are the forward's quantized W and X (q·e_b times their decode scale; saved as NVFP4 codes, which the
kernels read in place), so the backward is an
unbiased estimate of the gradient of the quantized forward; after a forward-only precision switch they are W and X
themselves. Both operands of a GEMM share one sign vector (the rotation cancels in the product); every operand
draws its own scale stream. The signs and draws of a backward call come from the layer's stochastic-rounding
counter (linear_function.next_sr_seed), which checkpoints carry, so they are redrawn every call and a resumed
run repeats them bit for bit. The inner dim is zero-padded to a multiple of rht_size on both operands alike.
"""

from __future__ import annotations

import torch

from ..distributed.amax import all_reduce_max
from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import StagedOperand
from ..ops import ms_eden_operand_amax, nvfp4_gemm, quantize_ms_eden_operand

_SEED_MASK = 2**62 - 1
#: the streams of one backward call: a sign vector per GEMM, a scale stream per operand
ROLES = ("dgrad_signs", "wgrad_signs", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
# 62-bit offsets of the roles from the call's seed (odd multiples of a 64-bit mixing constant): distinct from the
# per-layer and per-call steps of the seed (multiples of 32-bit constants), so no (layer, call, role) meets another
_ROLE_OFFSETS = {r: ((2 * i + 1) * 0x27D4EB2F165667C5) & _SEED_MASK for i, r in enumerate(ROLES)}


def role_seeds(call_seed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The int64 [1] seed of each role of the backward call whose seed is ``call_seed`` (next_sr_seed's), on its
    device: no host sync, so a compiled or graphed backward draws afresh each call."""
    return {r: (call_seed + off) & _SEED_MASK for r, off in _ROLE_OFFSETS.items()}


def saved_operand(t: NVFP4Tensor | StagedOperand | torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """What forward saves of an operand the backward re-quantizes: an NVFP4Tensor's codes, scales and decode scale
    (0.56 bytes per element), a staged operand's fp16 values q·e_b and decode scale, or a high-precision tensor."""
    if isinstance(t, NVFP4Tensor):
        return (t.data, t.scale, t.global_scale), ("codes", t.shape, tuple(t.block_shape))
    if isinstance(t, StagedOperand):
        return (t.values, t.global_scale), ("staged",)
    return (t,), ("plain",)


def operand_values(tensors: tuple[torch.Tensor, ...], meta: tuple) -> tuple[NVFP4Tensor | torch.Tensor,
                                                                             torch.Tensor | None]:
    """(operand, decode scale or None) of a saved operand, its dequantization operand·scale: the NVFP4Tensor of saved
    codes (the MS-EDEN kernels read its q·e_b from the codes in place), a staged operand's fp16 values q·e_b, or the
    high-precision tensor (no scale)."""
    kind = meta[0]
    if kind == "codes":
        data, scale, gs = tensors
        t = NVFP4Tensor(data=data, scale=scale, global_scale=gs, shape=meta[1], block_shape=meta[2])
        return t, gs.reshape(1).float()
    if kind == "staged":
        values, gs = tensors
        return values, gs.reshape(1).float()
    return tensors[0], None


def _operand(values, pre_scale, *, signs, draw, size, backend, group, transposed=False):
    """One backward operand (values, or its transpose with ``transposed``) rotated along its last dim and quantized
    with MS-EDEN; the tensor amax all-reduced over ``group`` (the ranks sharding the operand) when it is sharded."""
    amax = None
    kw = dict(size=size, sign_seed=signs, backend=backend, pre_scale=pre_scale, transposed=transposed)
    if group is not None:
        amax = all_reduce_max(ms_eden_operand_amax(values, **kw).reshape(1), group)
    return quantize_ms_eden_operand(values, draw_seed=draw, amax=amax, staged=backend == "emulated", **kw)


def ms_eden_backward(dy2d: torch.Tensor, x_saved, w_saved, *, call_seed: torch.Tensor, size: int, backend: str,
                     need_dx: bool, need_dw: bool, out_dtypes: tuple[torch.dtype, torch.dtype],
                     dx_round: torch.dtype | None = None, groups=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX [M, K], dW [N, K]) by the table of the module docstring, None where not needed. ``x_saved`` and
    ``w_saved``: operand_values' (operand, decode scale) of X̂ [M, K] and Ŵ [N, K]; ``call_seed``: the call's seed;
    ``groups``: distributed.amax.AmaxGroups of a sharded layer (tensor parallelism), else None."""
    seeds = role_seeds(call_seed)
    g_dy, g_x, g_w = (None, None, None) if groups is None else (groups.grad, groups.x, groups.weight)
    common = dict(size=size, backend=backend)
    dx = dw = None
    if need_dx:
        w_vals, w_scale = w_saved
        a = _operand(dy2d, None, signs=seeds["dgrad_signs"], draw=seeds["dgrad_dy"], group=g_dy, **common)
        b = _operand(w_vals, w_scale, signs=seeds["dgrad_signs"], draw=seeds["dgrad_w"], group=g_w, transposed=True,
                     **common)
        dx = nvfp4_gemm(a, b, out_dtype=out_dtypes[0], backend=backend, round_to=dx_round)
        del a, b
    if need_dw:
        x_vals, x_scale = x_saved
        a = _operand(dy2d.t(), None, signs=seeds["wgrad_signs"], draw=seeds["wgrad_dy"], group=g_dy, **common)
        b = _operand(x_vals, x_scale, signs=seeds["wgrad_signs"], draw=seeds["wgrad_x"], group=g_x, transposed=True,
                     **common)
        dw = nvfp4_gemm(a, b, out_dtype=out_dtypes[1], backend=backend)
    return dx, dw


__all__ = ["ROLES", "ms_eden_backward", "operand_values", "role_seeds", "saved_operand"]
