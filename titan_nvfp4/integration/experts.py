"""NVFP4 versions of TorchTitan's routed-expert modules: every expert GEMM through nvfp4_grouped_mm.

``NVFP4GroupedExperts`` (deepseek_v3, llama4, qwen3: w1, w2, w3, SwiGLU) and ``NVFP4GptOssExperts``
(gpt-oss: mlp1/mlp2 with biases, clamped interleaved SwiGLU) subclass TorchTitan's classes and keep
their parameters, so state_dict keys, init_weights and TorchTitan's expert-parallel sharding (which
looks at these parameters) are unchanged. Conversion swaps the class of the meta-device module in
place and adds the NVFP4 buffers (layer_state.py). Both always take the grouped path (TorchTitan's
``use_grouped_mm = false`` for-loop is a BF16 debugging aid). Token groups are padded to TorchTitan's
token-group alignment outside expert parallelism, as TorchTitan's own grouped path does.

Under expert parallelism a rank holds whole experts. Under TorchTitan's expert tensor parallelism (TP
without EP, or ETP) an expert's weight is split along a feature dim: the per-expert tensor amaxes of
every sharded operand are then all-reduced over the TP group (``_tp_groups``), so each rank quantizes
the exact slices of the unsharded operands.

With ``lora_rank`` r (``[quantize.grouped_mm.nvfp4]``) every expert weight keeps a per-expert rank-r branch
beside its NVFP4 residual (the core's lowrank_experts.py, shared with the TorchTitan 0.3 experts); the split runs
after TorchTitan's init_weights, as for DecomposedLinear. Not yet under expert or tensor parallelism (the factors
would need the weights' sharding).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts, ScaleBiasForward
from torchtitan.models.gpt_oss.model.moe import indices_padding_wrapper as gpt_oss_padding_wrapper
from torchtitan.models.moe import utils as moe_utils
from torchtitan.models.gpt_oss.model import moe as gpt_oss_moe
from torchtitan.models.moe import moe as moe_module
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import indices_padding_wrapper

from ..distributed.amax import AmaxGroups
from ..distributed.tensor_parallel import local
from ..modules.expert_groups import check_expert_dims, experts_body_graphs
from ..autograd.clamped_swiglu import clamped_swiglu
from ..autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from ..modules.layer_state import NVFP4LayerState
from ..modules.lowrank_experts import LowRankExperts, check_expert_rank, grouped_linear
from ..numerics.lowrank import check_rank
from ..modules.nvfp4_linear import check_recipe
from ..ops import resolve_backend
from ..recipe.nvfp4_recipe import NVFP4Recipe
from ..modules.telemetry import measure_experts


def groups_aligned() -> bool:
    """Whether TorchTitan pads every token group to a multiple of 16 (the converter sets it): then the
    grouped kernels run without looking at the offsets on the host."""
    return moe_utils.TOKEN_GROUP_ALIGN_SIZE_M % 16 == 0


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _expert_parallel(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


class _NVFP4Experts(LowRankExperts, NVFP4LayerState):
    """Conversion shared by the expert modules: ``GEMMS`` names the 3D weights, one SR stream each;
    with a rank, each weight also gets its low-rank factors (module docstring)."""

    @classmethod
    def convert(cls, mod, recipe: NVFP4Recipe, layer_id: int, name: str = "", lora_rank: int = 0):
        """Swap ``mod``'s class for ``cls`` in place (its parameters stay) and add the NVFP4 buffers (and,
        with ``lora_rank``, the factors, allocated like the weights: on meta for a meta module)."""
        check_recipe(name or cls.__name__, recipe)
        weights = {g: getattr(mod, g) for g in cls.GEMMS}
        check_expert_dims(name, weights)
        check_rank(lora_rank, "quantize.grouped_mm.nvfp4")
        check_expert_rank(name, lora_rank, weights)
        mod.__class__ = cls
        mod.layer_name = name
        device = weights[cls.GEMMS[0]].device
        mod._init_nvfp4(recipe, layer_id, device, n_gemms=len(cls.GEMMS))
        mod._init_lowrank_experts(lora_rank)
        if lora_rank and device.type != "meta":
            mod.decompose_()
        return mod

    #: TorchTitan's compile backend when ``[compile]`` compiles the model (the converter sets it), else None
    compile_backend: str | None = None
    #: (module, name) of the function BF16's expert module runs its GEMMs through
    BF16_GEMMS: tuple = (moe_module, "_run_experts_grouped_mm")

    def _body(self, x: torch.Tensor):
        """The module's ``_run``, compiled as TorchTitan compiles BF16's expert GEMMs: its apply_compile compiles the
        function BF16's experts run them through (BF16_GEMMS), never the experts module. So when that function is
        compiled and ``compile_backend`` set, so is the NVFP4 body where it traces whole (_traceable; fullgraph;
        under expert parallelism the routed token count marked dynamic, as TorchTitan marks it); else it runs
        eagerly, as BF16's would."""
        if self.compile_backend is None or torch.compiler.is_compiling() or not self._traceable(x):
            return self._run
        bf16 = getattr(*self.BF16_GEMMS, None)
        if not (hasattr(bf16, "_torchdynamo_orig_callable") or "_dynamic" in getattr(bf16, "__qualname__", "")):
            return self._run
        if _expert_parallel(getattr(self, self.GEMMS[0])):
            torch._dynamo.mark_dynamic(x, 0)
        compiled = self.__dict__.get("_compiled_run")
        if compiled is None:
            compiled = self._compiled_run = torch.compile(self._run, backend=self.compile_backend, fullgraph=True)
        return compiled

    def _gemms(self, x: torch.Tensor, weights, offsets: torch.Tensor, biases, counters,
               names: tuple[str, ...], groups: AmaxGroups | None = None,
               x_amax: torch.Tensor | None = None) -> list[torch.Tensor]:
        """x times each of ``weights`` (named ``names``; x quantized once): NVFP4 grouped GEMMs, or after
        the ``bf16_after_fraction`` switch the same products in the input's dtype. ``groups``: the ranks
        sharding the experts' features (tensor parallelism: _tp_groups); ``x_amax``: x's per-expert
        amaxes from the kernel that produced it (nvfp4_grouped_swiglu)."""
        if self.high_precision:
            return [grouped_linear(x, w, offsets, b) for w, b in zip(weights, biases)]
        ys = nvfp4_grouped_mm_shared(x, weights, offsets, biases, self.recipe, counters, local(self.rht_signs),
                                     groups_aligned(), groups, x_amax, graphs=self._graphs(names[0], x, weights))
        if self.telemetry is not None:
            for name, w, y in zip(names, weights, ys):
                measure_experts(self, name, x, w, y)
        return ys

    def _traceable(self, x: torch.Tensor) -> bool:
        """Whether the body traces whole (fullgraph): the grouped kernels' path, whose offsets stay on the device
        (the emulated backend, aligned groups), without the low-rank branch or telemetry and before a bf16_after_fraction
        switch (then eager, as before). The per-expert loop of the other backends reads the offsets on the host."""
        return (resolve_backend(self.recipe.gemm_backend, x.device) == "emulated" and groups_aligned()
                and not (self.lora_rank or self.high_precision) and self.telemetry is None)

    def _graphs(self, call: str, x: torch.Tensor, weights):
        """The BodyGraphs of grouped GEMM ``call`` under eager_graphs (expert_groups.experts_body_graphs): none when
        the weights are DTensors (expert or tensor parallelism)."""
        return experts_body_graphs(self, call, x, weights, isinstance(getattr(self, self.GEMMS[0]), DTensor))

    def _tp_groups(self) -> dict[str, AmaxGroups | None]:
        """{weight name: the AmaxGroups of its GEMM} under tensor parallelism of the experts (TorchTitan's
        TP without EP, or ETP), None per weight otherwise. Expert parallelism (dim 0) keeps every expert
        whole; a weight sharded along its output features (Shard(1): W1, W3, gpt-oss mlp1) needs W's and
        dY's per-expert amaxes over the TP group, one sharded along its input features (Shard(2): W2,
        mlp2) X's and W's, so every rank quantizes as the unsharded experts would."""
        out: dict[str, AmaxGroups | None] = {}
        for g in self.GEMMS:
            w = getattr(self, g)
            out[g] = None
            if not isinstance(w, DTensor):
                continue
            split = [(i, p.dim) for i, p in enumerate(w.placements) if isinstance(p, Shard) and p.dim != 0]
            other = [p for p in w.placements if not isinstance(p, (Shard, Replicate))]
            if other or len(split) > 1:
                raise NotImplementedError(f"NVFP4 experts {getattr(self, 'layer_name', '')!r}: weight {g} placements "
                                          f"{w.placements} are not "
                                          "supported (expert parallelism on dim 0, tensor parallelism on one "
                                          "feature dim)")
            if not split:
                continue
            label = lambda: f"{getattr(self, 'layer_name', '')} (local shard under tensor parallelism)"  # noqa: E731
            check_expert_dims(label, {g: w.to_local()})
            group = w.device_mesh.get_group(split[0][0])
            out[g] = AmaxGroups(weight=group, grad=group) if split[0][1] == 1 else AmaxGroups(x=group, weight=group)
        return out

    def _check_lowrank_parallelism(self, sharded: bool) -> None:
        if self.lora_rank:
            self._check_decomposed()
            if sharded:
                raise NotImplementedError("lora_rank on experts under expert or tensor parallelism is not supported "
                                          "yet: set [quantize.grouped_mm.nvfp4] lora_rank = 0 for this run")


class NVFP4GroupedExperts(_NVFP4Experts, GroupedExperts):
    """GroupedExperts with out = (silu(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ, each product an NVFP4 grouped GEMM. Without
    a low-rank branch or telemetry (which need h1, h3) the SwiGLU runs fused with the amaxes of h and,
    in backward, of dh1, dh3 (nvfp4_grouped_swiglu): three amax passes fewer."""

    GEMMS = ("w1", "w2", "w3")

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = self._tp_groups()
        self._check_lowrank_parallelism(isinstance(self.w1, DTensor))
        run = functools.partial(self._body(x), groups=groups)
        run = run if _expert_parallel(self.w1) else indices_padding_wrapper(run)
        return run(_local(self.w1), _local(self.w2), _local(self.w3), x, num_tokens_per_expert)

    def _run(self, w1, w2, w3, x, num_tokens_per_expert, groups=None):
        groups = groups or {}
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        c = local(self.sr_counter)  # a replicated DTensor under expert parallelism
        if not (self.high_precision or self.lora_rank or self.telemetry is not None):
            # W1 and W3 on one quantization of x, the SwiGLU fused with the amaxes of h (W2's input)
            h, h_amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, self.recipe, (c[0], c[2]), local(self.rht_signs),
                                             groups_aligned(), groups.get("w1"),
                                             h_colwise=torch.is_grad_enabled() and w2.requires_grad,
                                             graphs=self._graphs("w1", x, (w1, w3)))
            return self._gemms(h, (w2,), offsets, (None,), (c[1],), ("w2",), groups.get("w2"), h_amax)[0]
        # W1 and W3 read the same tokens: quantized once for both (and sharded alike under TP)
        h1, h3 = self._gemms(x, (w1, w3), offsets, (None, None), (c[0], c[2]), ("w1", "w3"), groups.get("w1"))
        h = F.silu(self._lowrank_add(h1, "w1", x, offsets)) * self._lowrank_add(h3, "w3", x, offsets)
        (y,) = self._gemms(h, (w2,), offsets, (None,), (c[1],), ("w2",), groups.get("w2"))
        return self._lowrank_add(y, "w2", h, offsets)


class NVFP4GptOssExperts(_NVFP4Experts, GptOssGroupedExperts):
    """GptOssGroupedExperts with both expert GEMMs (and their per-expert biases) in NVFP4."""

    GEMMS = ("mlp1_weight", "mlp2_weight")
    BF16_GEMMS = (gpt_oss_moe, "_run_experts_grouped_mm")  # TorchTitan 0.2.2 compiles no gpt_oss block

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        tp_degree = 1
        if isinstance(self.mlp1_weight, DTensor) and "tp" in (self.mlp1_weight.device_mesh.mesh_dim_names or ()):
            mesh = self.mlp1_weight.device_mesh
            tp_degree = mesh.size(mesh.mesh_dim_names.index("tp"))
        groups = self._tp_groups()
        self._check_lowrank_parallelism(isinstance(self.mlp1_weight, DTensor))
        run = functools.partial(self._body(x), groups=groups)
        run = run if _expert_parallel(self.mlp1_weight) else gpt_oss_padding_wrapper(run)
        return run(_local(self.mlp1_weight), _local(self.mlp1_bias), _local(self.mlp2_weight),
                   _local(self.mlp2_bias), self.swiglu_limit, x, num_tokens_per_expert, tp_degree)

    def _run(self, mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, swiglu_limit, x, num_tokens_per_expert,
             tp_degree=1, groups=None):
        groups = groups or {}
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        c = local(self.sr_counter)  # a replicated DTensor under expert parallelism
        (h,) = self._gemms(x, (mlp1_weight,), offsets, (mlp1_bias,), (c[0],), ("mlp1_weight",),
                           groups.get("mlp1_weight"))
        h = clamped_swiglu(self._lowrank_add(h, "mlp1_weight", x, offsets), limit=swiglu_limit)
        # as TorchTitan: under TP the bias is divided by the TP degree in forward only
        b2 = ScaleBiasForward.apply(mlp2_bias, tp_degree)
        (y,) = self._gemms(h, (mlp2_weight,), offsets, (b2,), (c[1],), ("mlp2_weight",), groups.get("mlp2_weight"))
        return self._lowrank_add(y, "mlp2_weight", h, offsets)


EXPERT_CLASSES: dict[type, type] = {GroupedExperts: NVFP4GroupedExperts, GptOssGroupedExperts: NVFP4GptOssExperts}
