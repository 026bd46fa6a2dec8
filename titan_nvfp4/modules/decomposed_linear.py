"""DecomposedLinear: W = U·diag(σ)·V + R, R through the NVFP4 linear and the rank-r outlier branch
beside it (the `lora_rank` knob of `[quantize.linear.nvfp4]`).

    y = NVFP4(x, R) + b + ((x Vᵀ) ⊙ σ) Uᵀ

The residual R is the module's ``weight`` parameter, so code that initializes ``.weight`` (TorchTitan's
init_weights) writes the full W there; ``decompose_()`` then splits it (numerics/lowrank.py, fp32 SVD)
into U, σ, V and R. Built from a meta-device Linear the module only allocates (on meta) and never
reads data: the converter runs ``decompose_()`` right after TorchTitan's init_weights, and a
checkpoint load brings U, σ, V, R and the ``lora_decomposed`` flag back as they were. A module used
before it was decomposed raises instead of computing something else. The branch runs in the input's
dtype (BF16 under TorchTitan's mixed precision) or, with ``lora_nvfp4``, as two NVFP4 linears (r is
a multiple of 16 for that). All four of U, σ, V, R train.

Sharded parameters (FSDP2, TP: DTensors): the SVD runs on the full weight (all-gathered) in fp32 on
every rank, and the factors are distributed from rank 0's result, so every rank holds shards of the
same decomposition. Plain local TP shards (``local_tp``, TorchTitan 0.3's spmd_types) do the same with the
TP group's collectives: U sharded like a colwise W, V like a rowwise one, the other factors whole.

State dict (docs/checkpoints.md): ``weight`` holds the full W = R + U·diag(σ)·V (computed at save, sharded
like R), so a model without the branch (BF16, or NVFP4 with lora_rank = 0) loads the weight the module
computes; R itself is saved bit-exactly as ``lora_residual`` and put back into ``weight`` at load. A
state dict with ``weight`` alone (a BF16 checkpoint) loads as W and is decomposed at load.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..distributed.tensor_parallel import broadcast_from_first, gather_shards, shard_of
from ..autograd.linear_function import autocast_out_dtype, meta_linear
from ..numerics.lowrank import full_tensor, lowrank_merge, lowrank_split, project_moments
from ..numerics.nvfp4 import BLOCK
from .nvfp4_linear import NVFP4Linear, check_linear_dims
from ..recipe.nvfp4_recipe import NVFP4Recipe
from .telemetry import measure_linear

#: the factor names of a decomposed weight W = U·diag(σ)·V + R (attribute ``<prefix><kind>``)
FACTOR_KINDS = ("u", "sigma", "v")
#: SR streams of the branch GEMMs: layer ids LORA_LAYER_ID_BASE + 2·layer_id + {0, 1}
LORA_LAYER_ID_BASE = 1 << 21


def assign_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """param ← value (a full tensor); a DTensor parameter takes its shard of rank 0's value."""
    value = value.to(param.dtype)
    if isinstance(param, DTensor):
        value = distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements)
    param.copy_(value)


#: the state-dict key suffix of a low-rank weight's exact residual R (its ``weight`` key holds the full W)
RESIDUAL = "residual"
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")  # torch.compile / activation-checkpoint prefixes


def _local_plain(t: torch.Tensor) -> torch.Tensor:
    """The local values of a (possibly sharded) tensor as a plain tensor (unwraps the NVFP4 all-gather's)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return getattr(t, "_data", t)


def dense_like(weight: torch.Tensor, u: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """W = R + U·diag(σ)·V (fp32 sum, R's dtype), sharded like R: each rank adds its slice of the full
    low-rank product to its own shard of R (the factors are small and gathered)."""
    u, sigma, v = (full_tensor(t).float() for t in (u, sigma, v))
    low = (u * sigma[..., None, :]) @ v  # as lowrank_merge
    if not isinstance(weight, DTensor):
        return (_local_plain(weight).float() + low).to(weight.dtype)
    low = distribute_tensor(low, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
    local = (_local_plain(weight).float() + low).to(weight.dtype)
    return DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                              stride=weight.stride())


def _shard_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A full loaded value given to a DTensor parameter (a full_state_dict load): this rank's slice."""
    if isinstance(param, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value


def _lookup(state_dict: dict, prefix: str, name: str) -> str | None:
    """The key of ``name`` under ``prefix``, also without compile / activation-checkpoint wrappers
    (torch's set_model_state_dict only re-prefixes parameters and buffers, not extra keys)."""
    bare = prefix
    for w in _WRAPPERS:
        bare = bare.replace(w, "")
    return next((k for k in (prefix + name, bare + name) if k in state_dict), None)


class LowRankState:
    """Whether a low-rank module's weights hold a decomposition (``lora_decomposed`` buffer, saved with
    the checkpoint, and its Python twin ``_lora_ready`` read in forward): shared by DecomposedLinear and
    the decomposed expert modules (lowrank_experts.py), which define ``decompose_()``. ``lora_dtype``: the
    branch's precision, "input" or "float32" (knobs.py; set by ``set_lora_dtype``)."""

    lora_dtype: str = "input"

    def _init_lowrank_state(self, device) -> None:
        self.register_buffer("lora_decomposed", torch.zeros((), dtype=torch.bool, device=device))
        self._lora_ready = False  # no sync, no graph break in forward

    def _mark_decomposed(self) -> None:
        self.lora_decomposed.fill_(True)
        self._lora_ready = True

    def _is_decomposed(self) -> bool:
        return self._lora_ready or bool(self.lora_decomposed)

    def _resplit(self, weight: torch.Tensor, factors: tuple[torch.Tensor, ...], rank: int) -> None:
        """Split the weight that ``weight`` and its ``factors`` (U, σ, V) compute (``weight`` alone before
        the first split) anew into them: fp32 SVD of the full tensor, each shard from rank 0's result."""
        local_tp = getattr(self, "local_tp", None)
        if local_tp is not None:
            return self._resplit_local_shards(weight, factors, rank, *local_tp)
        w = full_tensor(weight).float()
        if self._is_decomposed():
            w = lowrank_merge(*factors, w)
        for param, value in zip((*factors, weight), lowrank_split(w, rank)):
            assign_full(param, value)

    def _resplit_local_shards(self, weight: torch.Tensor, factors: tuple[torch.Tensor, ...], rank: int, dim: int,
                              group) -> None:
        """_resplit on plain local TP shards (NVFP4Linear.local_tp: TorchTitan 0.3's spmd_types): the factor
        sharded like W (U colwise, V rowwise) gives this rank's shard of W with the replicated ones, the shards are
        gathered along ``dim`` and split as one process would, and each rank keeps its chunks of the first rank's
        split."""
        w = weight.detach().float()
        if self._is_decomposed():
            w = lowrank_merge(*factors, w)
        whole = broadcast_from_first(lowrank_split(gather_shards(w, dim, group), rank), group)
        for param, value in zip((*factors, weight), whole):
            param.copy_(shard_of(value, param.shape, group).to(param.dtype))

    @torch.no_grad()
    def decompose_fresh_(self) -> None:
        """Split weights just initialized as full ones (TorchTitan 0.3's init_states writes W over a module that
        may hold a split already): forget the old split, then ``decompose_()``."""
        self.lora_decomposed.fill_(False)
        self._lora_ready = False
        self.decompose_()

    def _check_decomposed(self) -> None:
        if not self._lora_ready:
            raise RuntimeError(f"{type(self).__name__} {getattr(self, 'layer_name', '')!r} used before its weights "
                               "were decomposed: run init_weights (the converter hooks the split into it), "
                               "titan_nvfp4.modules.decomposed_linear.redecompose(model), or load a checkpoint")

    def _apply(self, fn, recurse: bool = True):
        # materializing a meta module (TorchTitan's to_empty) leaves lora_decomposed uninitialized: the
        # weights are about to be initialized as full ones, so the module is not decomposed yet
        flag = self._buffers.get("lora_decomposed")  # absent: a module converted without a rank
        was_meta = flag is not None and flag.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.lora_decomposed.is_meta:
            self.lora_decomposed.fill_(False)
            self._lora_ready = False
        return self

    def _lowrank_names(self) -> list[tuple[str, str]]:
        """(weight name, factor-key prefix) of each decomposed weight: ("weight", "lora_") for a Linear."""
        raise NotImplementedError

    @torch.no_grad()
    def project_moments_(self, state_of) -> int:
        """After a re-split: each factor's Adam moments (exp_avg, exp_avg_sq) from its residual's
        (numerics/lowrank.py project_moments), so that they describe the new factors; ``state_of(param)`` gives a
        parameter's optimizer state (None before its first step: nothing to project). Returns how many weights."""
        if getattr(self, "local_tp", None) is not None:
            raise ValueError(f"{type(self).__name__}: lora_refresh_moments = 'project' is not supported on plain "
                             "local tensor-parallel shards (TorchTitan 0.3's spmd_types); use 'keep'")
        n = 0
        for w_name, fp in self._lowrank_names():
            factors = self._factors_of(fp)
            states = [state_of(p) for p in (getattr(self, w_name), *factors)]
            if not all(states):
                continue
            if any("exp_avg" not in s or "exp_avg_sq" not in s for s in states):
                raise ValueError(f"{type(self).__name__} {w_name}: lora_refresh_moments = 'project' needs Adam's "
                                 f"moments (exp_avg, exp_avg_sq); the optimizer keeps {sorted(states[0])}")
            new = project_moments(full_tensor(states[0]["exp_avg"]), full_tensor(states[0]["exp_avg_sq"]),
                                  *(full_tensor(f) for f in factors))
            for state, kind in zip(states[1:], FACTOR_KINDS):
                for key, value in zip(("exp_avg", "exp_avg_sq"), new[kind]):
                    assign_full(state[key], value)
            n += 1
        return n

    def _factors_of(self, factor_prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(getattr(self, factor_prefix + n) for n in FACTOR_KINDS)

    def lowrank_factors(self) -> list[tuple[str, nn.Parameter]]:
        """(attribute name, parameter) of every low-rank factor: U, σ, V of each decomposed weight (none for an
        expert module converted without a rank)."""
        return [(prefix + n, p) for _, prefix in self._lowrank_names() if hasattr(self, prefix + "u")
                for n, p in zip(FACTOR_KINDS, self._factors_of(prefix))]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """``weight`` saved as the full W, R as ``<factor prefix>residual`` (module docstring)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "lora_decomposed" not in self._buffers:
            return
        for w, fp in self._lowrank_names():
            r = destination[prefix + w]
            destination[prefix + fp + RESIDUAL] = r
            if not r.is_meta and self._is_decomposed():  # before the first split ``weight`` already holds W
                with torch.no_grad():
                    destination[prefix + w] = dense_like(getattr(self, w), *self._factors_of(fp))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """R from ``<factor prefix>residual`` into ``weight``; a state dict with the weights only (a model
        without the branch saved it) loads W and is split anew."""
        if "lora_decomposed" not in self._buffers:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        kinds = set()
        for w, fp in self._lowrank_names():
            res = _lookup(state_dict, prefix, fp + RESIDUAL)
            if res is not None:
                state_dict[prefix + w] = _shard_like(getattr(self, w), state_dict.pop(res))
                kinds.add("branch")
            elif prefix + w in state_dict:
                if _lookup(state_dict, prefix, fp + "u") is not None:
                    raise ValueError(
                        f"{prefix}{w}: the state dict has low-rank factors ({prefix}{fp}u) but no {prefix}{fp}{RESIDUAL}: "
                        "a titan-nvfp4 checkpoint from before the residual was saved apart; fold it with "
                        "`python -m titan_nvfp4.tools.export_dense CHECKPOINT dense.pt` and load dense.pt")
                kinds.add("dense")
        if len(kinds) > 1:
            raise ValueError(f"{prefix[:-1]}: the state dict has the residuals of some weights, not of all")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if kinds == {"dense"}:  # W alone: split it here (the factors and the flag are not expected)
            own = {prefix + fp + n for _, fp in self._lowrank_names() for n in FACTOR_KINDS}
            missing_keys[:] = [k for k in missing_keys if k not in own | {prefix + "lora_decomposed"}]
            with torch.no_grad():
                self.lora_decomposed.fill_(False)
                self._lora_ready = False
                self.decompose_()
        else:
            self._lora_ready = bool(self.lora_decomposed)


def set_lora_dtype(modules: nn.Module | list[nn.Module], value: str, one_dtype: bool = False) -> int:
    """Set ``lora_dtype`` (knobs.LORA_DTYPES) on every module under ``modules`` with low-rank factors; returns how
    many.
    "float32" also stores the factors in FP32 (the same Parameter objects, so it must run before the optimizer's
    first step and before sharding: a factor that is already a DTensor in another dtype is refused by name).
    ``one_dtype``: the modules are to be sharded by FSDP2, which holds one parameter dtype per module, so factors
    that would differ from their weights' dtype are refused by name."""
    roots = modules if isinstance(modules, (list, tuple)) else [modules]
    found = [(name, m, factors) for root in roots for name, m in root.named_modules()
             if isinstance(m, LowRankState) and (factors := m.lowrank_factors())]
    for name, m, factors in found:
        m.lora_dtype = value
        if value != "float32":
            continue
        for attr, p in factors:
            if p.dtype == torch.float32:
                continue
            if isinstance(p, DTensor):
                raise ValueError(f"lora_dtype = 'float32': {name}.{attr} is a {p.dtype} DTensor, sharded before the "
                                 "knob could store it in FP32; build the model in FP32 (training.dtype) or set "
                                 "lora_dtype = 'input'")
            if one_dtype:
                raise ValueError(f"lora_dtype = 'float32': {name} holds its weights in {p.dtype}, and FSDP2 shards a "
                                 "module's parameters in one dtype, so its factors cannot be FP32 beside them (TorchTitan "
                                 "0.2's gpt_oss builds its blocks in BF16); train without FSDP (data_parallel_shard_degree"
                                 " = 1) or set lora_dtype = 'input'")
            p.data = p.data.float()
    return len(found)


def lora_dtype_without_rank(section: str, value: str, where: str) -> ValueError:
    """The error for a lora_dtype other than "input" with no low-rank branch to act on (both integrations);
    ``where``: where a lora_rank could be set."""
    return ValueError(f"[{section}] lora_dtype = {value!r} needs a low-rank branch: set lora_rank > 0 {where}, or "
                      "leave lora_dtype = 'input'")


def log_lora_dtype(logger, n: int, scope: str = "") -> None:
    """The log line of lora_dtype = "float32" set on ``n`` modules (both integrations); ``scope`` qualifies them."""
    logger.info(f"NVFP4: the low-rank branches of {n} modules{scope} run in FP32, their factors stored in FP32 "
                "(lora_dtype)")


def check_lowrank_args(name: str, rank, in_features: int, out_features: int, lora_nvfp4, key: str = "rank") -> None:
    """A DecomposedLinear's rank: a positive multiple of 16 within the weight's smaller dim; lora_nvfp4 a bool.
    ``key``: the rank's name in messages (the argument, or the converter's TOML key)."""
    where = f"DecomposedLinear {name!r}" if name else "DecomposedLinear"
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0 or rank % BLOCK:
        zero = " (rank 0: use NVFP4Linear)" if rank == 0 else ""
        raise ValueError(f"{where}: {key} must be a positive multiple of {BLOCK}{zero}, got {rank!r}")
    if rank > min(in_features, out_features):
        raise ValueError(f"{key} {rank} does not fit Linear {name!r} ({out_features}x{in_features}): a "
                         "DecomposedLinear needs rank <= min(in_features, out_features)")
    if not isinstance(lora_nvfp4, bool):
        raise ValueError(f"{where}: lora_nvfp4 must be True or False, got {lora_nvfp4!r}")


class Redecomposed(NamedTuple):
    """What a refresh did: low-rank modules re-split, and weights whose factors' Adam moments were projected."""
    modules: int
    projected: int


def redecompose(model: nn.Module | list[nn.Module], state_of=None) -> Redecomposed:
    """decompose_() every low-rank module (DecomposedLinear, experts with a lora_rank) of ``model`` (or of each
    model part): the lora_refresh_steps refresh; with ``state_of`` (lora_refresh_moments = "project") the
    factors' Adam moments are projected onto the new split (weights whose optimizer state is not found yet, before
    their first step, keep theirs)."""
    parts = model if isinstance(model, list) else [model]
    mods = [m for part in parts for m in part.modules()
            if isinstance(m, LowRankState) and "lora_decomposed" in m._buffers]
    projected = 0
    for m in mods:
        m.decompose_()
        if state_of is not None:
            projected += m.project_moments_(state_of)
    return Redecomposed(len(mods), projected)


def refresh_message(done: Redecomposed, step: int, projecting: bool) -> str:
    """The log line of a refresh after optimizer ``step`` (both TorchTitan integrations)."""
    msg = f"NVFP4: re-decomposed {done.modules} low-rank modules after optimizer step {step}"
    if projecting:
        msg += f", the factors' Adam moments of {done.projected} weights projected onto the new split"
        if not done.projected:
            msg += " (none found in any optimizer's state: the moments describe the old split)"
    return msg


def log_refresh(logger, done: Redecomposed, step: int, projecting: bool) -> None:
    """refresh_message on ``logger``: a warning when a projection found no moments, else info."""
    (logger.warning if projecting and not done.projected else logger.info)(refresh_message(done, step, projecting))


class DecomposedLinear(LowRankState, NVFP4Linear):
    """NVFP4Linear on the residual R plus a rank-r branch U·diag(σ)·V in high precision (see module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int,
                 recipe: NVFP4Recipe | None = None, layer_id: int = 0, lora_nvfp4: bool = False, name: str = "",
                 device=None, dtype=None) -> None:
        check_linear_dims(name or type(self).__name__, in_features, out_features)
        check_lowrank_args(name, rank, in_features, out_features, lora_nvfp4)
        super().__init__(in_features, out_features, bias, recipe=recipe, layer_id=layer_id, name=name,
                         device=device, dtype=dtype)
        self._init_lowrank(rank, lora_nvfp4, layer_id)
        if not self.weight.is_meta:
            self.decompose_()

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: NVFP4Recipe, layer_id: int = 0, name: str = "", *,
                    rank: int = 32, lora_nvfp4: bool = False) -> "DecomposedLinear":
        """Swap in for ``mod`` keeping its Parameters: U, σ, V are allocated on mod.weight's device and
        dtype (meta included); a materialized ``mod`` is decomposed at once, a meta one later."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear({name!r}): needs an nn.Linear, got {type(mod).__name__}")
        check_linear_dims(name, mod.in_features, mod.out_features)
        check_lowrank_args(name, rank, mod.in_features, mod.out_features, lora_nvfp4)
        new = super().from_linear(mod, recipe, layer_id, name)  # an NVFP4Linear-initialized instance of cls
        new._init_lowrank(rank, lora_nvfp4, layer_id)
        if not new.weight.is_meta:
            new.decompose_()
        return new

    def _init_lowrank(self, rank: int, lora_nvfp4: bool, layer_id: int) -> None:
        w = self.weight
        kw = dict(device=w.device, dtype=w.dtype)
        self.rank, self.lora_nvfp4 = rank, lora_nvfp4
        self.lora_u = nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.lora_sigma = nn.Parameter(torch.empty(rank, **kw))
        self.lora_v = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self._init_lowrank_state(w.device)
        # one SR stream per GEMM: R keeps the NVFP4Linear's (layer_id), the branch gets two more
        base = LORA_LAYER_ID_BASE + 2 * layer_id
        self._init_nvfp4(self.recipe, layer_id, w.device, n_gemms=3, stream_ids=(layer_id, base, base + 1))

    @torch.no_grad()
    def decompose_(self) -> None:
        """Split the weight the module computes, W (``weight`` alone before the first split), into
        U·diag(σ)·V + R anew: at initialization, and on refresh (lora_refresh_steps)."""
        self._resplit(self.weight, (self.lora_u, self.lora_sigma, self.lora_v), self.rank)
        self._mark_decomposed()

    def dense_weight(self) -> torch.Tensor:
        """W = R + U·diag(σ)·V (fp32): what a BF16 Linear would load."""
        return lowrank_merge(self.lora_u, self.lora_sigma, self.lora_v, self.weight)

    @property
    def lora_residual(self) -> torch.Tensor:
        """R (``weight``), under the state-dict key it is saved as (torch's state-dict helpers look it up)."""
        return self.weight

    def _lowrank_names(self) -> list[tuple[str, str]]:
        return [("weight", "lora_")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.is_meta:  # shape inference (a meta module is never decomposed)
            return meta_linear(x, self.weight, self.bias)
        self._check_decomposed()
        if self.high_precision:  # bf16_after_fraction: R and the branch in the input's dtype
            y = F.linear(x, self.weight, self.bias)
        else:
            y = self._nvfp4_linear(x, self.weight, self.bias, 0)
            if self.telemetry is not None:  # R, the NVFP4 part (dY: the whole output's gradient)
                measure_linear(self, x, self.weight, y)
        if self.lora_nvfp4 and not self.high_precision:
            h = self._nvfp4_linear(x, self.lora_v, None, 1) * self.lora_sigma
            return y + self._nvfp4_linear(h, self.lora_u, None, 2)
        if self.lora_dtype == "float32":  # the branch in FP32 (its factors BF16 only when FSDP2 gathers them so)
            with torch.autocast(x.device.type, enabled=False):
                h = F.linear(x.float(), self.lora_v.float()) * self.lora_sigma.float()
                return (y.float() + F.linear(h, self.lora_u.float())).to(y.dtype)
        dt = autocast_out_dtype(x)
        h = F.linear(x.to(dt), self.lora_v.to(dt)) * self.lora_sigma.to(dt)
        return y + F.linear(h, self.lora_u.to(dt))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, lora_nvfp4={self.lora_nvfp4}"


__all__ = ["FACTOR_KINDS", "DecomposedLinear", "LORA_LAYER_ID_BASE", "LowRankState", "RESIDUAL", "Redecomposed",
           "assign_full", "dense_like", "log_lora_dtype", "log_refresh", "lora_dtype_without_rank", "redecompose",
           "refresh_message", "set_lora_dtype"]
