"""Grouped dispatch for MoE experts on the kernel backends: every expert's operands in one tensor and
one launch, with per-expert tensor scales, and the expert offsets never read on the host.

An operand here is a ``GroupedOperand``: the NVFP4 codes and block scales of all experts in one
storage plus the per-expert decode scales ``gs`` (slot e for expert e; the routed-token operands
carry one more slot for the rows past the last expert). Token groups must start at multiples of 16
(TorchTitan's token-group alignment), so that no 16-token block straddles two experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.expert_blocks import block_experts
from . import library


@dataclass
class GroupedOperand:
    """Codes [R, C/2] uint8 and block scales (E4M3; one row per storage row, or per 16 rows when
    ``tiles``), or already staged fp16 values [R, C] and empty scales; per-expert decode scales gs
    fp32 [slots]."""

    data: torch.Tensor
    scale: torch.Tensor
    gs: torch.Tensor
    tiles: bool = False

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.scale, self.gs


@dataclass
class GroupedWeight:
    """The expert weights for fprop (W [E·N, K]) and dgrad (Wᵀ per expert: the window of expert e
    starts at row e·row_step, column e·col_step of ``t``)."""

    w: GroupedOperand
    t: GroupedOperand | None  # None: left for backward to make (expert_transposes)
    row_step: int
    col_step: int


def transpose_layout(weight_2d: bool, n: int, k: int) -> tuple[bool, int, int]:
    """(tiles, row_step, col_step) of the Wᵀ that quantize_experts and expert_transposes give for
    expert weights [E, n, k]: 16×16 blocks, Wᵀ [k, E·n]; or 1×16, Wᵀ stacked as [E·k, n]."""
    return (True, 0, n) if weight_2d else (False, k, 0)


def expert_bias_grad(dy2d: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 [E, N]: the sum of each expert's rows of dy2d (rows past the last expert dropped), as a
    one-hot [E, T] matmul with fp32 accumulation: no host sync, and deterministic, unlike atomics."""
    E, T = offsets.numel(), dy2d.shape[0]
    row_expert = block_experts(offsets, T).repeat_interleave(16)[:T]
    onehot = row_expert[None, :] == torch.arange(E, dtype=row_expert.dtype, device=dy2d.device)[:, None]
    if dy2d.is_cuda and dy2d.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(onehot.to(dy2d.dtype), dy2d, out_dtype=torch.float32)
    if dy2d.is_cuda:  # fp32 gradients: an fp32 GEMM could round them to TF32
        return dy2d.new_zeros((E + 1, dy2d.shape[1])).index_add_(0, row_expert, dy2d.float())[:E]
    return onehot.float() @ dy2d.float()


def _stack_offsets(experts: int, rows: int, device: torch.device) -> torch.Tensor:
    """Cumulative row ends of ``experts`` stacked blocks of ``rows`` rows. Made per call, not cached: one made
    during a CUDA-graph warm-up would stay alive in the graphs' pool, which CUDA graph trees refuse."""
    return torch.arange(1, experts + 1, dtype=torch.int32, device=device) * rows


def quantize_tokens(x2d: torch.Tensor, offsets: torch.Tensor, rowwise: bool, colwise: bool,
                    signs: torch.Tensor | None, seed: torch.Tensor | None,
                    amaxes: torch.Tensor | None = None, *, row_staged: bool = True, col_staged: bool = False,
                    four_over_six: bool = False,
                    sr_block_scale: str = "nearest") -> tuple[GroupedOperand | None, GroupedOperand | None]:
    """Routed tokens x2d [T, K]: the 1×16 row operand and the wgrad operand xᵀ [K, T padded to 16]
    (RHT when ``signs``), each expert with its own tensor scales; stochastic iff ``seed``.
    ``row_staged`` / ``col_staged``: that operand, when it only feeds a GEMM at once (X's rows; dY's
    rows and columns), comes as the GEMM's fp16 values (``data`` fp16, no scales) rather than codes.
    ``amaxes``: token_amaxes' fp32 [2, E + 1] to use (all-reduced across ranks) instead of x2d's own.
    ``sr_block_scale``: the recipe's ("up": the stochastic operands' block scales rounded up; only with a seed)."""
    sr = seed is not None
    rd, rs, cd, cs, gs = library.quantize_grouped(x2d, offsets, signs, seed, amaxes, rowwise=rowwise, colwise=colwise,
                                                  stochastic_row=sr, stochastic_col=sr,
                                                  row_staged=rowwise and row_staged, col_staged=colwise and col_staged,
                                                  four_over_six=four_over_six, sr_block_scale=sr_block_scale)
    row = GroupedOperand(rd, rs, gs[0]) if rowwise else None
    col = GroupedOperand(cd, cs, gs[1]) if colwise else None
    return row, col


def token_amaxes(x2d: torch.Tensor, offsets: torch.Tensor, colwise: bool,
                 signs: torch.Tensor | None) -> torch.Tensor:
    """fp32 [2, E + 1]: the per-expert (row, column) tensor amaxes quantize_tokens would reduce."""
    return library.amax_grouped(x2d, offsets, signs, colwise=colwise)


def swiglu(h1: torch.Tensor, h3: torch.Tensor, offsets: torch.Tensor, colwise: bool,
           signs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = silu(h1) ⊙ h3, token_amaxes(h, offsets, colwise, signs)) from one pass over h1 and h3."""
    return library.swiglu_amax(h1, h3, offsets, signs, colwise=colwise)


def swiglu_backward(dh: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor, offsets: torch.Tensor, colwise: bool,
                    signs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh1, dh3, token_amaxes of dh1, token_amaxes of dh3): the gradients of silu(h1) ⊙ h3 given dh."""
    return library.swiglu_backward_amax(dh, h1, h3, offsets, signs, colwise=colwise)


def expert_amaxes(w: torch.Tensor) -> torch.Tensor:
    """fp32 [E]: each expert weight's tensor amax (w [E, N, K]), as quantize_experts reduces it."""
    E, N, K = w.shape
    return library.amax_experts(w.reshape(E * N, K), experts=E)


def quantize_experts(w: torch.Tensor, weight_2d: bool, amax: torch.Tensor | None = None, *,
                     four_over_six: bool = False, transpose: bool = True) -> GroupedWeight:
    """Expert weights w [E, N, K]: 16×16 blocks (one quantization read both ways, Wᵀ = [K, E·N]; W
    itself comes staged as fp16, since only the forward GEMM reads it) or 1×16 along K for fprop and
    1×16 along N for dgrad (Wᵀ stacked as [E·K, N]). ``amax``: fp32 [E] expert amaxes to use (an
    expert weight sharded across ranks: all-reduced) instead of w's own. ``transpose`` False: no Wᵀ
    (``t`` None), for a backward that makes it itself (expert_transposes)."""
    E, N, K = w.shape
    if weight_2d:
        d, s, dt, st, gs = library.quantize_2d_grouped(w.reshape(E * N, K), amax, experts=E, staged=True,
                                                       four_over_six=four_over_six, emit_transpose=transpose)
        return GroupedWeight(GroupedOperand(d, s, gs, True), GroupedOperand(dt, st, gs, True) if transpose else None,
                             0, N)
    rd, rs, _, _, gs = library.quantize_grouped(w.reshape(E * N, K), _stack_offsets(E, N, w.device),
                                                **_weight_rows(amax, E, four_over_six))
    t = expert_transposes(w, False, amax, four_over_six=four_over_six) if transpose else None
    return GroupedWeight(GroupedOperand(rd, rs, gs[0]), t, K, 0)


def expert_transposes(w: torch.Tensor, weight_2d: bool, amax: torch.Tensor | None = None, *,
                      four_over_six: bool = False) -> GroupedOperand:
    """Wᵀ of expert weights w [E, N, K] for dgrad, bit for bit quantize_experts' ``t`` (and
    quantize_expert_pair's) of the same w and amax: for a backward that quantizes the weights again
    rather than keep forward's Wᵀ (recipe.requantize_expert_weights)."""
    E, N, K = w.shape
    if weight_2d:  # W's codes come too (unread): fewer bytes than the forward's staged fp16 W
        _, _, dt, st, gs = library.quantize_2d_grouped(w.reshape(E * N, K), amax, experts=E, staged=False,
                                                       four_over_six=four_over_six)
        return GroupedOperand(dt, st, gs, True)
    wt = w.transpose(1, 2).reshape(E * K, N)
    td, ts, _, _, gst = library.quantize_grouped(wt, _stack_offsets(E, K, w.device),
                                                 **_weight_rows(amax, E, four_over_six))
    return GroupedOperand(td, ts, gst[0])


def _weight_rows(amax: torch.Tensor | None, experts: int, four_over_six: bool) -> dict:
    """quantize_grouped's arguments for 1×16 blocks of stacked expert weights, with ``amax`` fp32 [E] as the
    [row, column] slots of the experts plus the (empty) tail slot."""
    slots = None
    if amax is not None:
        slots = torch.cat([amax.float().reshape(experts), amax.new_zeros(1, dtype=torch.float32)]).expand(2, experts + 1)
    return dict(amaxes=slots, rowwise=True, colwise=False, four_over_six=four_over_six)


def quantize_expert_pair(w1: torch.Tensor, w3: torch.Tensor, amax1: torch.Tensor | None = None,
                         amax3: torch.Tensor | None = None, *, four_over_six: bool = False,
                         transpose: bool = True) -> tuple[GroupedOperand, GroupedWeight, GroupedWeight]:
    """W1 and W3 [E, N, K] of SwiGLU experts with 16×16 blocks, as quantize_experts gives each, except
    that their staged forward values share one [E·2N, K] operand (expert e: W1_e over W3_e; decode
    scales [2, E]) for one grouped GEMM of both (gemm_rows ``n_split`` = N). Returns (that operand,
    W1's weight, W3's weight); the weights' ``w`` is the shared operand, their ``t`` their own Wᵀ
    (None without ``transpose``)."""
    E, N, K = w1.shape
    d, dt1, st1, gs1, dt3, st3, gs3 = library.quantize_2d_grouped_pair(w1.reshape(E * N, K), w3.reshape(E * N, K),
                                                                      amax1, amax3, experts=E,
                                                                      four_over_six=four_over_six,
                                                                      emit_transpose=transpose)
    both = GroupedOperand(d, d.new_empty((0,)), torch.stack([gs1, gs3]), True)
    t1, t3 = (GroupedOperand(dt1, st1, gs1, True), GroupedOperand(dt3, st3, gs3, True)) if transpose else (None, None)
    return both, GroupedWeight(both, t1, 0, N), GroupedWeight(both, t3, 0, N)


def staged(op: GroupedOperand) -> GroupedOperand:
    """``op`` with its codes turned into the GEMMs' fp16 values once (exact), for an operand that
    several GEMMs read: each would otherwise stage it again. Already staged operands come back as they are."""
    if op.data.dtype == torch.float16:
        return op
    return GroupedOperand(library.stage_grouped(op.data, op.scale), op.scale.new_empty((0,)), op.gs, op.tiles)


def gemm_rows(a: GroupedOperand, b: GroupedOperand, offsets: torch.Tensor, n_out: int, row_step: int,
              col_step: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              add_to: torch.Tensor | None = None, n_split: int = 0) -> torch.Tensor:
    """[T, n_out]: expert e's rows of A times its [n_out, K] window of B (see grouped_gemm.py), plus
    ``add_to`` as a separate output of out_dtype would be added to it. ``n_split``: B is the shared
    operand of quantize_expert_pair, whose second weight's outputs start at column n_split."""
    return library.grouped_gemm_rows(a.data, a.scale, b.data, b.scale, offsets, a.gs, b.gs, bias, add_to,
                                     b_tiles=b.tiles, n_out=n_out, b_row_step=row_step, b_col_step=col_step,
                                     out_dtype=out_dtype, n_split=n_split)


def gemm_tokens(a: GroupedOperand, b: GroupedOperand, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[E, M, N]: expert e's tokens of A [M, T] times those of B [N, T], transposed (wgrad)."""
    return library.grouped_gemm_tokens(a.data, a.scale, b.data, b.scale, offsets, a.gs, b.gs, out_dtype=out_dtype)


__all__ = ["GroupedOperand", "GroupedWeight", "block_experts", "expert_amaxes", "expert_bias_grad",
           "expert_transposes", "gemm_rows", "gemm_tokens", "quantize_expert_pair", "quantize_experts",
           "quantize_tokens", "staged", "swiglu", "swiglu_backward", "token_amaxes", "transpose_layout"]
