"""Which expert each routed row, or each 16-row block of routed tokens, belongs to, from the cumulative token
counts: the block map is what the grouped kernels read (kernels/expert_map.py computes it in one launch)."""

from __future__ import annotations

import torch


def block_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [⌈rows/16⌉]: the expert of each 16-row block of routed tokens whose cumulative group
    ends are ``offsets`` [E] (E for blocks past offsets[-1]), computed on the device (no host sync).
    A block's expert is its first row's: groups must start at multiples of 16."""
    starts = torch.arange(0, rows + (-rows) % 16, 16, dtype=offsets.dtype, device=offsets.device)
    return torch.searchsorted(offsets, starts, right=True).to(torch.int32)


def row_experts(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert of each routed row whose cumulative group ends are ``ends`` [E] (E for the rows
    past ends[-1]), on the device (no host sync)."""
    return torch.searchsorted(ends, torch.arange(rows, dtype=ends.dtype, device=ends.device), right=True)


__all__ = ["block_experts", "row_experts"]
