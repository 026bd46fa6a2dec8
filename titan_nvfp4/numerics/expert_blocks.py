"""Which expert each 16-row block of routed tokens belongs to, from the cumulative token counts: the map the
grouped kernels read (kernels/expert_map.py computes the same in one launch)."""

from __future__ import annotations

import torch


def block_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [⌈rows/16⌉]: the expert of each 16-row block of routed tokens whose cumulative group
    ends are ``offsets`` [E] (E for blocks past offsets[-1]), computed on the device (no host sync).
    A block's expert is its first row's: groups must start at multiples of 16."""
    starts = torch.arange(0, rows + (-rows) % 16, 16, dtype=offsets.dtype, device=offsets.device)
    return torch.searchsorted(offsets, starts, right=True).to(torch.int32)


__all__ = ["block_experts"]
