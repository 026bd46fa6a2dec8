"""Triton kernels for FSDP2's NVFP4 all-gather: a shard of rows [offset, offset + R) of a 16×16-tiled
weight W [N, K] reduces into W's tile-amax grid (and the grid's max), the all-reduced grid gives W's
tile scales and tensor scale, then the shard encodes its rows with them. One launch each (through the
launch cache, kernels/launch.py: FSDP2 calls them for every weight at every all-gather), instead of
the reference's chain of small ops, each of which costs host time in FSDP2's hook. Reference twins:
numerics/nvfp4.py tile_amax_of_rows, tile_scales and encode_tile_rows (tests/test_fsdp_all_gather.py
checks them bit for bit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .nvfp4_jit import (block_scales, e2m1_code, e4m3_value, encode_factor, global_encode_scale, nan_to_inf_abs,
                        pack_pairs)

BK = 128  # columns per program
BT = 1024  # tiles per program of the scales kernel


@triton.jit
def _tile_amax_kernel(X, R, K, sx, OFFSET, KEEP, GRID, T, BK: tl.constexpr):
    """Program (t, kb): tile row OFFSET // 16 + t of W, columns [kb·BK, …): the amax (NaN as +inf) of
    the shard's rows in each 16×16 tile, stored in GRID [N/16, K/16]; their max goes (atomic max; GRID
    starts at 0 and amaxes are >= 0) to GRID[T], T = N/16 · K/16, the slot after the grid."""
    tile = OFFSET // 16 + tl.program_id(0)
    g = tile * 16 + tl.arange(0, 16)  # global rows of the tile
    r = g - OFFSET  # the shard's rows
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = ((r >= 0) & (r < KEEP))[:, None] & (cols < K)[None, :]
    x = tl.load(X + r[:, None].to(tl.int64) * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.max(tl.reshape(tl.max(nan_to_inf_abs(x), axis=0), (BK // 16, 16)), axis=1)
    kb = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    tl.store(GRID + tile * (K // 16) + kb, a, mask=kb < K // 16)
    tl.atomic_max(GRID + T, tl.max(tl.where(kb < K // 16, a, 0.0), axis=0), sem="relaxed")  # read by a later kernel


@triton.jit
def _tile_scales_kernel(GRID, T, E, S, BT: tl.constexpr):
    """Program i: tiles [i·BT, …) of the all-reduced GRID [T + 1] (tile amaxes, then their max): the
    E4M3 tile scales into E [T]; program 0 also stores the tensor's encode scale S[0] and decode scale
    S[1] = 1/S[0] (correctly rounded, as torch.reciprocal)."""
    s_enc = global_encode_scale(tl.load(GRID + T))
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e, _ = block_scales(tl.load(GRID + t, mask=t < T, other=0.0), s_enc)
    tl.store(E + t, e, mask=t < T)
    if tl.program_id(0) == 0:
        tl.store(S, s_enc)
        tl.store(S + 1, tl.math.div_rn(1.0, s_enc))


@triton.jit
def _encode_rows_kernel(X, R, K, sx, OFFSET, KEEP, E, S_ENC, D, BK: tl.constexpr):
    """Program (i, kb): 16 shard rows from 16i, columns [kb·BK, …): nearest-even codes with the tile
    scales E [N/16, K/16] and the encode scale S_ENC, packed two per byte into D [R, K/2]. Rows past
    KEEP (FSDP2's padding) and non-finite tiles get code 0 (their tiles decode to 0 and NaN)."""
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    live = (rows < KEEP)[:, None] & (cols < K)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=live, other=0.0).to(tl.float32)
    kb = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    tiles = (OFFSET + rows) // 16
    smask = (rows < KEEP)[:, None] & (kb < K // 16)[None, :]
    e = tl.load(E + tiles[:, None] * (K // 16) + kb[None, :], mask=smask, other=0.0)  # e4m3 [16, BK/16]
    s_enc = tl.load(S_ENC)
    r = encode_factor(e4m3_value(e), tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc))
    y = tl.reshape(tl.reshape(x, (16, BK // 16, 16)) * r[:, :, None], (16, BK))
    keep = tl.reshape(tl.broadcast_to(tl.where(r == r, 15, 0).to(tl.uint8)[:, :, None], (16, BK // 16, 16)), (16, BK))
    codes = e2m1_code(y) & keep
    cols2 = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(D + rows[:, None].to(tl.int64) * (K // 2) + cols2[None, :], pack_pairs(codes, 16, BK),
             mask=(rows < R)[:, None] & (cols2 < K // 2)[None, :])


def _keep(rows: torch.Tensor, offset: int, n_rows: int) -> int:
    return max(0, min(rows.shape[0], n_rows - offset))


def tile_amax_of_rows_triton(rows: torch.Tensor, offset: int, n_rows: int) -> torch.Tensor:
    """Kernel twin of numerics.nvfp4.tile_amax_of_rows, flattened, with the grid's max appended:
    fp32 [N/16 · K/16 + 1] (one buffer, so that one all-reduce (max) gives both)."""
    r, k = rows.shape
    if k % 16 or n_rows % 16:
        raise ValueError(f"16x16 tiles need both weight dims to be multiples of 16, got [{n_rows}, {k}]")
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    tiles_total = n_rows // 16 * (k // 16)
    grid = torch.zeros(tiles_total + 1, dtype=torch.float32, device=rows.device)
    keep = _keep(rows, offset, n_rows)
    if keep:
        tiles = (offset + keep - 1) // 16 - offset // 16 + 1
        launch(_tile_amax_kernel, (tiles, cdiv(k, BK)), rows, r, k, rows.stride(0), offset, keep, grid,
               tiles_total, BK=BK, num_warps=4)
    return grid


def tile_scales_triton(grid: torch.Tensor, n_rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel twin of numerics.nvfp4.tile_scales on tile_amax_of_rows_triton's buffer (all-reduced):
    (E4M3 tile scales [N/16, K/16], fp32 [2] holding the encode scale S and the decode scale 1/S)."""
    tiles_total = n_rows // 16 * (k // 16)
    if grid.shape != (tiles_total + 1,):
        raise ValueError(f"expected a tile-amax buffer of {tiles_total + 1} values for [{n_rows}, {k}], "
                         f"got shape {tuple(grid.shape)}")
    e_b = torch.empty(n_rows // 16, k // 16, dtype=torch.float8_e4m3fn, device=grid.device)
    s = torch.empty(2, dtype=torch.float32, device=grid.device)
    launch(_tile_scales_kernel, (max(1, cdiv(tiles_total, BT)),), grid, tiles_total, e_b, s, BT=BT,
           num_warps=4)
    return e_b, s


def encode_tile_rows_triton(rows: torch.Tensor, offset: int, e_b: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Kernel twin of numerics.nvfp4.encode_tile_rows (codes of non-finite tiles are 0 here)."""
    r, k = rows.shape
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(r, k // 2, dtype=torch.uint8, device=rows.device)
    if r:
        keep = _keep(rows, offset, e_b.shape[0] * 16)
        launch(_encode_rows_kernel, (cdiv(r, 16), cdiv(k, BK)), rows, r, k, rows.stride(0), offset,
               keep, e_b if e_b.is_contiguous() else e_b.contiguous(),
               s_enc if s_enc.shape == (1,) and s_enc.dtype == torch.float32 else s_enc.reshape(1).float(), out,
               BK=BK, num_warps=4)
    return out
