"""NVFP4Linear as a TorchTitan 0.3 Module: built from a Linear.Config-like config, with a declared placement for
each of its buffers (0.3 refuses undeclared states on a module that has a sharding config)."""

from dataclasses import dataclass, field, replace

import spmd_types as spmd
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import SpmdLayout

from ..modules.nvfp4_linear import NVFP4Linear
from ..recipe.nvfp4_recipe import NVFP4Recipe

_AXES = (MeshAxisName.DP, MeshAxisName.CP, MeshAxisName.TP)
PER_RANK = SpmdLayout({a: spmd.V for a in _AXES})  # the SR counter: each rank draws its own stream
REPLICATED = SpmdLayout({a: spmd.R for a in _AXES})  # RHT signs and the like: the same on every rank


def declare_buffers(instance: Module) -> None:
    """Add a placement for each buffer of ``instance`` its sharding config does not name (sr_counter per rank,
    the others replicated)."""
    sc = instance._sharding_config
    if sc is None:
        return
    extra = {n: PER_RANK if n == "sr_counter" else REPLICATED
             for n, _ in instance.named_buffers(recurse=False) if n not in sc.state_shardings}
    if extra:
        instance._sharding_config = replace(sc, state_shardings={**sc.state_shardings, **extra})


def declare_states(instance: Module, names: tuple[str, ...], layout: SpmdLayout) -> None:
    """Place the states ``names`` of ``instance`` (parameters a titan_nvfp4 module adds, e.g. low-rank factors) by
    ``layout`` where its sharding config does not name them."""
    sc = instance._sharding_config
    if sc is None:
        return
    extra = {n: layout for n in names if n not in sc.state_shardings}
    if extra:
        instance._sharding_config = replace(sc, state_shardings={**sc.state_shardings, **extra})


def place_buffers(instance: Module, parallel_dims) -> None:
    """Before Module.parallelize: the DTensor backends (partial_dtensor, full_dtensor) have no per-rank placement,
    so the SR counter is a replicated DTensor there, whose local copy each rank fills with its own stream at init
    (NVFP4LayerState._reset_nvfp4_buffers), as under 0.2's TP plans."""
    sc = instance._sharding_config
    if sc is None or parallel_dims.spmd_backend == "spmd_types" or sc.state_shardings.get("sr_counter") is not PER_RANK:
        return
    instance._sharding_config = replace(sc, state_shardings={**sc.state_shardings, "sr_counter": REPLICATED})


def tp_sharding(instance: Module, state: str):
    """How ``instance``'s sharding config places its state ``state`` on the TP axis: an spmd_types Shard, or None
    when it is not sharded there (no config, replicated or invariant)."""
    sc = instance._sharding_config
    layout = sc.state_shardings.get(state) if sc is not None else None
    tp = layout.per_axis_spmd_types().get(MeshAxisName.TP) if layout is not None else None
    return None if tp is None or tp is spmd.R or tp is spmd.I else tp


def nvfp4_config(base: type, module: str, owner: str) -> type:
    """``base`` (a TorchTitan module's Config) with what an NVFP4 module adds: its recipe, the layer id that seeds
    its stochastic-rounding streams (one per GEMM from layer_id on) and its fqn for messages; the module it
    builds gets its buffers' placements declared. ``module`` and ``owner``: where the class lives (for pickle)."""

    @dataclass(kw_only=True, slots=True)
    class Config(base):
        recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
        """The module's NVFP4 recipe."""
        layer_id: int = 0
        """Seeds the module's stochastic-rounding streams."""
        name: str = ""
        """The module's fqn, for messages."""

        def build(self, **kwargs):
            instance = base.build(self, **kwargs)  # slots=True: no zero-argument super()
            declare_buffers(instance)
            return instance

    Config.__module__, Config.__qualname__ = module, f"{owner}.Config"
    return Config


class TitanNVFP4Linear(NVFP4Linear, Module):
    """titan_nvfp4's NVFP4Linear under TorchTitan 0.3's Module protocol (same parameters and state-dict keys)."""

    Config = nvfp4_config(Linear.Config, __module__, __qualname__)

    def __init__(self, config: Config):
        NVFP4Linear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                             recipe=config.recipe, layer_id=config.layer_id, name=config.name)

    def forward(self, input):  # noqa: A002
        """NVFP4Linear.forward under Linear's argument name, which 0.3's sharding configs key the input by (a
        local_map region, as on gpt_oss's attention output, looks the forward's arguments up by name)."""
        return NVFP4Linear.forward(self, input)

    def parallelize(self, parallel_dims) -> None:
        """TorchTitan's parallelize (the weight's TP shard from the sharding config); under tensor parallelism the
        layer then runs on the local shards with the TP group's amaxes (NVFP4Linear.local_tp)."""
        tp = tp_sharding(self, "weight")
        place_buffers(self, parallel_dims)
        if parallel_dims.tp_enabled and tp is not None:
            if not isinstance(tp, spmd.Shard):
                raise NotImplementedError(f"NVFP4 Linear {self.label()!r}: weight TP layout {tp} is neither colwise "
                                          "nor rowwise")
            wdim = tp.dim % 2
            if wdim == 1 and self.bias is not None:  # TorchTitan's ScaledBiasRowwiseLinear (gpt_oss's wo): a
                # local_map region that scales the bias per rank and hands the layer plain local inputs
                raise NotImplementedError(f"NVFP4 Linear {self.label()!r}: a rowwise-sharded Linear with a bias is "
                                          "not supported under tensor parallelism yet; keep it BF16 with "
                                          "filter_fqns (e.g. add \"wo\" for gpt_oss)")
            if parallel_dims.spmd_backend == "spmd_types":  # plain local shards: the layer needs its TP layout
                self.local_tp = (wdim, parallel_dims.get_dense_tp_mesh().get_group())
            # the DTensor backends shard the weight as a DTensor: NVFP4Linear's DTensor path
        Module.parallelize(self, parallel_dims)

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        self._reset_nvfp4_buffers()  # a fresh SR stream and the RHT signs at init_weights
