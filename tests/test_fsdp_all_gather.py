"""FSDP2's NVFP4 weight all-gather (distributed/fsdp_all_gather.py): shards that encode their own rows
with the all-reduced tile-amax grid give bit for bit the codes and scales of quantizing the whole
weight (odd shard offsets, tiles straddling shards, adversarial values), and a model trained with
the NVFP4 all-gather computes exactly what the BF16 all-gather computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.numerics.formats import unpack_nibbles
from titan_nvfp4.numerics.nvfp4 import encode_tile_rows, quantize_nvfp4, tile_amax_of_rows, tile_scales
from dist_util import run_ranks


def _shards(w: torch.Tensor, world: int) -> list[tuple[torch.Tensor, int]]:
    """FSDP2's dim-0 shards of w, each padded to ceil(N/world) rows, with their row offsets."""
    chunk = -(-w.shape[0] // world)
    out = []
    for r in range(world):
        rows = w[r * chunk:(r + 1) * chunk]
        pad = w.new_zeros(chunk - rows.shape[0], w.shape[1])
        out.append((torch.cat([rows, pad]), r * chunk))
    return out


def _gathered(w: torch.Tensor, world: int, reduce: bool = True):
    """What every rank ends with: the concatenated codes, the tile scales and the tensor scale (rank 0's
    when ``reduce`` is False: each rank's own grid, no all-reduce)."""
    shards = _shards(w, world)
    grids = [tile_amax_of_rows(s, off, w.shape[0]) for s, off in shards]
    grid = torch.stack(grids).amax(0) if reduce else None
    codes = []
    for (s, off), own in zip(shards, grids):
        e_b, s_enc = tile_scales(grid if reduce else own)
        codes.append(encode_tile_rows(s, off, e_b, s_enc))
    e_b, s_enc = tile_scales(grid if reduce else grids[0])
    return torch.cat(codes)[: w.shape[0]], e_b, torch.reciprocal(s_enc)


def _weight(kind: str, n: int = 96, k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)  # very different rows
    if kind == "zero_tiles":
        w[16:48] = 0
        w[:, :16] = 0
    elif kind == "ties":  # values on E2M1 midpoints after scaling: nearest-even decides
        w = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (n * k // 8)).view(n, k)
        w *= torch.logspace(-2, 2, n).unsqueeze(1)
    elif kind == "tiny_huge":
        w[::7] *= 1e-30
        w[5] = 3e38
    elif kind == "all_zero":
        w.zero_()
    return w.bfloat16()


@pytest.mark.parametrize("kind", ["random", "zero_tiles", "ties", "tiny_huge", "all_zero"])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 7, 8])
def test_sharded_encoding_equals_quantizing_the_whole_weight(kind, world):
    w = _weight(kind)
    ref = quantize_nvfp4(w, (16, 16))
    codes, e_b, gs = _gathered(w, world)
    assert torch.equal(codes, ref.data)
    assert torch.equal(e_b.view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(gs, ref.global_scale)


def test_non_finite_weights_decode_to_nan_as_the_whole_weight_does():
    w = _weight("random")
    w[37, 5] = float("nan")  # in a tile straddling shards 0 and 1 at world 2 (rows 32..47)
    w[90, 3] = float("inf")
    codes, e_b, gs = _gathered(w, 3)
    assert torch.isnan(quantize_nvfp4(w, (16, 16)).dequantize()).all()
    assert torch.isnan(gs) and torch.isnan(e_b.float()).all()


def test_without_the_all_reduce_the_shards_disagree():
    """The negative control: each shard scaling by its own grid (the peer bug) changes the codes."""
    w = _weight("random")
    ref = quantize_nvfp4(w, (16, 16))
    codes, _, _ = _gathered(w, 3, reduce=False)
    assert not torch.equal(codes, ref.data)


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (NaN payloads differ between CUDA's division and torch's)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("kind", ["random", "zero_tiles", "ties", "tiny_huge", "nonfinite"])
@pytest.mark.parametrize("world", [3, 5])
def test_shard_kernels_equal_their_reference_twins(kind, world, device):
    """kernels/shard_encode.py (Triton: the interpreter on a CPU, compiled on a GPU) against
    tile_amax_of_rows and encode_tile_rows, shard by shard: grids bit for bit, codes bit for bit
    outside non-finite tiles."""
    from titan_nvfp4.kernels.shard_encode import encode_tile_rows_triton, tile_amax_of_rows_triton, tile_scales_triton

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton's interpreter is only on for CPU-only machines (conftest.py)")
    w = _weight("random" if kind == "nonfinite" else kind, n=80, k=160)  # K spans two 128-column programs
    if kind == "nonfinite":
        w[37, 5], w[70, 150] = float("nan"), float("-inf")
    shards = _shards(w, world)
    grids = [tile_amax_of_rows(s, off, w.shape[0]) for s, off in shards]
    bufs = []
    for (s, off), ref in zip(shards, grids):
        got = tile_amax_of_rows_triton(s.to(device), off, w.shape[0]).cpu()
        assert torch.equal(got[:-1].view_as(ref), ref) and torch.equal(got[-1], ref.amax())
        bufs.append(got)
    e_b, s_enc = tile_scales(torch.stack(grids).amax(0))
    got_e, got_s = tile_scales_triton(torch.stack(bufs).amax(0).to(device), *w.shape)  # the all-reduced buffer
    assert torch.equal(got_e.cpu().view(torch.uint8), e_b.view(torch.uint8))
    assert _same_or_both_nan(got_s.cpu(), torch.stack([s_enc, torch.reciprocal(s_enc)]))
    finite = torch.isfinite(e_b.float()).repeat_interleave(16, 0).repeat_interleave(8, 1)  # per code byte
    for s, off in shards:
        got = encode_tile_rows_triton(s.to(device), off, e_b.to(device), s_enc.to(device)).cpu()
        ref = encode_tile_rows(s, off, e_b, s_enc)
        rows = torch.arange(off, off + s.shape[0]).clamp(max=w.shape[0] - 1)
        ok = finite[rows] | (torch.arange(off, off + s.shape[0]) >= w.shape[0]).unsqueeze(1)
        assert torch.equal(got[ok], ref[ok])


@pytest.mark.parametrize("device", _DEVICES)
def test_tile_scales_kernel_equals_its_reference_over_many_programs(device):
    """tile_scales_triton over 2100 tiles (three programs) of amaxes from 2^-140 to 2^120 with zeros,
    E4M3-saturating tiles and ties, against tile_scales; then with one +inf tile (a NaN weight), where
    every scale is NaN; then an all-zero weight (S = 1)."""
    from titan_nvfp4.kernels.shard_encode import tile_scales_triton

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton's interpreter is only on for CPU-only machines (conftest.py)")
    g = torch.Generator().manual_seed(3)
    n, k = 16 * 30, 16 * 70
    grid = torch.exp2(torch.empty(n // 16, k // 16).uniform_(-140, 120, generator=g))
    grid.view(-1)[::13] = 0.0
    grid.view(-1)[5::17] = grid.max() * torch.tensor([1.0, 0.5, 1 / 448, 1e-9]).repeat(124)[:124]
    for case in ("finite", "inf", "zero"):
        if case == "inf":
            grid[3, 4] = float("inf")
        if case == "zero":
            grid.zero_()
        buf = torch.cat([grid.flatten(), grid.amax().reshape(1)])
        e_b, s_enc = tile_scales(grid)
        got_e, got_s = tile_scales_triton(buf.to(device), n, k)
        assert torch.equal(got_e.cpu().view(torch.uint8), e_b.view(torch.uint8)), case
        assert _same_or_both_nan(got_s.cpu(), torch.stack([s_enc, torch.reciprocal(s_enc)])), case
    assert got_s[0].item() == 1.0
    with pytest.raises(ValueError, match="tile-amax buffer of 2101"):
        tile_scales_triton(buf[:-1].to(device), n, k)


class _Mesh:
    """What the pre-all-gather hook asks of FSDP2's 1-D mesh: its size, this rank and the group."""

    ndim = 1

    def __init__(self, size: int, rank: int, group=None):
        self._size, self._rank, self._group = size, rank, group

    def size(self, dim: int = 0) -> int:
        return self._size

    def get_local_rank(self, dim: int = 0) -> int:
        return self._rank

    def get_group(self, dim: int = 0):
        return self._group


def _count_reductions(ag, calls: list, encodes: list | None = None) -> None:
    """Make the hook's tile-scales step append to ``calls`` (one entry per reduction of the tile amaxes),
    and its encode step to ``encodes``."""
    real = ag._shard_functions
    encodes = [] if encodes is None else encodes

    def counted(w):
        amax, scales, encode = real(w)
        return amax, (lambda *a: calls.append(1) or scales(*a)), (lambda *a: encodes.append(1) or encode(*a))

    ag._shard_functions = counted


def _hook_worker(rank, world, out, w):
    """Each rank runs the hooks on its CUDA shard (the kernels' path), the codes are gathered as FSDP2
    would (gloo all-gathers CUDA tensors too), and rank 0 reports the unsharded weight's parts."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight, gathered_nvfp4

    shard, _ = _shards(w, world)[rank]
    local = NVFP4ShardedWeight(shard.float().cuda())
    module = nn.Linear(160, 80)
    (codes,), meta = local.fsdp_pre_all_gather(_Mesh(world, rank, dist.group.WORLD), w.shape, None, module,
                                               MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    parts = [torch.empty_like(codes) for _ in range(world)]
    dist.all_gather(parts, codes)
    full, _ = local.fsdp_post_all_gather((torch.cat(parts),), meta, torch.bfloat16)
    q = gathered_nvfp4(full)
    if rank == 0:
        out.update(data=q.data.cpu(), scale=q.scale.view(torch.uint8).cpu(), gs=q.global_scale.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hook's kernel path runs on CUDA tensors")
@pytest.mark.parametrize("kind", ["random", "tiny_huge", "all_zero"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpu_hooks_give_the_whole_weights_quantization(kind, world):
    """The pre/post all-gather hooks on CUDA shards (tile amax, all-reduce, tile scales, encode: the
    Triton kernels) give bit for bit the reference quantization of the whole weight; world 1 skips the
    all-reduce, world 2 splits a tile between ranks, world 3 pads the last shard (codes travel one per
    byte)."""
    w = _weight(kind, n=80, k=160)  # made here: str hashes (its seed) differ between processes
    got = run_ranks(_hook_worker, world, w)
    ref = quantize_nvfp4(w, (16, 16))
    assert torch.equal(got["data"], ref.data)
    assert torch.equal(got["scale"], ref.scale.view(torch.uint8))
    assert torch.equal(got["gs"], ref.global_scale)


def test_backward_regather_reuses_the_forward_gathers_scales(monkeypatch):
    """Forward all-gathers reduce the tile amaxes every time; a re-gather inside backward (FSDP2's for a
    resharded block) reuses them and the forward's codes; an in-place op on the shard, plain or foreach
    (the optimizer's), drops them, so backward then reduces again and encodes the new weight."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from titan_nvfp4.distributed import fsdp_all_gather as AG

    calls = []
    monkeypatch.setattr(AG, "_shard_functions", AG._shard_functions)  # restored after the test
    _count_reductions(AG, calls)
    w = AG.NVFP4ShardedWeight(_weight("random").float())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

    def gather():
        (codes,), meta = w.fsdp_pre_all_gather(_Mesh(1, 0), w.shape, None, nn.Linear(64, 96), mp)
        return codes, meta

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            got.append(gather())
            return g

    def backward_gather():
        InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
        return got.pop()

    got = []
    codes, _ = gather()
    gather()
    assert len(calls) == 2  # forward: always
    b_codes, (_, e_b, gs, _) = backward_gather()
    assert len(calls) == 2 and torch.equal(b_codes, codes)  # reused
    ref = quantize_nvfp4(w._data.bfloat16(), (16, 16))
    assert torch.equal(e_b.view(torch.uint8), ref.scale.view(torch.uint8)) and torch.equal(gs, ref.global_scale)
    for update in (lambda: w.mul_(4.0), lambda: torch._foreach_add_([w], [torch.full_like(w._data, 0.5)])):
        with torch.no_grad():
            update()
        b_codes, (_, e_b, gs, _) = backward_gather()
        ref = quantize_nvfp4(w._data.bfloat16(), (16, 16))
        assert torch.equal(b_codes, ref.data) and torch.equal(gs, ref.global_scale)
    assert len(calls) == 4


# ----------------------------------------------------------------- FSDP2 on gloo ranks (CPU)

RNE_SR = NVFP4Recipe(gemm_backend="reference")  # the preset: SR and RHT on


class _MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 112):
        super().__init__()
        self.w1 = NVFP4Linear(dim, hidden, recipe=RNE_SR, layer_id=0, name="w1")
        self.w2 = NVFP4Linear(hidden, dim, recipe=RNE_SR, layer_id=1, name="w2")

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _train(world: int, nvfp4_gather: bool, steps: int = 3, precompute: bool = False):
    """Train the MLP a few SGD steps under FSDP2 (bf16 params, fp32 reduce); return the outputs, the
    gathered gradients and (NVFP4 gather) the bytes one all-gather of both weights moved. ``precompute``:
    reduce the tile amaxes after every step, as the converter's post-optimizer hook does."""

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight, precompute_scales, wrap_weight

    torch.manual_seed(0)
    model = _MLP()
    with torch.no_grad():
        model.w1.weight[:40] *= 8.0  # rank 0's rows have a larger amax than the others'
    if nvfp4_gather:
        wrap_weight(model.w1)
        wrap_weight(model.w2)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model.w1, model.w2, model):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    ys, grads = [], []
    for _ in range(steps):
        y = model(x)
        y.float().square().mean().backward()
        ys.append(y.detach().float())
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
        if precompute:
            assert precompute_scales(model) == 2
    gathered_bytes = None
    if nvfp4_gather:
        w = model.w1.weight._local_tensor
        assert isinstance(w, NVFP4ShardedWeight)
        gathered_bytes = 0
        for lin in (model.w1, model.w2):
            local = lin.weight._local_tensor
            (codes,), _ = local.fsdp_pre_all_gather(mesh, lin.weight.shape, None, lin, mp)
            gathered_bytes += codes.numel() * codes.element_size() * world
    return ys, grads, gathered_bytes


def _fsdp_worker(rank, world, out):
    import warnings

    from titan_nvfp4.distributed import fsdp_all_gather as AG

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ys_bf16, g_bf16, _ = _train(world, False)
    reductions, encodes = [], []
    _count_reductions(AG, reductions, encodes)
    AG.TRAFFIC.take()
    ys, g, nbytes = _train(world, True)
    traffic, n_reductions, n_encodes = AG.TRAFFIC.take(), len(reductions), len(encodes)
    # precomputed after each step: count the all-reduces of tile amaxes (op MAX) and what they moved
    import torch.distributed as dist

    real, maxes = dist.all_reduce, []
    dist.all_reduce = lambda t, *a, **k: (maxes.append(t.numel()) if k.get("op") == dist.ReduceOp.MAX else None,
                                          real(t, *a, **k))[1]
    try:
        ys_pre, g_pre, _ = _train(world, True, precompute=True)
    finally:
        dist.all_reduce = real
    if rank == 0:
        out.update(ys_bf16=ys_bf16, g_bf16=g_bf16, ys=ys, g=g, nbytes=nbytes, reductions=n_reductions,
                   traffic=traffic, summary=AG.GatherTraffic.summary(traffic), ys_pre=ys_pre, g_pre=g_pre,
                   maxes=maxes, traffic_pre=AG.TRAFFIC.take(), encodes=n_encodes,
                   encodes_pre=len(encodes) - n_encodes)


@pytest.mark.long
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_nvfp4_all_gather_trains_exactly_as_the_bf16_all_gather(world):
    """2 ranks: even shards (56 and 32 rows, tiles straddling ranks at row 56). 3 ranks: 112 and 64
    rows shard into 38/38/36 and 22/22/20 (odd offsets, a padded last shard). SR and RHT on. Three SGD
    steps with the NVFP4 all-gather give outputs and gradients bit for bit those of FSDP2's BF16
    all-gather, with backward's re-gathers reusing the forward's tile scales."""
    out = run_ranks(_fsdp_worker, world)
    for step, (a, b) in enumerate(zip(out["ys_bf16"], out["ys"])):
        assert torch.equal(a, b), step
    for step, (a, b) in enumerate(zip(out["g_bf16"], out["g"])):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    assert not torch.equal(out["ys"][0], out["ys"][-1])  # the steps did train
    # tile amaxes reduced once per weight and step (forward), not again at backward's re-gather; the
    # last 2: _train's own pre-all-gather calls for the byte count
    assert out["reductions"] == 3 * 2 + 2
    # packed codes move a quarter of BF16's bytes; uneven shards travel one code per byte (FSDP2 wants
    # the padded shard's shape), half of BF16's
    chunks = {2: (56, 32), 3: (38, 22)}[world]
    bf16_bytes = 2 * world * (chunks[0] * 64 + chunks[1] * 112)
    assert out["nbytes"] * {2: 4, 3: 2}[world] == bf16_bytes
    # the traffic counter the converter logs: every gather (forward, backward's re-gathers, the 2 above)
    t = out["traffic"]
    assert t["gathers"] % 2 == 0 and t["gathers"] >= 3 * 2 + 2
    assert t["codes_bytes"] == t["gathers"] // 2 * out["nbytes"] and t["param_dtype_bytes"] == t["gathers"] // 2 * bf16_bytes
    assert t["reduced_bytes"] == out["reductions"] // 2 * 2 * 4 * (7 * 4 + 1)  # both grids: 7x4 tiles + max, fp32
    assert f"{t['gathers']} weight all-gathers moved" in out["summary"] and ("4.0x" if world == 2 else "2.0x") in out["summary"]
    # precompute_scales after every step (the converter's post-optimizer hook): the same bits, with one
    # all-reduce for both weights per step instead of one per weight, and none in the forward hooks
    # after the first step; then _train's own pre-all-gather calls reuse the precomputed scales too
    for a, b in zip(out["ys_bf16"] + out["g_bf16"], out["ys_pre"] + out["g_pre"]):
        assert all(torch.equal(a[n], b[n]) for n in a) if isinstance(a, dict) else torch.equal(a, b)
    grid = 7 * 4 + 1  # fp32 tile amaxes and their max, per weight
    assert out["maxes"] == [grid, grid] + [2 * grid] * 3, out["maxes"]
    # encodes: each forward gather (3 steps x 2 weights) and _train's 2 calls; backward re-gathers reuse the
    # forward's codes. Precomputed: step 1's forward, then each precompute_scales; the hooks encode nothing
    assert (out["encodes"], out["encodes_pre"]) == (3 * 2 + 2, 2 + 3 * 2)
    assert out["traffic_pre"]["reduced_bytes"] == 4 * (2 * grid + 3 * 2 * grid)
