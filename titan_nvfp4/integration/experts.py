"""NVFP4 versions of TorchTitan's routed-expert modules: every expert GEMM through nvfp4_grouped_mm.

``NVFP4GroupedExperts`` (deepseek_v3, llama4, qwen3: w1, w2, w3, SwiGLU) and ``NVFP4GptOssExperts``
(gpt-oss: mlp1/mlp2 with biases, clamped interleaved SwiGLU) subclass TorchTitan's classes and keep
their parameters, so state_dict keys, init_weights and TorchTitan's expert-parallel sharding (which
looks at these parameters) are unchanged. Conversion swaps the class of the meta-device module in
place and adds the NVFP4 buffers (layer_state.py). Both always take the grouped path (TorchTitan's
``use_grouped_mm = false`` for-loop is a BF16 debugging aid). Token groups are padded to TorchTitan's
token-group alignment outside expert parallelism, as TorchTitan's own grouped path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts, ScaleBiasForward, swiglu
from torchtitan.models.gpt_oss.model.moe import indices_padding_wrapper as gpt_oss_padding_wrapper
from torchtitan.models.moe import utils as moe_utils
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import indices_padding_wrapper

from ..grouped_function import nvfp4_grouped_mm, nvfp4_grouped_mm_shared
from ..layer_state import NVFP4LayerState
from ..recipe import NVFP4Recipe


def check_expert_dims(name: str, weights: dict[str, torch.Tensor]) -> None:
    """Both dims of every expert weight must be multiples of 16 (NVFP4 blocks): else name them."""
    bad = [f"{k} {tuple(w.shape)}" for k, w in weights.items() if w.shape[-1] % 16 or w.shape[-2] % 16]
    if bad:
        raise ValueError(f"cannot convert experts {name!r} to NVFP4: {', '.join(bad)} has a dim that is not a "
                         "multiple of 16 (exclude it from [quantize.grouped_mm.nvfp4] fqns)")


def groups_aligned() -> bool:
    """Whether TorchTitan pads every token group to a multiple of 16 (the converter sets it): then the
    grouped kernels run without looking at the offsets on the host."""
    return moe_utils.TOKEN_GROUP_ALIGN_SIZE_M % 16 == 0


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _expert_parallel(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


class _NVFP4Experts(NVFP4LayerState):
    """Conversion shared by the expert modules: ``GEMMS`` names the 3D weights, one SR stream each."""

    GEMMS: tuple[str, ...] = ()

    @classmethod
    def convert(cls, mod, recipe: NVFP4Recipe, layer_id: int, name: str = ""):
        """Swap ``mod``'s class for ``cls`` in place (its parameters stay) and add the NVFP4 buffers."""
        weights = {g: getattr(mod, g) for g in cls.GEMMS}
        check_expert_dims(name, weights)
        mod.__class__ = cls
        mod._init_nvfp4(recipe, layer_id, weights[cls.GEMMS[0]].device, n_gemms=len(cls.GEMMS))
        return mod


class NVFP4GroupedExperts(_NVFP4Experts, GroupedExperts):
    """GroupedExperts with out = (silu(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ, each product an NVFP4 grouped GEMM."""

    GEMMS = ("w1", "w2", "w3")

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        run = self._run if _expert_parallel(self.w1) else indices_padding_wrapper(self._run)
        return run(_local(self.w1), _local(self.w2), _local(self.w3), x, num_tokens_per_expert)

    def _run(self, w1, w2, w3, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        c, r, s, a = self.sr_counter, self.recipe, self.rht_signs, groups_aligned()
        # W1 and W3 read the same tokens: quantized once for both
        h1, h3 = nvfp4_grouped_mm_shared(x, (w1, w3), offsets, (None, None), r, (c[0], c[2]), s, a)
        return nvfp4_grouped_mm(F.silu(h1) * h3, w2, offsets, None, r, c[1], s, a)


class NVFP4GptOssExperts(_NVFP4Experts, GptOssGroupedExperts):
    """GptOssGroupedExperts with both expert GEMMs (and their per-expert biases) in NVFP4."""

    GEMMS = ("mlp1_weight", "mlp2_weight")

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        tp_degree = 1
        if isinstance(self.mlp1_weight, DTensor) and "tp" in (self.mlp1_weight.device_mesh.mesh_dim_names or ()):
            mesh = self.mlp1_weight.device_mesh
            tp_degree = mesh.size(mesh.mesh_dim_names.index("tp"))
        run = self._run if _expert_parallel(self.mlp1_weight) else gpt_oss_padding_wrapper(self._run)
        return run(_local(self.mlp1_weight), _local(self.mlp1_bias), _local(self.mlp2_weight),
                   _local(self.mlp2_bias), self.swiglu_limit, x, num_tokens_per_expert, tp_degree)

    def _run(self, mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, swiglu_limit, x, num_tokens_per_expert,
             tp_degree=1):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        c, r, s, a = self.sr_counter, self.recipe, self.rht_signs, groups_aligned()
        h = nvfp4_grouped_mm(x, mlp1_weight, offsets, mlp1_bias, r, c[0], s, a)
        h = swiglu(h, limit=swiglu_limit)
        # as TorchTitan: under TP the bias is divided by the TP degree in forward only
        b2 = ScaleBiasForward.apply(mlp2_bias, tp_degree)
        return nvfp4_grouped_mm(h, mlp2_weight, offsets, b2, r, c[1], s, a)


EXPERT_CLASSES: dict[type, type] = {GroupedExperts: NVFP4GroupedExperts, GptOssGroupedExperts: NVFP4GptOssExperts}
