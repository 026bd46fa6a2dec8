"""The 0.3 model converters: `quantize.linear` replaces Linear.Config nodes of a model config tree with
TitanNVFP4Linear.Config (TitanDecomposedLinear.Config with a lora_rank), `quantize.grouped_mm` the routed experts'
GroupedExperts.Config nodes with their NVFP4 versions (experts.py; with its lora_rank), per the shared knobs
(titan_nvfp4/recipe/knobs.py)."""

from dataclasses import dataclass, field, fields
from typing import ClassVar

from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.tools.logging import logger

from ..conversion import start_precompile
from ..modules.decomposed_linear import check_lowrank_args
from ..modules.expert_groups import check_expert_dims, experts_layer_id
from ..recipe.knobs import GroupedKnobs, LinearKnobs
from ..recipe.layer_selection import check_block_counts, skip_reason
from ..modules.lowrank_experts import check_expert_rank
from ..modules.nvfp4_linear import check_linear_dims
from .decomposed import TitanDecomposedLinear
from .experts import EXPERT_CLASSES
from .modules import TitanNVFP4Linear

DEFAULT_FILTER_FQNS = ("lm_head", "router.gate", "shared_experts")  # 0.3's LM head is `lm_head`


def _check_section(config, knobs: type) -> None:
    """``enable`` a bool, then the ``knobs`` class's checks; else a ValueError naming the key."""
    if not isinstance(config.enable, bool):
        raise ValueError(f"[{config.SECTION}] enable must be true or false, got {config.enable!r}")
    knobs.__post_init__(config)  # slots=True: no zero-argument super()


def _n_blocks(model_config) -> int:
    layers = getattr(model_config, "layers", None)
    return len(layers) if isinstance(layers, (list, dict)) else 0


def _replace(model_config, parent, attr, new):
    """``model_config`` with the node at ``parent``.``attr`` (the root when parent is None) replaced by ``new``."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return model_config


class NVFP4LinearConfigConverter(ModelConfigConverter):
    """Swap every eligible Linear.Config (not matched by filter_fqns, not in a BF16 block) for NVFP4."""

    @dataclass(kw_only=True, slots=True)
    class Config(LinearKnobs, ModelConfigConverter.Config):
        """`quantize.linear`: NVFP4 for the dense Linears (titan_nvfp4)."""

        SECTION: ClassVar[str] = "quantize.linear"
        GROUPED_SECTION: ClassVar[str] = "quantize.grouped_mm"

        enable: bool = True
        """Convert the Linears (false: the model stays BF16, as in the *_bf16 configs)."""
        filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))

        def __post_init__(self) -> None:
            _check_section(self, LinearKnobs)

    def __init__(self, config: Config):
        self.config = config
        self.recipe = config.build_recipe()

    def convert(self, model_config):
        """Return ``model_config`` with its eligible Linear.Config nodes replaced (layer ids in tree order)."""
        if not self.config.enable:
            return model_config
        n_blocks = _n_blocks(model_config)
        r = self.recipe
        check_block_counts(r, n_blocks, self.config.SECTION)
        converted, skipped = [], []
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if isinstance(cfg, TitanNVFP4Linear.Config):
                continue  # converting twice is a no-op
            why = skip_reason(fqn, self.config.filter_fqns, r, n_blocks)
            if why:
                skipped.append((fqn, why))
                continue
            check_linear_dims(fqn, cfg.in_features, cfg.out_features)
            new = self._config_for(fqn, cfg, len(converted))
            model_config = _replace(model_config, parent, attr, new)
            converted.append(fqn)
        if converted:
            start_precompile(r, logger)
        lora = f" (DecomposedLinear rank {self.config.lora_rank})" if self.config.lora_rank else ""
        logger.info(f"[{self.config.SECTION}] {len(converted)} Linears to NVFP4{lora}, {len(skipped)} kept BF16 "
                    f"({', '.join(f for f, _ in skipped) or 'none'})")
        return model_config

    def _config_for(self, fqn: str, cfg, layer_id: int):
        """The NVFP4 config replacing Linear.Config ``cfg`` at ``fqn``: a TitanDecomposedLinear with lora_rank
        (the rank checked against the Linear's dims, naming the key), else a TitanNVFP4Linear."""
        c = self.config
        common = dict(in_features=cfg.in_features, out_features=cfg.out_features, bias=cfg.bias,
                      param_init=cfg.param_init, sharding_config=cfg.sharding_config, recipe=self.recipe,
                      layer_id=layer_id, name=fqn)
        if not c.lora_rank:
            return TitanNVFP4Linear.Config(**common)
        check_lowrank_args(fqn, c.lora_rank, cfg.in_features, cfg.out_features, c.lora_nvfp4,
                           f"[{c.SECTION}] lora_rank")
        return TitanDecomposedLinear.Config(**common, lora_rank=c.lora_rank, lora_nvfp4=c.lora_nvfp4)


class NVFP4GroupedMMConfigConverter(ModelConfigConverter):
    """Swap every routed-expert config (GroupedExperts.Config, GptOssGroupedExperts.Config) whose fqn contains one
    of ``fqns`` and that is not in a BF16 block for its NVFP4 version."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedKnobs, ModelConfigConverter.Config):
        """`quantize.grouped_mm`: NVFP4 for the routed MoE experts (titan_nvfp4)."""

        SECTION: ClassVar[str] = "quantize.grouped_mm"

        enable: bool = True
        """Convert the routed experts (false: they stay BF16)."""

        def __post_init__(self) -> None:
            _check_section(self, GroupedKnobs)

    def __init__(self, config: Config):
        self.config = config
        self.recipe = config.build_recipe()

    def convert(self, model_config):
        """Return ``model_config`` with its eligible expert configs replaced (layer ids from
        expert_groups.experts_layer_id, in tree order). No expert config matching ``fqns`` is an error; converting
        twice is a no-op."""
        if not self.config.enable:
            return model_config
        s, r, fqns = self.config.SECTION, self.recipe, self.config.fqns
        n_blocks = _n_blocks(model_config)
        check_block_counts(r, n_blocks, s)
        nvfp4 = tuple(c.Config for c in EXPERT_CLASSES.values())
        converted, skipped, done = [], [], 0
        for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            if isinstance(cfg, nvfp4):
                done += 1
                continue
            if not any(f in fqn for f in fqns):
                skipped.append((fqn, f"not in fqns {fqns}"))
                continue
            why = skip_reason(fqn, [], r, n_blocks)
            if why:
                skipped.append((fqn, why))
                continue
            cls = EXPERT_CLASSES.get(type(cfg)._owner)
            if cls is None:
                known = ", ".join(c.__name__ + ".Config" for c in EXPERT_CLASSES)
                raise ValueError(f"[{s}] cannot convert experts {fqn!r} to NVFP4: {type(cfg).__qualname__} is not one "
                                 f"of {known}; exclude it with fqns")
            shapes = cls.weight_shapes(cfg)
            check_expert_dims(fqn, shapes, s)
            check_expert_rank(fqn, self.config.lora_rank, shapes, f"[{s}] lora_rank")
            new = cls.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, recipe=r,
                             layer_id=experts_layer_id(done + len(converted)), name=fqn,
                             lora_rank=self.config.lora_rank)
            model_config = _replace(model_config, parent, attr, new)
            converted.append(fqn)
        if not converted and not done:
            raise ValueError(f"[{s}] no routed-expert config matched fqns {fqns} (skipped: "
                             f"{skipped or 'the model has no GroupedExperts / GptOssGroupedExperts'}); set "
                             f"--{s}.no-enable for a model without experts")
        if converted:
            start_precompile(r, logger, experts=True)
        lora = f", per-expert low-rank branch rank {self.config.lora_rank}" if self.config.lora_rank else ""
        logger.info(f"[{s}] {len(converted)} expert modules to NVFP4 (token groups padded to 16{lora}), {len(skipped)} "
                    f"kept BF16 ({', '.join(f for f, _ in skipped) or 'none'})")
        return model_config
