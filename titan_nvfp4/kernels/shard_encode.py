"""Triton kernels for FSDP2's NVFP4 all-gather: a shard of rows [offset, offset + R) of a 16×16-tiled
weight W [N, K] reduces into W's tile-amax grid, then encodes its rows with W's tile scales. One launch
each (through the launch cache, kernels/launch.py: FSDP2 calls them for every weight at every
all-gather), instead of the reference's chain of small ops. Reference twins: numerics/nvfp4.py
tile_amax_of_rows and encode_tile_rows (tests/test_fsdp_all_gather.py checks them bit for bit)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .nvfp4_jit import e2m1_code, encode_factor, nan_to_inf_abs, pack_pairs

BK = 128  # columns per program


@triton.jit
def _tile_amax_kernel(X, R, K, sx, OFFSET, KEEP, GRID, BK: tl.constexpr):
    """Program (t, kb): tile row OFFSET // 16 + t of W, columns [kb·BK, …): the amax (NaN as +inf) of
    the shard's rows in each 16×16 tile, stored in GRID [N/16, K/16]."""
    tile = OFFSET // 16 + tl.program_id(0)
    g = tile * 16 + tl.arange(0, 16)  # global rows of the tile
    r = g - OFFSET  # the shard's rows
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = ((r >= 0) & (r < KEEP))[:, None] & (cols < K)[None, :]
    x = tl.load(X + r[:, None].to(tl.int64) * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.max(tl.reshape(tl.max(nan_to_inf_abs(x), axis=0), (BK // 16, 16)), axis=1)
    kb = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    tl.store(GRID + tile * (K // 16) + kb, a, mask=kb < K // 16)


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
    r = encode_factor(e.to(tl.float32), tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc))
    y = tl.reshape(tl.reshape(x, (16, BK // 16, 16)) * r[:, :, None], (16, BK))
    keep = tl.reshape(tl.broadcast_to(tl.where(r == r, 15, 0).to(tl.uint8)[:, :, None], (16, BK // 16, 16)), (16, BK))
    codes = e2m1_code(y) & keep
    cols2 = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(D + rows[:, None].to(tl.int64) * (K // 2) + cols2[None, :], pack_pairs(codes, 16, BK),
             mask=(rows < R)[:, None] & (cols2 < K // 2)[None, :])


def _keep(rows: torch.Tensor, offset: int, n_rows: int) -> int:
    return max(0, min(rows.shape[0], n_rows - offset))


def tile_amax_of_rows_triton(rows: torch.Tensor, offset: int, n_rows: int) -> torch.Tensor:
    """Kernel twin of numerics.nvfp4.tile_amax_of_rows."""
    r, k = rows.shape
    if k % 16 or n_rows % 16:
        raise ValueError(f"16x16 tiles need both weight dims to be multiples of 16, got [{n_rows}, {k}]")
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    grid = torch.zeros(n_rows // 16, k // 16, dtype=torch.float32, device=rows.device)
    keep = _keep(rows, offset, n_rows)
    if keep:
        tiles = (offset + keep - 1) // 16 - offset // 16 + 1
        launch(_tile_amax_kernel, (tiles, triton.cdiv(k, BK)), rows, r, k, rows.stride(0), offset, keep, grid,
               BK=BK, num_warps=4)
    return grid


def encode_tile_rows_triton(rows: torch.Tensor, offset: int, e_b: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Kernel twin of numerics.nvfp4.encode_tile_rows (codes of non-finite tiles are 0 here)."""
    r, k = rows.shape
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = torch.empty(r, k // 2, dtype=torch.uint8, device=rows.device)
    if r:
        keep = _keep(rows, offset, e_b.shape[0] * 16)
        launch(_encode_rows_kernel, (triton.cdiv(r, 16), triton.cdiv(k, BK)), rows, r, k, rows.stride(0), offset,
               keep, e_b.contiguous(), s_enc.reshape(1).float(), out, BK=BK, num_warps=4)
    return out
