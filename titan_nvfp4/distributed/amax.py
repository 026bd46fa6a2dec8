"""Cross-rank tensor amaxes: a sharded GEMM operand takes the amax of the whole operand, so every rank
quantizes its shard with the tensor scale the unsharded operand would have. Block scales need nothing:
1×16 and 16×16 blocks never straddle shards when shard sizes are multiples of 16 (checked by the
callers). Non-finite values count as +inf (the kernels' convention), so MAX still poisons every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class AmaxGroups:
    """The process group over which each operand of an NVFP4 linear is sharded (None: whole on every
    rank, its own amax is the global one): X in forward, W, and dY in backward."""

    x: dist.ProcessGroup | None = None
    weight: dist.ProcessGroup | None = None
    grad: dist.ProcessGroup | None = None

    @property
    def sharded(self) -> bool:
        """Whether any operand is sharded. A property, not ``__bool__``: torch 2.11's dynamo cannot apply ``not`` to a
        frozen dataclass inside an autograd.Function (tests/test_compile.py)."""
        return self.x is not None or self.weight is not None or self.grad is not None


def sharding_groups(groups: AmaxGroups | None) -> AmaxGroups | None:
    """``groups`` where it shards an operand, else None (every amax local): what the public entry points pass on."""
    return groups if groups is not None and groups.sharded else None


def all_reduce_max(amax: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """MAX of ``amax`` over ``group`` (a functional collective: traceable by torch.compile)."""
    if group is None or dist.get_world_size(group) == 1:
        return amax
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group))


__all__ = ["AmaxGroups", "all_reduce_max", "sharding_groups"]
