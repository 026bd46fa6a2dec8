"""The `[quantize.linear.nvfp4]` and `[quantize.grouped_mm.nvfp4]` sections TorchTitan's JobConfig gains through
`[job] custom_config_module = "titan_nvfp4.integration.job_config"`.

The keys and their checks live in titan_nvfp4/recipe/knobs.py, shared with the TorchTitan 0.3 integration. Every
recipe field defaults to None, meaning "take it from the preset named by `recipe`". Values are checked when
TorchTitan parses the TOML file, so a bad value stops the job before anything starts; misspelt keys are
rejected by TorchTitan's own parser, which names them.
"""


from dataclasses import dataclass, field

from ..recipe.knobs import DEFAULT_FILTER_FQNS, GroupedKnobs, LinearKnobs

from .training_device import require_training_device

require_training_device()  # before TorchTitan's device set-up: one message on a CPU-only machine

import titan_nvfp4.integration.converter  # noqa: E402, F401  (registers quantize.linear.nvfp4 and grouped_mm.nvfp4)

__all__ = ["DEFAULT_FILTER_FQNS", "JobConfig", "NVFP4GroupedMMConfig", "NVFP4LinearConfig"]


@dataclass(kw_only=True, slots=True)
class NVFP4LinearConfig(LinearKnobs):
    """`[quantize.linear.nvfp4]`: dense nn.Linear layers."""


@dataclass(kw_only=True, slots=True)
class NVFP4GroupedMMConfig(GroupedKnobs):
    """`[quantize.grouped_mm.nvfp4]`: routed MoE experts (TorchTitan's GroupedExperts and gpt-oss's)."""


@dataclass
class QuantizedLinear:
    nvfp4: NVFP4LinearConfig = field(default_factory=NVFP4LinearConfig)


@dataclass
class QuantizedGroupedMM:
    nvfp4: NVFP4GroupedMMConfig = field(default_factory=NVFP4GroupedMMConfig)


@dataclass
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = field(default_factory=QuantizedGroupedMM)


@dataclass
class JobConfig:
    quantize: Quantize = field(default_factory=Quantize)
