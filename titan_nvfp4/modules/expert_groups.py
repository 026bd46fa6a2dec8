"""Pieces of the routed-expert conversion shared by the TorchTitan 0.2 and 0.3 integrations (imports no
TorchTitan): the SR stream ids of converted expert modules, the dims check of their weights, the padding
of token groups to a multiple of 16, and the CUDA graphs of their grouped GEMMs in eager mode (eager_graphs).

Padding: the grouped kernels (grouped_function.py) run without looking at the offsets on the host when every
token group starts at a multiple of 16. ``pad_token_groups`` places expert e's rows at the start of a slot of
round_up(count_e, 16) rows, the rest of the slot zero, into a tensor of a fixed row count (no host sync,
static shapes under torch.compile); ``rows`` maps each input row to its padded row, so ``y[rows]`` undoes it.
Zero rows change no per-expert amax and no wgrad block, so NVFP4 results equal those of the unpadded groups
(bit for bit without stochastic rounding, whose draws depend on the row count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..autograd.body_graphs import BodyGraphs, graphs_for
from ..distributed.tensor_parallel import Name, name_of
from ..numerics.expert_blocks import row_experts

#: SR stream ids of expert GEMMs start here, so they never meet those of dense layers
GROUPED_LAYER_ID_BASE = 1 << 20
#: stream ids reserved per converted expert module (one per expert GEMM, at most 3 used)
LAYER_IDS_PER_EXPERTS = 4
#: token groups are padded to multiples of this (NVFP4 blocks along the tokens in wgrad)
TOKEN_GROUP_ALIGN = 16


def experts_layer_id(index: int) -> int:
    """The layer id (first SR stream) of the ``index``-th converted expert module."""
    return GROUPED_LAYER_ID_BASE + LAYER_IDS_PER_EXPERTS * index


def check_expert_dims(name: Name, weights: dict, section: str = "quantize.grouped_mm.nvfp4") -> None:
    """Both dims of every expert weight (a tensor or a shape) must be multiples of 16 (NVFP4 blocks): else
    name them, and the ``section`` whose fqns excludes them."""
    shapes = {k: tuple(getattr(w, "shape", w)) for k, w in weights.items()}
    bad = [f"{k} {s}" for k, s in shapes.items() if s[-1] % 16 or s[-2] % 16]
    if bad:
        raise ValueError(f"cannot convert experts {name_of(name)!r} to NVFP4: {', '.join(bad)} has a dim that is not a "
                         f"multiple of 16 (exclude it from [{section}] fqns)")


class PaddedGroups(NamedTuple):
    x: torch.Tensor
    """[P, K]: each expert's rows at the start of its slot, zeros elsewhere."""
    counts: torch.Tensor
    """[E]: the padded token count of each expert (multiples of ``align``)."""
    rows: torch.Tensor
    """[T] int64: the padded row of each input row."""

    def valid(self, dtype: torch.dtype) -> torch.Tensor:
        """[P, 1]: 1 on the rows that hold an input row, 0 on the padding."""
        return torch.zeros(self.x.shape[0], 1, dtype=dtype, device=self.x.device).index_fill_(0, self.rows, 1)


def pad_token_groups(x: torch.Tensor, counts: torch.Tensor, align: int = TOKEN_GROUP_ALIGN) -> PaddedGroups:
    """x [T, K] in expert order with ``counts`` [E] rows per expert, each group padded with zero rows to a
    multiple of ``align`` (module docstring). Rows past sum(counts) (no expert's) follow the last slot and stay
    no expert's. Differentiable in x; P = round_up(T + E·(align - 1), align) whatever the counts."""
    T, E = x.shape[0], counts.shape[0]
    c = counts.to(torch.int64)
    padded = (c + align - 1) // align * align
    ends, pends = c.cumsum(0), padded.cumsum(0)
    starts = torch.cat([ends - c, ends[-1:]])  # [E + 1]: the tail (no expert) last
    pstarts = torch.cat([pends - padded, pends[-1:]])
    e = row_experts(ends, T)
    rows = pstarts[e] + (torch.arange(T, device=x.device) - starts[e])
    P = -(-(T + E * (align - 1)) // align) * align
    xp = x.new_zeros(P, x.shape[1]).index_copy(0, rows, x)
    return PaddedGroups(xp, padded.to(counts.dtype), rows)


def experts_body_graphs(module, call: str, x: torch.Tensor, weights, sharded: bool) -> BodyGraphs | None:
    """The BodyGraphs of expert module ``module``'s grouped GEMM ``call`` (named by its first weight), which reads
    ``x`` [T, K] into ``weights`` [E, N_i, K], when its recipe's ``eager_graphs`` graphs it: eager, on a GPU, small
    enough (graphable with N = the sum of the N_i), and the experts not ``sharded`` (under expert parallelism the
    routed token count changes every step; under tensor parallelism amaxes are all-reduced between the kernels);
    else None. The token count is the same every step outside expert parallelism (both integrations pad it)."""
    if sharded:
        return None
    return graphs_for(module, call, x, x.shape[-1], sum(w.shape[1] for w in weights), module.recipe.eager_graphs,
                      sum(w.numel() for w in weights))


__all__ = ["GROUPED_LAYER_ID_BASE", "LAYER_IDS_PER_EXPERTS", "PaddedGroups", "TOKEN_GROUP_ALIGN", "check_expert_dims",
           "experts_body_graphs", "experts_layer_id", "pad_token_groups"]
