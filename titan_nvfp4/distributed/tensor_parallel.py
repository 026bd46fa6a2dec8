"""NVFP4Linear under tensor parallelism: TorchTitan's ColwiseParallel / RowwiseParallel plans shard the
weight (Shard(0) / Shard(1) DTensor) and hand the layer a DTensor input; the layer runs the NVFP4
linear on the local shards and returns a DTensor, as nn.Linear's DTensor dispatch would.

Per rank, with the weight sharded over a TP group of size t:
- colwise (W rows, the output features, sharded): X is whole (Replicate), each rank computes its
  Y columns; W's and dY's tensor amaxes are all-reduced over the group. dX is a partial sum.
- rowwise (W columns, the input features, sharded): X comes sharded along its features; each rank
  computes a partial Y (summed by the output's redistribution); X's and W's amaxes are all-reduced.
  The bias, a Replicate DTensor, is added after the partial GEMM so it counts once.

So every rank quantizes its shard of X, W and dY with the whole operand's tensor scale, and the
1×16 / 16×16 blocks are those of the unsharded operands (local dims must be multiples of 16). What
differs from one GPU is only the fp32 summation order: rowwise sums t partial GEMMs, colwise dX too.

A framework that hands the layer plain local shards and runs the collectives around it itself (TorchTitan
0.3's spmd_types backend) gets the same per-rank GEMM from local_tp_nvfp4_linear.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .amax import AmaxGroups


#: A layer's name for messages, or a function giving it: read only where an error is raised (under
#: torch.compile, reading a module's name in forward would guard on it and recompile once per layer).
Name = str | Callable[[], str]


def name_of(name: Name) -> str:
    return name() if callable(name) else name


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local tensor of a DTensor (a view: in-place updates reach the DTensor), others as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


def tp_layout(weight: DTensor, name: Name) -> tuple[int, int] | None:
    """(mesh dim, sharded weight dim) of a tensor-parallel Linear weight, None when it is replicated:
    at most one mesh dim may shard it, along dim 0 (colwise) or 1 (rowwise)."""
    sharded = [(i, p.dim) for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    others = [p for p in weight.placements if not isinstance(p, (Shard, Replicate))]
    if len(sharded) > 1 or others or (sharded and sharded[0][1] not in (0, 1)):
        raise NotImplementedError(f"NVFP4 Linear {name_of(name)!r}: weight placements {weight.placements} are not a "
                                  "tensor-parallel layout (one mesh dim sharding dim 0 or dim 1)")
    return sharded[0] if sharded else None


def _check_local_dims(name: Name, w_local: torch.Tensor) -> None:
    bad = [d for d in w_local.shape if d % 16]
    if bad:
        raise ValueError(f"NVFP4 Linear {name_of(name)!r} under tensor parallelism: the local weight shard "
                         f"{tuple(w_local.shape)} has dims that are not multiples of 16 (NVFP4 blocks may not "
                         "straddle shards): choose a TP degree that divides the dims into multiples of 16, or "
                         "keep the layer in BF16 with filter_fqns")


def tp_amax_groups(wdim: int, group) -> AmaxGroups:
    """The operands sharded over ``group`` when the weight is sharded along ``wdim``: colwise (0) W and dY,
    rowwise (1) X and W."""
    return AmaxGroups(weight=group, grad=group) if wdim == 0 else AmaxGroups(x=group, weight=group)


def local_tp_nvfp4_linear(linear_fn, x: torch.Tensor, w_local: torch.Tensor, bias: torch.Tensor | None,
                          wdim: int, group, name: Name = "") -> torch.Tensor:
    """The same per-rank GEMM as tp_nvfp4_linear for a framework that hands the layer plain local shards and
    does the collectives around it itself (TorchTitan 0.3's spmd_types backend): colwise X whole, Y's columns
    out; rowwise X's feature shard in, a partial Y out (its sum is the framework's). ``wdim`` 0 or 1, as
    tp_layout's."""
    _check_local_dims(name, w_local)
    if wdim == 1 and bias is not None:  # each rank's partial Y would add it once: t times in the sum
        raise NotImplementedError(f"NVFP4 Linear {name_of(name)!r}: a rowwise-sharded Linear with a bias on local "
                                  "shards is not supported; keep the layer in BF16 with filter_fqns")
    return linear_fn(x, w_local, bias, tp_amax_groups(wdim, group))


def tp_nvfp4_linear(linear_fn, x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None,
                    name: Name = "") -> DTensor:
    """Y = linear_fn(x_local, w_local, b_local, groups) on the local shards, wrapped back as a DTensor
    (Shard(-1) colwise, Partial rowwise + bias). ``linear_fn`` is the layer's NVFP4 linear with its
    recipe, SR counter and RHT signs bound."""
    layout = tp_layout(weight, name)
    mesh = weight.device_mesh
    if layout is None:  # a replicated weight (e.g. a low-rank factor beside a rowwise layer): whole on every rank
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        y = linear_fn(x, weight.to_local(), local(bias), AmaxGroups())
        return DTensor.from_local(y, mesh, [Replicate()] * mesh.ndim, run_check=False)
    mesh_dim, wdim = layout
    group = mesh.get_group(mesh_dim)
    w_local = weight.to_local()
    _check_local_dims(name, w_local)
    placements = list(weight.placements)
    if not isinstance(x, DTensor):  # torch's Colwise/RowwiseParallel input hooks always hand over a DTensor
        raise ValueError(f"NVFP4 Linear {name_of(name)!r}: a tensor-parallel weight needs a DTensor input (apply the TP plan "
                         "to the module, e.g. TorchTitan's parallelize function), got a plain tensor")
    if wdim == 0:  # colwise: X whole on every rank; its gradient is a partial sum over the group
        if any(not isinstance(p, Replicate) for p in x.placements):
            x = x.redistribute(mesh, [Replicate()] * mesh.ndim)
        x_local = x.to_local(grad_placements=[Partial() if i == mesh_dim else Replicate() for i in range(mesh.ndim)])
        y = linear_fn(x_local, w_local, local(bias), tp_amax_groups(0, group))
        placements[mesh_dim] = Shard(y.dim() - 1)
        return DTensor.from_local(y, mesh, placements, run_check=False)
    # rowwise: x sharded along its last dim the way W is along dim 1
    want = [Shard(x.dim() - 1) if i == mesh_dim else Replicate() for i in range(mesh.ndim)]
    if list(x.placements) != want:
        x = x.redistribute(mesh, want)
    y = linear_fn(x.to_local(), w_local, None, tp_amax_groups(1, group))
    placements[mesh_dim] = Partial()
    out = DTensor.from_local(y, mesh, placements, run_check=False)
    if bias is not None:
        out = out + bias
    return out


def gather_shards(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole tensor from the plain local shards of ``t`` along ``dim`` over ``group`` (in group rank order)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def shard_of(value: torch.Tensor, local_shape: torch.Size, group) -> torch.Tensor:
    """This rank's contiguous chunk of the whole ``value`` along the dim where ``local_shape`` is smaller (the
    inverse of gather_shards), or ``value`` itself where the shapes agree (a tensor replicated over ``group``)."""
    dims = [d for d, (a, b) in enumerate(zip(local_shape, value.shape)) if a != b]
    if not dims:
        return value
    return value.chunk(dist.get_world_size(group), dims[0])[dist.get_rank(group)]


def broadcast_from_first(tensors, group) -> list[torch.Tensor]:
    """``tensors`` as the group's first rank holds them, on every rank of ``group`` (in place)."""
    src = dist.get_global_rank(group, 0)
    out = [t.contiguous() for t in tensors]
    for t in out:
        dist.broadcast(t, src=src, group=group)
    return out


__all__ = ["broadcast_from_first", "gather_shards", "local", "local_tp_nvfp4_linear", "shard_of", "tp_amax_groups",
           "tp_layout", "tp_nvfp4_linear"]
