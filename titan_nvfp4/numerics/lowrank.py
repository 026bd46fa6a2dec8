"""The low-rank outlier split of DecomposedLinear: W = U·diag(σ)·V + R from the top-r SVD of W.

FP4 weights lose a few large singular directions hardest; keeping the top r of them in a small
high-precision branch and quantizing only the residual R recovers that signal. Everything here runs
in fp32 (the SVD included), so U·diag(σ)·V + R reproduces W to fp32 rounding.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .nvfp4 import BLOCK


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) DTensor; other tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_rank(rank, where: str = "quantize.linear.nvfp4", key: str = "lora_rank") -> None:
    """0 (off) or a positive multiple of 16 (the branch's GEMMs contract over r in NVFP4 blocks)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or rank % BLOCK:
        raise ValueError(f"[{where}] {key} must be 0 (off) or a positive multiple of {BLOCK}, got {rank!r}")


def lowrank_split(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U [..., out, r], σ [..., r], V [..., r, in], R = W − U·diag(σ)·V), fp32, from the top-r singular
    triplets of W [..., out, in] (a batch of matrices, e.g. stacked experts, is split matrix by matrix;
    U and V orthonormal, σ descending)."""
    check_rank(rank)
    out_features, in_features = w.shape[-2:]
    if rank > min(out_features, in_features):
        raise ValueError(f"lora_rank {rank} exceeds the weight's smaller dim ({out_features}x{in_features})")
    w32 = w.detach().float()
    u, s, vh = torch.linalg.svd(w32, full_matrices=False)
    u, s, v = u[..., :rank].contiguous(), s[..., :rank].contiguous(), vh[..., :rank, :].contiguous()
    return u, s, v, w32 - (u * s[..., None, :]) @ v


def lowrank_merge(u: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """W = R + U·diag(σ)·V in fp32, batched as lowrank_split (sharded factors are gathered first)."""
    u, sigma, v, residual = (full_tensor(t).float() for t in (u, sigma, v, residual))
    return residual + (u * sigma[..., None, :]) @ v


def project_moments(m_w: torch.Tensor, v_w: torch.Tensor, u: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Adam's moments of a fresh split's factors, from those of the residual R (fp32, batched as lowrank_split).

    R's gradient is the gradient G of the whole W, so R's first moment m_w estimates E[G], and U, σ, V's are what G
    gives through y = x·(U·diag(σ)·V)ᵀ: G·(σV)ᵀ, (Uσ)ᵀ·G and diag(Uᵀ·G·Vᵀ). Second moments map through the squared
    coefficients (each element's gradient as a sum of independent terms: the cross terms are dropped).
    Returns {"u": (m, v), "sigma": (m, v), "v": (m, v)} shaped like the factors.
    """
    m_w, v_w, u, sigma, v = (t.float() for t in (m_w, v_w, u, sigma, v))
    sv = v * sigma[..., :, None]  # σV [..., r, K]
    us = u * sigma[..., None, :]  # Uσ [..., N, r]
    return {
        "u": (m_w @ sv.transpose(-2, -1), v_w @ sv.square().transpose(-2, -1)),
        "sigma": (((u.transpose(-2, -1) @ m_w) * v).sum(-1), ((u.square().transpose(-2, -1) @ v_w) * v.square()).sum(-1)),
        "v": (us.transpose(-2, -1) @ m_w, us.square().transpose(-2, -1) @ v_w),
    }
