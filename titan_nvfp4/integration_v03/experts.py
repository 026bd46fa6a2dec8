"""NVFP4 routed experts for TorchTitan 0.3: every expert GEMM through the core's grouped functions.

``TitanNVFP4GroupedExperts`` (deepseek_v3, qwen3 MoE: w1, w2, w3, SwiGLU) and ``TitanNVFP4GptOssExperts``
(gpt_oss: mlp1/mlp2 with per-expert biases, clamped interleaved SwiGLU) subclass TorchTitan's expert
modules, so parameters, state-dict keys, param_init and the weights' sharding config are TorchTitan's; the
config converter (converter.py) swaps their Config nodes. The NVFP4 buffers (SR counters, RHT signs) get
declared placements (modules.declare_buffers).

The token groups are padded to multiples of 16 inside the module (titan_nvfp4/modules/expert_groups.py), so the
grouped kernels need no host sync and the results equal those of the unpadded groups; TorchTitan's own padding
dispatcher (TorchAOTokenDispatcher) would need torchao. Tensor parallelism of both (TorchTitan's plan: the hidden
dim sharded, x whole, the output a partial sum) all-reduces the sharded operands' per-expert amaxes over the TP
group (the core's AmaxGroups); gpt_oss's rowwise bias is added as b2 / tp on each rank, as TorchTitan does. Under
expert parallelism TorchTitan's token dispatcher hands the module its local experts' tokens and each rank holds
whole experts, so each expert's tensor scales are those of one process: nothing to reduce across ranks.

With ``lora_rank`` (the config's, set by the converter from ``quantize.grouped_mm``) every expert weight keeps a
per-expert rank-r branch beside its NVFP4 residual (the core's lowrank_experts.py, as on 0.2); the split runs in
``init_states`` right after TorchTitan initialized the weights. After the ``bf16_after_fraction`` switch R and the
branch run in the input's dtype (0.2's products), not through TorchTitan's module. Not yet under expert or tensor
parallelism (refused at parallelize, as on 0.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.nn.functional as F
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, ScaleBiasForward
from torchtitan.protocols.module import Module

from ..distributed.amax import AmaxGroups
from ..distributed.tensor_parallel import local, tp_amax_groups
from ..modules.expert_groups import check_expert_dims, experts_body_graphs, pad_token_groups
from ..autograd.clamped_swiglu import clamped_swiglu
from ..autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from ..modules.layer_state import NVFP4LayerState
from ..modules.lowrank_experts import LowRankExperts, check_expert_rank, grouped_linear
from ..numerics.lowrank import check_rank
from ..modules.nvfp4_linear import check_recipe
from ..modules.telemetry import measure_experts
from .modules import REPLICATED, declare_states, nvfp4_config, place_buffers, tp_sharding

SECTION = "quantize.grouped_mm"
RANK_KEY = f"[{SECTION}] lora_rank"


def experts_config(base: type, module: str, owner: str) -> type:
    """nvfp4_config of ``base`` (a TorchTitan expert module's Config) plus ``lora_rank``; the module it builds gets
    its factors' placements declared (replicated: the module refuses expert and tensor parallelism with a rank)."""
    nvfp4 = nvfp4_config(base, module, owner)

    @dataclass(kw_only=True, slots=True)
    class Config(nvfp4):
        lora_rank: int = 0
        """Per-expert low-rank branch of rank r beside each NVFP4 weight (0: none)."""

        def build(self, **kwargs):
            instance = nvfp4.build(self, **kwargs)  # slots=True: no zero-argument super()
            if self.lora_rank:
                declare_states(instance, instance.factor_names(), REPLICATED)
            return instance

    Config.__module__, Config.__qualname__ = module, f"{owner}.Config"
    return Config


class _NVFP4Experts(LowRankExperts, NVFP4LayerState):
    """What both expert modules add to TorchTitan's: ``GEMMS`` names the 3D weights, one SR stream each, and with a
    lora_rank their low-rank factors (module docstring)."""

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        raise NotImplementedError

    def _init_experts(self, config) -> None:
        name = config.name or type(self).__name__
        check_recipe(name, config.recipe)
        weights = {g: getattr(self, g) for g in self.GEMMS}
        check_expert_dims(name, weights, SECTION)
        check_rank(config.lora_rank, SECTION)
        check_expert_rank(name, config.lora_rank, weights, RANK_KEY)
        self.layer_name = config.name
        self._init_nvfp4(config.recipe, config.layer_id, getattr(self, self.GEMMS[0]).device, n_gemms=len(self.GEMMS))
        self._init_lowrank_experts(config.lora_rank)  # split in init_states, once the weights hold values

    def _init_self_parameters(self) -> None:
        """TorchTitan's initialization of the experts' own parameters (param_init); with a rank, of all but the
        factors, then the split of the fresh weights."""
        if not self.lora_rank:
            return Module._init_self_parameters(self)
        factors = set(self.factor_names())
        for name, param in self.named_parameters(recurse=False):
            if name not in factors:
                self._init_param(name, param)
        self.decompose_fresh_()

    def label(self) -> str:
        """The module's name for messages (read only where one is raised, as NVFP4Linear.label)."""
        return getattr(self, "layer_name", "") or type(self).__name__

    #: {weight name: the AmaxGroups of its GEMM} under tensor parallelism of the experts (set at parallelize)
    tp_groups: dict[str, AmaxGroups] = {}
    #: the tensor-parallel degree of the experts (set at parallelize)
    tp_degree = 1
    #: whether expert or tensor parallelism shards the experts (set at parallelize): no eager graphs then
    sharded = False
    def parallelize(self, parallel_dims) -> None:
        """Place the buffers and shard as TorchTitan does (expert parallelism: whole experts per rank, nothing else
        to do); under tensor parallelism (TorchTitan's: every expert's hidden dim sharded,
        W1/W3 along their output features, W2 along its input features) record each GEMM's amax groups from the
        weights' sharding config, so every rank quantizes as the unsharded experts would."""
        if self.lora_rank and (parallel_dims.tp_enabled or parallel_dims.ep_enabled):
            raise NotImplementedError(
                f"{RANK_KEY} = {self.lora_rank}: experts {self.label()!r} are under expert or tensor parallelism, "
                "which the TorchTitan 0.3 integration does not support with a low-rank branch yet; set lora_rank = 0 "
                "or run without expert and tensor parallelism")
        place_buffers(self, parallel_dims)
        self.sharded = bool(parallel_dims.tp_enabled or parallel_dims.ep_enabled)
        if parallel_dims.tp_enabled:
            self.tp_groups = self._expert_tp_groups(parallel_dims)
            self.tp_degree = parallel_dims.tp
        Module.parallelize(self, parallel_dims)

    def _expert_tp_groups(self, parallel_dims) -> dict[str, AmaxGroups]:
        out = {}
        group = parallel_dims.get_dense_tp_mesh().get_group()
        for g in self.GEMMS:
            tp = tp_sharding(self, g)
            if tp is None:
                continue
            dim = tp.dim % 3 if isinstance(tp, spmd.Shard) else None
            if dim not in (1, 2):
                raise NotImplementedError(f"NVFP4 experts {self.label()}: weight {g} TP layout {tp} shards neither "
                                          "feature dim")
            shape = list(getattr(self, g).shape)
            shape[dim] //= parallel_dims.tp
            check_expert_dims(f"{self.label()} (local shard under tensor parallelism)", {g: shape}, SECTION)
            out[g] = tp_amax_groups(dim - 1, group)  # dim 1: output features (colwise), 2: input (rowwise)
        return out

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        self._reset_nvfp4_buffers()  # a fresh SR stream per GEMM and the RHT signs at init_weights

    def _measured(self) -> bool:
        """Whether telemetry (``telemetry_every``) measures this step."""
        return self.telemetry is not None and self.telemetry.active

    def _measure(self, x: torch.Tensor, gemms: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Telemetry of the grouped GEMMs that read ``x``: {weight name: (local weight, output)} (not of TP shards)."""
        if self._measured() and not self.tp_groups:
            for name, (w, y) in gemms.items():
                measure_experts(self, name, x, w, y)

    def _products(self, x: torch.Tensor, gemms: dict[str, torch.Tensor], offsets: torch.Tensor, biases, counters,
                  x_amax: torch.Tensor | None = None) -> list[torch.Tensor]:
        """x times each weight of ``gemms`` ({name: local weight}; x quantized once, sharded alike under TP): NVFP4
        grouped GEMMs (measured when telemetry asks), or after the ``bf16_after_fraction`` switch the same products
        in the input's dtype. ``x_amax``: x's per-expert amaxes from the kernel that produced it."""
        weights = list(gemms.values())
        if self.high_precision:
            return [grouped_linear(x, w, offsets, b) for w, b in zip(weights, biases)]
        ys = nvfp4_grouped_mm_shared(x, weights, offsets, biases, self.recipe, counters, local(self.rht_signs), True,
                                     self.tp_groups.get(next(iter(gemms))), x_amax,
                                     graphs=self._graphs(next(iter(gemms)), x, weights))
        self._measure(x, {g: (w, y) for (g, w), y in zip(gemms.items(), ys)})
        return ys

    def _graphs(self, call: str, x: torch.Tensor, weights):
        """The BodyGraphs of grouped GEMM ``call`` under eager_graphs (expert_groups.experts_body_graphs): none under
        expert or tensor parallelism (``sharded``, set at parallelize)."""
        return experts_body_graphs(self, call, x, weights, self.sharded)

    def _high_precision(self, upstream: type, x_RD: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """After the ``bf16_after_fraction`` switch: TorchTitan's own expert computation (its grouped GEMMs in the
        input's dtype) on the token groups padded to multiples of 16, as the NVFP4 path runs them."""
        p = pad_token_groups(x_RD, counts)
        return upstream.forward(self, p.x, p.counts)[p.rows].type_as(x_RD)

    def _weights(self) -> list[torch.Tensor]:
        return [local(getattr(self, g)) for g in self.GEMMS]


class TitanNVFP4GroupedExperts(_NVFP4Experts, GroupedExperts):
    """GroupedExperts with out = (silu(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ, each product an NVFP4 grouped GEMM (W1 and W3 on one
    quantization of x, the SwiGLU fused with h's amaxes on the grouped kernels: nvfp4_grouped_swiglu)."""

    GEMMS = ("w1_EFD", "w2_EDF", "w3_EFD")

    Config = experts_config(GroupedExperts.Config, __module__, __qualname__)

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        E, F, D = config.num_experts, config.hidden_dim, config.dim
        return {"w1_EFD": (E, F, D), "w2_EDF": (E, D, F), "w3_EFD": (E, F, D)}

    def __init__(self, config: Config):
        GroupedExperts.__init__(self, config)
        self._init_experts(config)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if self.high_precision and not self.lora_rank:
            return self._high_precision(GroupedExperts, x_RD, num_tokens_per_expert_E)
        if self.lora_rank:
            self._check_decomposed()
        w1, w2, w3 = self._weights()
        p = pad_token_groups(x_RD, num_tokens_per_expert_E)
        offsets = torch.cumsum(p.counts, dim=0, dtype=torch.int32)
        c = local(self.sr_counter)
        if self.high_precision or self.lora_rank or self._measured():  # x W1ᵀ and x W3ᵀ apart: the unfused SwiGLU
            h1, h3 = self._products(p.x, {"w1_EFD": w1, "w3_EFD": w3}, offsets, (None, None), (c[0], c[2]))
            h = F.silu(self._lowrank_add(h1, "w1_EFD", p.x, offsets)) * self._lowrank_add(h3, "w3_EFD", p.x, offsets)
            h_amax = None
        else:
            h, h_amax = nvfp4_grouped_swiglu(p.x, w1, w3, offsets, self.recipe, (c[0], c[2]), local(self.rht_signs),
                                             True, self.tp_groups.get("w1_EFD"),
                                             h_colwise=torch.is_grad_enabled() and w2.requires_grad,
                                             graphs=self._graphs("w1_EFD", p.x, (w1, w3)))
        (y,) = self._products(h, {"w2_EDF": w2}, offsets, (None,), (c[1],), h_amax)
        return self._lowrank_add(y, "w2_EDF", h, offsets)[p.rows].type_as(x_RD)


class TitanNVFP4GptOssExperts(_NVFP4Experts, GptOssGroupedExperts):
    """GptOssGroupedExperts with both expert GEMMs, their per-expert biases included, in NVFP4."""

    GEMMS = ("mlp1_weight_EGD", "mlp2_weight_EDF")

    Config = experts_config(GptOssGroupedExperts.Config, __module__, __qualname__)

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        E, F, D = config.num_experts, config.hidden_dim, config.dim
        return {"mlp1_weight_EGD": (E, 2 * F, D), "mlp2_weight_EDF": (E, D, F)}

    def __init__(self, config: Config):
        GptOssGroupedExperts.__init__(self, config)
        self._init_experts(config)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if self.high_precision and not self.lora_rank:
            return self._high_precision(GptOssGroupedExperts, x_RD, num_tokens_per_expert_E)
        if self.lora_rank:
            self._check_decomposed()
        w1, w2 = self._weights()
        b1, b2 = local(self.mlp1_bias_EG), local(self.mlp2_bias_ED)
        p = pad_token_groups(x_RD, num_tokens_per_expert_E)
        offsets = torch.cumsum(p.counts, dim=0, dtype=torch.int32)
        c = local(self.sr_counter)
        (h,) = self._products(p.x, {"mlp1_weight_EGD": w1}, offsets, (b1,), (c[0],))
        h = self._lowrank_add(h, "mlp1_weight_EGD", p.x, offsets)
        # the padding rows hold swiglu(b1): zero them, so they stay out of h's amaxes as the unpadded groups
        h = clamped_swiglu(h, limit=self.swiglu_limit, addcmul=True) * p.valid(h.dtype)
        if self.tp_degree > 1:  # rowwise mlp2: each rank adds b2 / tp to its partial sum, its gradient unscaled (as
            b2 = ScaleBiasForward.apply(b2, self.tp_degree, b2.dtype)  # TorchTitan's own gpt_oss experts)
        (y,) = self._products(h, {"mlp2_weight_EDF": w2}, offsets, (b2,), (c[1],))
        return self._lowrank_add(y, "mlp2_weight_EDF", h, offsets)[p.rows].type_as(x_RD)


#: TorchTitan's expert module classes and their NVFP4 versions
EXPERT_CLASSES: dict[type, type] = {GroupedExperts: TitanNVFP4GroupedExperts,
                                    GptOssGroupedExperts: TitanNVFP4GptOssExperts}
