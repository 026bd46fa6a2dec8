"""NVFP4 routed experts for TorchTitan 0.3: every expert GEMM through the core's grouped functions.

``TitanNVFP4GroupedExperts`` (deepseek_v3, qwen3 MoE: w1, w2, w3, SwiGLU) and ``TitanNVFP4GptOssExperts``
(gpt_oss: mlp1/mlp2 with per-expert biases, clamped interleaved SwiGLU) subclass TorchTitan's expert
modules, so parameters, state-dict keys, param_init and the weights' sharding config are TorchTitan's; the
config converter (converter.py) swaps their Config nodes. The NVFP4 buffers (SR counters, RHT signs) get
declared placements (modules.declare_buffers).

The token groups are padded to multiples of 16 inside the module (titan_nvfp4/expert_groups.py), so the
grouped kernels need no host sync and the results equal those of the unpadded groups; TorchTitan's own padding
dispatcher (TorchAOTokenDispatcher) would need torchao. Expert parallelism and tensor parallelism of the
experts are refused at parallelize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu
from torchtitan.protocols.module import Module

from ..distributed.tensor_parallel import local
from ..expert_groups import check_expert_dims, pad_token_groups
from ..grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from ..layer_state import NVFP4LayerState
from ..nvfp4_linear import check_recipe
from ..recipe import NVFP4Recipe
from .modules import declare_buffers

SECTION = "quantize.grouped_mm"


class _NVFP4Experts(NVFP4LayerState):
    """What both expert modules add to TorchTitan's: ``GEMMS`` names the 3D weights, one SR stream each."""

    GEMMS: tuple[str, ...] = ()

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        raise NotImplementedError

    def _init_experts(self, config) -> None:
        name = config.name or type(self).__name__
        check_recipe(name, config.recipe)
        check_expert_dims(name, {g: getattr(self, g) for g in self.GEMMS}, SECTION)
        self.layer_name = config.name
        self._init_nvfp4(config.recipe, config.layer_id, getattr(self, self.GEMMS[0]).device, n_gemms=len(self.GEMMS))

    def label(self) -> str:
        """The module's name for messages (read only where one is raised, as NVFP4Linear.label)."""
        return getattr(self, "layer_name", "") or type(self).__name__

    def parallelize(self, parallel_dims) -> None:
        """Refuse expert and tensor parallelism, which this integration does not support yet."""
        if parallel_dims.ep_enabled:
            raise NotImplementedError(f"NVFP4 experts {self.label()}: expert parallelism is not supported by the "
                                      "TorchTitan 0.3 integration yet (issue 44); set "
                                      "parallelism.expert_parallel_degree = 1")
        if parallel_dims.tp_enabled:
            raise NotImplementedError(f"NVFP4 experts {self.label()}: tensor parallelism is not supported by the "
                                      "TorchTitan 0.3 integration yet (issue 44); set "
                                      "parallelism.tensor_parallel_degree = 1")
        Module.parallelize(self, parallel_dims)

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        self._reset_nvfp4_buffers()  # a fresh SR stream per GEMM and the RHT signs at init_weights

    def _weights(self) -> list[torch.Tensor]:
        return [local(getattr(self, g)) for g in self.GEMMS]


class TitanNVFP4GroupedExperts(_NVFP4Experts, GroupedExperts):
    """GroupedExperts with out = (silu(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ, each product an NVFP4 grouped GEMM (W1 and W3 on one
    quantization of x, the SwiGLU fused with h's amaxes on the grouped kernels: nvfp4_grouped_swiglu)."""

    GEMMS = ("w1_EFD", "w2_EDF", "w3_EFD")

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
        """The module's NVFP4 recipe."""
        layer_id: int = 0
        """Seeds the SR streams of its GEMMs (layer_id + 0, 1, 2 for W1, W2, W3)."""
        name: str = ""
        """The module's fqn, for messages."""

        def build(self, **kwargs):
            instance = GroupedExperts.Config.build(self, **kwargs)  # slots=True: no zero-argument super()
            declare_buffers(instance)
            return instance

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        E, F, D = config.num_experts, config.hidden_dim, config.dim
        return {"w1_EFD": (E, F, D), "w2_EDF": (E, D, F), "w3_EFD": (E, F, D)}

    def __init__(self, config: Config):
        GroupedExperts.__init__(self, config)
        self._init_experts(config)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._weights()
        p = pad_token_groups(x_RD, num_tokens_per_expert_E)
        offsets = torch.cumsum(p.counts, dim=0, dtype=torch.int32)
        c, signs = local(self.sr_counter), local(self.rht_signs)
        h, h_amax = nvfp4_grouped_swiglu(p.x, w1, w3, offsets, self.recipe, (c[0], c[2]), signs, True,
                                         h_colwise=torch.is_grad_enabled() and w2.requires_grad)
        (y,) = nvfp4_grouped_mm_shared(h, (w2,), offsets, (None,), self.recipe, (c[1],), signs, True, None, h_amax)
        return y[p.rows].type_as(x_RD)


class TitanNVFP4GptOssExperts(_NVFP4Experts, GptOssGroupedExperts):
    """GptOssGroupedExperts with both expert GEMMs, their per-expert biases included, in NVFP4."""

    GEMMS = ("mlp1_weight_EGD", "mlp2_weight_EDF")

    @dataclass(kw_only=True, slots=True)
    class Config(GptOssGroupedExperts.Config):
        recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
        """The module's NVFP4 recipe."""
        layer_id: int = 0
        """Seeds the SR streams of its GEMMs (layer_id + 0, 1 for mlp1, mlp2)."""
        name: str = ""
        """The module's fqn, for messages."""

        def build(self, **kwargs):
            instance = GptOssGroupedExperts.Config.build(self, **kwargs)
            declare_buffers(instance)
            return instance

    @staticmethod
    def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
        E, F, D = config.num_experts, config.hidden_dim, config.dim
        return {"mlp1_weight_EGD": (E, 2 * F, D), "mlp2_weight_EDF": (E, D, F)}

    def __init__(self, config: Config):
        GptOssGroupedExperts.__init__(self, config)
        self._init_experts(config)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2 = self._weights()
        b1, b2 = local(self.mlp1_bias_EG), local(self.mlp2_bias_ED)
        p = pad_token_groups(x_RD, num_tokens_per_expert_E)
        offsets = torch.cumsum(p.counts, dim=0, dtype=torch.int32)
        c, signs = local(self.sr_counter), local(self.rht_signs)
        (h,) = nvfp4_grouped_mm_shared(p.x, (w1,), offsets, (b1,), self.recipe, (c[0],), signs, True)
        # the padding rows hold swiglu(b1): zero them, so they stay out of h's amaxes as the unpadded groups
        h = swiglu(h, limit=self.swiglu_limit) * p.valid(h.dtype)
        (y,) = nvfp4_grouped_mm_shared(h, (w2,), offsets, (b2,), self.recipe, (c[1],), signs, True)
        return y[p.rows].type_as(x_RD)


#: TorchTitan's expert module classes and their NVFP4 versions
EXPERT_CLASSES: dict[type, type] = {GroupedExperts: TitanNVFP4GroupedExperts,
                                    GptOssGroupedExperts: TitanNVFP4GptOssExperts}
