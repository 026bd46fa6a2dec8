"""A tensor's last dimension split into two column sets whose gradients join in one pass (OutControl's channels).

Two ``index_select`` calls would each take their gradient back as a zero-filled tensor of the input's size with the
part scattered into it, and autograd would then add the two: three full-size writes and two reads more than the
single gather here, which concatenates the parts' gradients and reorders them to the input's columns.
"""

from __future__ import annotations

import torch


class _ColumnSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return x.index_select(-1, first), x.index_select(-1, second)

    @staticmethod
    def backward(ctx, g_first: torch.Tensor, g_second: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return torch.cat((g_first, g_second), -1).index_select(-1, inverse), None, None, None


def split_columns(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
                  inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[..., first], x[..., second]) for int64 index sets that partition x's last dimension, and ``inverse`` the
    position of each column 0 … K-1 in cat(first, second) (``column_inverse``); backward gathers x's gradient from
    the parts' in one pass."""
    return _ColumnSplit.apply(x, first, second, inverse)


def column_inverse(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of cat(first, second): where each column of the split tensor went."""
    perm = torch.cat((first, second))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inverse


__all__ = ["column_inverse", "split_columns"]
