"""DecomposedLinear as a TorchTitan 0.3 Module (the `lora_rank` knob of `quantize.linear`).

0.3 initializes a model through ``init_states``: each Module initializes its own parameters from its config's
``param_init`` once its children are done. So the split W = U·diag(σ)·V + R runs there, right after the weight
is initialized (0.2 hooks the model's init_weights instead); a checkpoint load brings U, σ, V and R back as on
0.2 (decomposed_linear.py's state dict). The factors are parameters of the module, trained with the rest. Under
tensor parallelism they follow the weight the way TorchTitan's own LoRA adapters do: U is sharded like a colwise W
(its output rows), V like a rowwise W (its input columns), the other factors are whole on every rank (their
gradients are partial sums there, reduced with the other replicated parameters'), so the branch runs on local
tensors without a collective of its own.
"""

from dataclasses import dataclass, replace

import spmd_types as spmd
from torchtitan.distributed.parallel_dims import MeshAxisName

from ..modules.decomposed_linear import FACTOR_KINDS, DecomposedLinear, check_lowrank_args
from .modules import REPLICATED, TitanNVFP4Linear, declare_states, tp_sharding

FACTORS = tuple(f"lora_{k}" for k in FACTOR_KINDS)  # DecomposedLinear's U, σ, V
SECTION = "quantize.linear"


class TitanDecomposedLinear(DecomposedLinear, TitanNVFP4Linear):
    """TitanNVFP4Linear on the residual R plus DecomposedLinear's rank-r branch (same parameters and state-dict
    keys as DecomposedLinear)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanNVFP4Linear.Config):
        lora_rank: int = 16
        """The branch's rank r (a positive multiple of 16, at most the weight's smaller dim)."""
        lora_nvfp4: bool = False
        """Run the branch's two GEMMs in NVFP4 too."""

        def build(self, **kwargs):
            instance = TitanNVFP4Linear.Config.build(self, **kwargs)  # slots=True: no zero-argument super()
            tp = tp_sharding(instance, "weight")
            if tp is None:
                declare_states(instance, FACTORS, REPLICATED)
                return instance
            weight = instance._sharding_config.state_shardings["weight"]
            whole = replace(weight, axis_types={**weight.axis_types, MeshAxisName.TP: spmd.R})
            sharded = "lora_u" if tp.dim % 2 == 0 else "lora_v"  # the factor holding W's sharded dim
            for name in FACTORS:
                declare_states(instance, (name,), weight if name == sharded else whole)
            return instance

    def __init__(self, config: Config):
        TitanNVFP4Linear.__init__(self, config)
        check_lowrank_args(config.name, config.lora_rank, config.in_features, config.out_features, config.lora_nvfp4,
                           f"[{SECTION}] lora_rank")
        self._init_lowrank(config.lora_rank, config.lora_nvfp4, config.layer_id)
        if not self.weight.is_meta:
            self.decompose_()

    def forward(self, input):  # noqa: A002
        """DecomposedLinear.forward under Linear's argument name (TitanNVFP4Linear.forward says why)."""
        return DecomposedLinear.forward(self, input)

    def _init_self_parameters(self) -> None:
        """TorchTitan's initialization of ``weight`` and ``bias`` (param_init, else nn.Linear's reset_parameters),
        then the split of the fresh W into the branch and R."""
        if self._param_init is None:
            self.reset_parameters()
        else:
            for name in ("weight", "bias"):
                if getattr(self, name) is not None:
                    self._init_param(name, getattr(self, name))
        self.decompose_fresh_()

    def parallelize(self, parallel_dims) -> None:
        """TitanNVFP4Linear's parallelize. An NVFP4 branch (lora_nvfp4) under tensor parallelism is refused by name:
        on spmd_types's local shards its GEMMs would quantize partial sums, and on the DTensor backends its
        gradients were measured 1% away from one process's (the branch in high precision matches)."""
        if parallel_dims.tp_enabled and self.lora_nvfp4 and tp_sharding(self, "weight") is not None:
            raise NotImplementedError(
                f"[{SECTION}] lora_nvfp4 = true: Linear {self.label()!r} is tensor-parallel, which the TorchTitan 0.3 "
                "integration does not support for an NVFP4 branch yet; set lora_nvfp4 = false (the branch in the "
                "input's dtype) or run without tensor parallelism")
        TitanNVFP4Linear.parallelize(self, parallel_dims)
