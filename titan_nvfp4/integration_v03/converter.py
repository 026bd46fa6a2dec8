"""The 0.3 model converter for dense Linears: replaces Linear.Config nodes of a model config tree with
TitanNVFP4Linear.Config, per the shared knobs (titan_nvfp4/knobs.py) of the `quantize.linear` section."""

from dataclasses import dataclass, field
from typing import ClassVar

from torchtitan.models.common.linear import Linear
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.tools.logging import logger

from ..knobs import LinearKnobs
from ..layer_selection import check_block_counts, skip_reason
from ..nvfp4_linear import check_linear_dims
from .modules import TitanNVFP4Linear

DEFAULT_FILTER_FQNS = ("lm_head", "router.gate", "shared_experts")  # 0.3's LM head is `lm_head`
#: knobs of the 0.2 integration that this one does not implement yet, with their off value
NOT_YET = {"lora_rank": 0, "lora_refresh_steps": 0, "telemetry_every": 0, "activation_amax_history": 0,
           "fsdp_nvfp4_all_gather": False, "bf16_after_fraction": 0.0}


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
            if not isinstance(self.enable, bool):
                raise ValueError(f"[{self.SECTION}] enable must be true or false, got {self.enable!r}")
            LinearKnobs.__post_init__(self)
            for key, off in NOT_YET.items():
                if getattr(self, key) != off:
                    raise ValueError(f"[{self.SECTION}] {key} is not supported by the TorchTitan 0.3 integration "
                                     f"yet (docs/torchtitan03.md); leave it at {off!r}")

    def __init__(self, config: Config):
        self.config = config
        self.recipe = config.build_recipe()

    def convert(self, model_config):
        """Return ``model_config`` with its eligible Linear.Config nodes replaced (layer ids in tree order)."""
        if not self.config.enable:
            return model_config
        layers = getattr(model_config, "layers", None)
        n_blocks = len(layers) if isinstance(layers, (list, dict)) else 0
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
            new = TitanNVFP4Linear.Config(
                in_features=cfg.in_features, out_features=cfg.out_features, bias=cfg.bias,
                param_init=cfg.param_init, sharding_config=cfg.sharding_config,
                recipe=r, layer_id=len(converted), name=fqn)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted.append(fqn)
        logger.info(f"[{self.config.SECTION}] {len(converted)} Linears to NVFP4, {len(skipped)} kept BF16 "
                    f"({', '.join(f for f, _ in skipped) or 'none'})")
        return model_config
