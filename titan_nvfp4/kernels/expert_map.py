"""The expert of each 16-row block of routed tokens, in one Triton launch (sm_80+, ROCm, the CPU
interpreter), for the host code of the grouped quantization, amax and SwiGLU kernels (one call each).
Twin of ``numerics.expert_blocks.block_experts`` (arange, searchsorted and a cast: three kernels, but traceable,
which autograd code needs); tests/test_grouped.py checks the two against each other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_pow2

_BLOCK = 128  # blocks per program


@triton.jit
def _block_experts_kernel(OFFS, E, OUT, NBLK, EP2: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[b] = the number of group ends OFFS[0..E) at or below row 16·b (searchsorted, right side)."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, EP2)
    ends = tl.load(OFFS + i, mask=i < E, other=2**31 - 1)
    first_row = (b * 16).to(ends.dtype)
    tl.store(OUT + b, tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1), mask=b < NBLK)


def block_experts_triton(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [⌈rows/16⌉]: numerics.expert_blocks.block_experts(offsets, rows) in one launch (offsets contiguous)."""
    nblk = -(-rows // 16)
    out = torch.empty(nblk, dtype=torch.int32, device=offsets.device)
    E = offsets.numel()
    if nblk:
        launch(_block_experts_kernel, (cdiv(nblk, _BLOCK),), offsets, E, out, nblk,
               EP2=next_pow2(max(E, 1)), BLOCK=_BLOCK)
    return out
