"""The per-expert low-rank branch of the NVFP4 routed experts (``lora_rank`` of the grouped section), shared by the
TorchTitan 0.2 and 0.3 expert modules (imports no TorchTitan).

With rank r every expert weight W_e [N, K] is kept as U_e·diag(σ_e)·V_e + R_e, as DecomposedLinear does for a
dense Linear: R (the weight parameter itself) goes through the NVFP4 grouped GEMM and the rank-r branch
((x V_eᵀ) ⊙ σ_e) U_eᵀ runs beside it as two grouped GEMMs in the input's dtype (``grouped_lowrank``) over the same
token groups. The factors are parameters ``<weight>_lora_u`` [E, N, r], ``<weight>_lora_sigma`` [E, r] and
``<weight>_lora_v`` [E, r, K]; the split is one fp32 SVD per expert (LowRankState). The state dict's ``<weight>``
holds the full W and R is saved as ``<weight>_lora_residual`` (decomposed_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .decomposed_linear import FACTOR_KINDS, LowRankState
from ..autograd.linear_function import autocast_out_dtype
from ..numerics.expert_blocks import row_experts
from ..numerics.lowrank import lowrank_merge


def _with_tail_expert(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 offsets with one more group ending at ``rows``: a zero pseudo-expert for the rows past the last
    expert, which torch._grouped_mm would leave unwritten."""
    return torch.cat([offsets.to(torch.int32), offsets.new_full((1,), rows, dtype=torch.int32)])


def grouped_lowrank(x: torch.Tensor, u: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor,
                    offsets: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, N]: rows of expert e get ((x V_eᵀ) ⊙ σ_e) U_eᵀ, rows past the last expert 0, in ``dtype``, by default
    the input's (the autocast dtype under autocast), differentiable in all of x, U, σ, V. BF16 runs two grouped
    GEMMs. Other dtypes (FP32 for lora_dtype = "float32") run two dense GEMMs over all E·r branch columns, each row
    keeping its own expert's r: torch._grouped_mm would loop over the experts after copying the offsets to the
    host (a synchronization per call, ~70 a step in a 4-layer MoE), and at a rank this small the E-fold work
    costs less."""
    dt = dtype or autocast_out_dtype(x)
    E, N, r = u.shape
    K = v.shape[-1]
    if dt != torch.bfloat16:
        own = row_experts(offsets, x.shape[0])[:, None] == torch.arange(E, device=x.device)[None, :]
        z = (x.to(dt) @ (v * sigma[..., None]).to(dt).reshape(E * r, K).t()).view(-1, E, r)
        z = torch.where(own[..., None], z, z.new_zeros(()))  # [T, E, r]: the row's own expert only
        return z.reshape(-1, E * r) @ u.to(dt).transpose(1, 2).reshape(E * r, N)
    vs = torch.cat([v * sigma[..., None], v.new_zeros(1, r, K)]).to(dt)
    ue = torch.cat([u, u.new_zeros(1, N, r)]).to(dt)
    offs = _with_tail_expert(offsets, x.shape[0])
    z = torch._grouped_mm(x.to(dt), vs.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(z, ue.transpose(-2, -1), offs=offs)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N]: rows of expert e get x W_eᵀ + b_e in the input's dtype (the autocast dtype under autocast), rows
    past the last expert 0: the high-precision twin of nvfp4_grouped_mm (after the ``bf16_after_fraction``
    switch, and for R beside a low-rank branch). One torch._grouped_mm with a zero pseudo-expert for the tail."""
    dt = autocast_out_dtype(x)
    E, N, K = weight.shape
    w = torch.cat([weight, weight.new_zeros(1, N, K)]).to(dt)
    y = torch._grouped_mm(x.to(dt), w.transpose(-2, -1), offs=_with_tail_expert(offsets, x.shape[0]))
    if bias is None:
        return y
    expert = row_experts(offsets, x.shape[0])
    return y + torch.cat([bias, bias.new_zeros(1, N)]).to(dt)[expert]


def check_expert_rank(name: str, rank: int, weights: dict, key: str = "lora_rank") -> None:
    """Each expert weight (a tensor or a shape [E, N, K]) must hold rank ``rank``: r <= min(N, K); else name the
    ``key``, the experts and the weight."""
    for g, w in weights.items():
        shape = tuple(getattr(w, "shape", w))
        if rank > min(shape[-2:]):
            raise ValueError(f"{key} {rank} does not fit experts {name!r}: {g} {shape}")


class LowRankExperts(LowRankState):
    """Mixin of an expert module whose 3D weights ``GEMMS`` may each carry a per-expert low-rank branch (module
    docstring); ``lora_rank`` 0 leaves the module as it was (no factors, no flag)."""

    GEMMS: tuple[str, ...] = ()
    lora_rank: int = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for g in cls.GEMMS:  # R under the state-dict key it is saved as (decomposed_linear.py)
            setattr(cls, f"{g}_lora_residual", property(lambda self, g=g: getattr(self, g)))

    @classmethod
    def factor_names(cls) -> tuple[str, ...]:
        """The factor parameters' names, in registration order (U, σ, V of each weight)."""
        return tuple(f"{g}_lora_{k}" for g in cls.GEMMS for k in FACTOR_KINDS)

    def _init_lowrank_experts(self, rank: int) -> None:
        """With a rank, add the factors (allocated like the weights: on meta for a meta module) and the split flag;
        the caller splits the weights once they hold values (decompose_)."""
        self.lora_rank = rank
        if not rank:
            return
        for g in self.GEMMS:
            w = getattr(self, g)
            E, N, K = w.shape
            kw = dict(device=w.device, dtype=w.dtype)
            setattr(self, f"{g}_lora_u", nn.Parameter(torch.empty(E, N, rank, **kw)))
            setattr(self, f"{g}_lora_sigma", nn.Parameter(torch.empty(E, rank, **kw)))
            setattr(self, f"{g}_lora_v", nn.Parameter(torch.empty(E, rank, K, **kw)))
        self._init_lowrank_state(getattr(self, self.GEMMS[0]).device)

    def _factors(self, g: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._factors_of(f"{g}_lora_")

    def _lowrank_names(self) -> list[tuple[str, str]]:
        return [(g, f"{g}_lora_") for g in self.GEMMS]

    @torch.no_grad()
    def decompose_(self) -> None:
        """Split every expert weight (the full W_e before the first split) into U·diag(σ)·V + R anew."""
        for g in self.GEMMS:
            self._resplit(getattr(self, g), self._factors(g), self.lora_rank)
        self._mark_decomposed()

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """{weight name: W = R + U·diag(σ)·V} (fp32): what the BF16 experts would load."""
        return {g: lowrank_merge(*self._factors(g), getattr(self, g)) for g in self.GEMMS}

    def _lowrank_add(self, y: torch.Tensor, g: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """y plus weight ``g``'s low-rank branch of x (y itself without a rank)."""
        if not self.lora_rank:
            return y
        factors = self._factors(g)
        if self.lora_dtype == "float32":  # the branch in FP32, summed with y in FP32
            with torch.autocast(x.device.type, enabled=False):
                return (y.float() + grouped_lowrank(x, *factors, offsets, torch.float32)).to(y.dtype)
        return y + grouped_lowrank(x, *factors, offsets).to(y.dtype)


__all__ = ["LowRankExperts", "check_expert_rank", "grouped_linear", "grouped_lowrank"]
