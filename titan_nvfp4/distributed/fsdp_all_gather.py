"""FSDP2 all-gather of NVFP4 weights (`fsdp_nvfp4_all_gather`): each rank quantizes its own rows of a
16×16-tiled weight and the all-gather moves packed E2M1 codes (4 bits per element instead of BF16's 16).

FSDP2 calls two hooks of the sharded parameter's local tensor (torch.distributed.fsdp's all-gather
extension): ``fsdp_pre_all_gather`` returns what to gather, ``fsdp_post_all_gather`` builds the
unsharded parameter from the gathered tensors. Here:

1. pre: cast the shard to FSDP's param dtype (what a BF16 all-gather would move); reduce its rows into
   the weight's whole tile-amax grid and all-reduce it (max) over the FSDP group, because a 16×16 tile
   can straddle two shards when a shard's row count is not a multiple of 16; derive the E4M3 tile
   scales and the tensor scale from it (the same on every rank); encode the shard's rows
   (numerics/nvfp4.py: tile_amax_of_rows, tile_scales, encode_tile_rows; on a GPU their Triton twins
   in kernels/shard_encode.py, one launch each: FSDP2 runs this hook for every weight at every
   all-gather, and the reference's ~35 small ops cost ~1.35 ms of host time per weight there).
2. gather the packed codes, [rows, K/2] uint8 per rank. When FSDP pads the last shard (N not a
   multiple of the world size), FSDP2 requires every all-gather input to have the padded shard's shape
   [rows, K], so the codes then travel one per byte: a 2× saving instead of 4×.
3. post: NVFP4GatheredWeight, the unsharded parameter, holding codes, tile scales and tensor scale.
   NVFP4LinearFunction reads it instead of quantizing the weight (bit-identical to quantizing the
   BF16-gathered weight: tests/test_fsdp_all_gather.py).

The tile-amax all-reduce moves N·K/256 fp32 values, about 3% of the codes' bytes. Left to the hook it
runs at every forward all-gather, one small all-reduce per weight on FSDP2's critical path. The
converter's post-optimizer hook instead calls ``precompute_scales`` (as TorchAO precomputes its float8
scales for FSDP): right after the optimizer step it reduces the tile amaxes of every gathered weight of
the model in one all-reduce per FSDP group and encodes each shard, and the next forward's hooks return
the kept codes. Backward's re-gather of a resharded block likewise reuses the forward's scales and
codes. Kept scales and codes (an eighth of the fp32 shard's bytes) are dropped by any in-place op on
the shard (copy_, the optimizer's plain, foreach or fused updates), so a changed weight is always
reduced and encoded again. (Version counters cannot tell: an op reaching the shard through DTensor's or
this wrapper's dispatch does not bump the inner tensor's.) bf16_after_fraction is refused with this
all-gather: FSDP2 sizes its all-gather buffers once, at the first step, for the codes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from ..numerics.formats import pack_nibbles, unpack_nibbles
from ..numerics.nvfp4 import BLOCK, NVFP4Tensor, encode_tile_rows, tile_amax_of_rows, tile_scales

aten = torch.ops.aten

# ops whose results are the sharded weight again (FSDP2's sharding and padding, to_empty, copies)
_KEEP_WRAPPED = {
    aten.view.default, aten.as_strided.default, aten.slice.Tensor, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.zeros_like.default, aten._to_copy.default, aten.t.default, aten._pin_memory.default,
}


def _tile_amax_ref(rows: torch.Tensor, offset: int, n_rows: int) -> torch.Tensor:
    """The reference's tile-amax grid of a shard, flattened, with its max appended (the kernels' layout)."""
    grid = tile_amax_of_rows(rows, offset, n_rows).flatten()
    return torch.cat([grid, grid.amax().reshape(1) if grid.numel() else grid.new_zeros(1)])


def _tile_scales_ref(grid: torch.Tensor, n_rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's tile scales of the all-reduced buffer, and fp32 [2]: the encode scale and its inverse."""
    e_b, s_enc = tile_scales(grid[:-1].view(n_rows // BLOCK, k // BLOCK), grid[-1])  # the max: over TP too
    return e_b, torch.stack([s_enc, torch.reciprocal(s_enc)])


def _shard_functions(w: torch.Tensor):
    """(tile amax, tile scales, encode) for a shard: the Triton kernels on a GPU (three launches, so the
    hook's host time stays small), the reference elsewhere."""
    if w.is_cuda:
        from ..kernels.shard_encode import encode_tile_rows_triton, tile_amax_of_rows_triton, tile_scales_triton

        return tile_amax_of_rows_triton, tile_scales_triton, encode_tile_rows_triton
    return _tile_amax_ref, _tile_scales_ref, encode_tile_rows


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (FSDP2 re-gathers a
    resharded block there, for the weights its forward gathered)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class GatherTraffic:
    """Bytes this process's NVFP4 all-gathers moved since the last ``take()``: the gathered codes (all
    ranks' shards, what the all-gather delivers here), what FSDP2's all-gather in the param dtype would
    have moved for the same shards, and the tile amaxes all-reduced. Python ints, no device sync."""

    FIELDS = ("gathers", "codes_bytes", "param_dtype_bytes", "reduced_bytes")

    def __init__(self) -> None:
        self.take()

    def add(self, codes: int, param_dtype: int, reduced: int) -> None:
        self.gathers += 1
        self.codes_bytes += codes
        self.param_dtype_bytes += param_dtype
        self.reduced_bytes += reduced

    def add_reduced(self, reduced: int) -> None:
        """Tile amaxes all-reduced outside a gather (``precompute_scales``)."""
        self.reduced_bytes += reduced

    def peek(self) -> dict[str, int]:
        """The counts so far, left as they are."""
        return {f: getattr(self, f, 0) for f in self.FIELDS}

    def take(self) -> dict[str, int]:
        """The counts so far, and start again from zero."""
        counts = {f: getattr(self, f, 0) for f in self.FIELDS}
        for f in self.FIELDS:
            setattr(self, f, 0)
        return counts

    @staticmethod
    def summary(counts: dict[str, int]) -> str:
        mb = 1e-6
        ratio = counts["param_dtype_bytes"] / counts["codes_bytes"] if counts["codes_bytes"] else float("nan")
        return (f"{counts['gathers']} weight all-gathers moved {counts['codes_bytes'] * mb:.2f} MB of NVFP4 codes "
                f"(in the param dtype: {counts['param_dtype_bytes'] * mb:.2f} MB, {ratio:.1f}x) and all-reduced "
                f"{counts['reduced_bytes'] * mb:.3f} MB of tile amaxes")


TRAFFIC = GatherTraffic()  # this process's; the converter logs the first optimizer step's

_MESH_DIMS: dict = {}


def _shard_dim(mesh) -> tuple[int, int, object]:
    """(size, this rank's index, process group) of the mesh dim FSDP2 shards on (its last), looked up
    once per mesh: the hook runs for every weight at every all-gather, and DeviceMesh's lookups are
    Python."""
    dims = _MESH_DIMS.get(mesh)
    if dims is None:
        d = mesh.ndim - 1
        dims = _MESH_DIMS[mesh] = (mesh.size(d), mesh.get_local_rank(d), mesh.get_group(d))
    return dims


class NVFP4ShardedWeight(torch.Tensor):
    """A weight (or its FSDP2 shard) that FSDP2 all-gathers as NVFP4 codes. Everything else (optimizer,
    init_weights, state_dict, checkpoint) sees the high-precision tensor it wraps, ``_data``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, layout=data.layout, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data
        # (key, tile scales, [S, 1/S], codes, precomputed) of the last encode (module docstring)
        self._kept = None
        self._gathered_as = None  # (mesh, rows, param dtype) of FSDP2's all-gathers: precompute_scales
        self._tp_group = None  # the tensor-parallel group of a TP-sharded weight, False without one (_tp_group_of)

    def __repr__(self) -> str:
        return f"NVFP4ShardedWeight({self._data})"

    def __reduce_ex__(self, protocol):
        """Saved (torch.save, DCP) as the plain tensor it wraps: a checkpoint loads with the knob off too."""
        return self._data.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return NVFP4ShardedWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unwrap = lambda t: t._data if isinstance(t, cls) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable:  # in place (copy_, the optimizer's updates, foreach and fused ones too)
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, cls):
                    t._kept = None  # the weight may have changed: the next all-gather reduces again
            if isinstance(args[0], cls):
                return args[0]
        if func in _KEEP_WRAPPED:
            return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    # -- FSDP2's all-gather extension ----------------------------------------------------------------

    def _key(self, mesh, n_rows: int, dtype: torch.dtype) -> tuple:
        """What kept scales and codes must match: this shard's storage, the gather dtype and the layout."""
        ws, rank, _ = _shard_dim(mesh)
        return (self._data.data_ptr(), dtype, n_rows, ws, rank)

    def _rows(self, mesh, n_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """This rank's rows in the gather dtype, padded as FSDP2 gathers them, and the first one's index."""
        ws, rank, _ = _shard_dim(mesh)
        chunk = -(-n_rows // ws)
        w = self._data.to(dtype)
        if w.shape[0] < chunk:  # the padded shard
            w = torch.cat([w, w.new_zeros(chunk - w.shape[0], *w.shape[1:])])
        return w, rank * chunk

    def _encode(self, mesh, n_rows: int, dtype: torch.dtype, grid: torch.Tensor | None = None,
                precomputed: bool = False) -> int:
        """Quantize this shard's rows with the whole weight's scales and keep the scales and the codes (in
        the layout FSDP2 gathers). ``grid``: the all-reduced tile amaxes, when precompute_scales has them;
        else they are computed and all-reduced here. Returns the bytes all-reduced here."""
        ws, _, group = _shard_dim(mesh)
        w, offset = self._rows(mesh, n_rows, dtype)
        tile_amax, scales, encode = _shard_functions(w)
        reduced = 0
        if grid is None:
            grid = tile_amax(w, offset, n_rows)  # the whole weight's tile amaxes and their max, once reduced
            if ws > 1:  # one rank holds every tile already
                dist.all_reduce(grid, op=dist.ReduceOp.MAX, group=group)
                reduced = grid.numel() * grid.element_size()
            if self._tp_group:  # a TP shard: the tensor amax is the whole weight's, over the TP group too
                dist.all_reduce(grid[-1:], op=dist.ReduceOp.MAX, group=self._tp_group)
                reduced += grid.element_size()
        e_b, s = scales(grid, n_rows, w.shape[1])  # s: encode scale, decode scale
        codes = encode(w, offset, e_b, s[:1])
        if n_rows % ws:  # FSDP2 wants the padded shard's shape [chunk, K]: one code per byte
            codes = unpack_nibbles(codes)
        self._kept = (self._key(mesh, n_rows, dtype), e_b, s, codes, precomputed)
        return reduced

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self._data.dtype
        if getattr(module, "high_precision", False):  # the config refuses it; a module switched by hand
            raise RuntimeError(f"{getattr(module, 'layer_name', type(module).__name__)}: a layer in high precision "
                               "cannot use fsdp_nvfp4_all_gather (FSDP2 keeps the buffers of the codes)")
        n_rows = outer_size[0]
        self._gathered_as = (mesh, n_rows, dtype)
        if self._tp_group is None:
            self._tp_group = _tp_group_of(self, module.parameters(), mesh)
        kept, reduced = self._kept, 0
        # precomputed after the optimizer step, or (inside backward) the forward gather's: the weight has not
        # changed since, or an in-place op would have dropped them
        if kept is None or kept[0] != self._key(mesh, n_rows, dtype) or not (kept[4] or _in_backward()):
            reduced = self._encode(mesh, n_rows, dtype)
        _, e_b, s, codes, _ = self._kept
        ws = _shard_dim(mesh)[0]
        param_dtype_bytes = -(-n_rows // ws) * self._data.shape[1] * dtype.itemsize * ws
        TRAFFIC.add(codes.numel() * codes.element_size() * ws, param_dtype_bytes, reduced)
        return (codes,), ("nvfp4", e_b, s[1], n_rows)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        _, e_b, gs, n_rows = metadata
        k = self.shape[1]
        codes = data[:n_rows]
        if codes.shape[1] == k:  # gathered one per byte (uneven shards): pack
            codes = pack_nibbles(codes)
        if out is not None:  # under TP, FSDP2's unsharded parameter is a DTensor around the gathered weight
            getattr(out, "_local_tensor", out)._set(codes=codes, scale=e_b, global_scale=gs)
            return
        return NVFP4GatheredWeight(codes, e_b, gs, torch.Size((n_rows, k)), param_dtype), (data,)


class NVFP4GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 builds from NVFP4 codes: what NVFP4LinearFunction multiplies with
    (``gathered_nvfp4``), W's shape and param dtype to autograd (its gradient is a dense tensor, which
    FSDP2 reduce-scatters)."""

    @staticmethod
    def __new__(cls, codes, scale, global_scale, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, global_scale, shape, dtype):
        self._codes, self._scale, self._gs = codes, scale, global_scale

    def _set(self, codes, scale, global_scale) -> None:
        """Refill after a later all-gather (FSDP2's ``out`` path)."""
        self._codes, self._scale, self._gs = codes, scale, global_scale

    def __repr__(self) -> str:
        return f"NVFP4GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    # traceable by torch.compile: its inner tensors become graph inputs at every call (read fresh after
    # each all-gather), and the weight stays an autograd input of the NVFP4 linear (its dense gradient)
    def __tensor_flatten__(self):
        return ["_codes", "_scale", "_gs"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return NVFP4GatheredWeight(inner["_codes"], inner["_scale"], inner["_gs"], outer_size, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default) or (  # same-shape views: FSDP2, DTensor.to_local (TP)
                func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(args[0].shape)):
            w = args[0]
            return cls(w._codes, w._scale, w._gs, w.shape, w.dtype)
        raise RuntimeError(
            f"an NVFP4-gathered weight (fsdp_nvfp4_all_gather) reached {func}: only the NVFP4 linear reads "
            "it. A module that uses its converted layer's weight directly needs fsdp_nvfp4_all_gather = false")


def gathered_nvfp4(w: NVFP4GatheredWeight) -> NVFP4Tensor:
    """W as an NVFP4Tensor with 16×16 tiles (what quantize_weight would have produced). A function, not
    a method: torch.compile reads a traceable subclass's inner tensors but puts its methods' calls in
    the graph, where a non-tensor result is a graph break."""
    return NVFP4Tensor(w._codes, w._scale, w._gs, w.shape, (BLOCK, BLOCK))


def _tp_group_of(local: NVFP4ShardedWeight, params, fsdp_mesh):
    """The process group of the tensor-parallel mesh dim that shards the weight whose FSDP2 shard is
    ``local`` (a mesh dim not FSDP2's, placing the weight as Shard), False when none does: found among
    ``params``, the sharded DTensor parameters of the module FSDP2 gathers for."""
    fsdp_dims = set(getattr(fsdp_mesh, "mesh_dim_names", None) or ())
    for p in params:
        if getattr(p, "_local_tensor", None) is not local:
            continue
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or ()
        for i, placement in enumerate(p.placements):
            if names and names[i] not in fsdp_dims and placement.is_shard():
                return mesh.get_group(i)
        return False
    return False


def _sharded_weights(model) -> list[NVFP4ShardedWeight]:
    """The model's (or model parts') NVFP4-gathered weight shards that FSDP2 has all-gathered before, in
    parameter order (the same on every rank)."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    found = []
    for part in parts:
        for p in part.parameters():
            local = getattr(p, "_local_tensor", p)  # FSDP2's sharded DTensor holds the wrapper as its shard
            if isinstance(local, NVFP4ShardedWeight) and local._gathered_as is not None:
                found.append(local)
    return found


def precompute_scales(model) -> int:
    """Reduce the tile amaxes of every NVFP4-gathered weight of ``model`` (a module or a list of model
    parts) in one all-reduce per FSDP group, encode each shard, and keep its scales and codes for its next
    all-gathers. Call it after the optimizer step on every rank (the converter's post-optimizer hook
    does); the result is bit for bit what each hook would have computed. Returns the number of weights."""
    weights = _sharded_weights(model)
    by_group: dict = {}  # (group, size) -> [(weight, its tile-amax grid)]
    for wt in weights:  # in parameter order, the same on every rank
        mesh, n_rows, dtype = wt._gathered_as
        ws, _, group = _shard_dim(mesh)
        w, offset = wt._rows(mesh, n_rows, dtype)  # one shard's cast copy at a time (cast again to encode)
        by_group.setdefault((group, ws), []).append((wt, _shard_functions(w)[0](w, offset, n_rows)))
        del w
    reduced = []  # (weight, its all-reduced grid), in parameter order
    for (group, ws), entries in by_group.items():
        grids = [grid for _, grid in entries]
        if ws > 1:
            flat = torch.cat(grids)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            TRAFFIC.add_reduced(flat.numel() * flat.element_size())
            grids = flat.split([g.numel() for g in grids])
        reduced += [(wt, grid) for (wt, _), grid in zip(entries, grids)]
    by_tp: dict = {}  # TP-sharded weights: their tensor amaxes (the grids' last slots) over each TP group
    for wt, grid in reduced:
        if wt._tp_group:
            by_tp.setdefault(wt._tp_group, []).append(grid)
    for group, grids in by_tp.items():
        maxes = torch.cat([g[-1:] for g in grids])
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        TRAFFIC.add_reduced(maxes.numel() * maxes.element_size())
        for g, m in zip(grids, maxes):
            g[-1] = m
    for wt, grid in reduced:
        wt._encode(*wt._gathered_as, grid=grid, precomputed=True)
    return len(weights)


def wrap_weight(module: torch.nn.Module) -> None:
    """Make ``module.weight`` (a converted Linear's, before fully_shard) gather as NVFP4 under FSDP2."""
    w = module.weight
    if isinstance(w, NVFP4ShardedWeight):
        return
    module.weight = torch.nn.Parameter(NVFP4ShardedWeight(w.data), requires_grad=w.requires_grad)
