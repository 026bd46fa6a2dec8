"""The `[quantize.linear.nvfp4]` section TorchTitan's JobConfig gains through
`[job] custom_config_module = "titan_nvfp4.integration.job_config"`.

Every recipe field defaults to None, meaning "take it from the preset named by `recipe`". Values are
checked when TorchTitan parses the TOML file, so a bad value stops the job before anything starts;
misspelt keys are rejected by TorchTitan's own parser, which names them.
"""


from dataclasses import dataclass, field

from ..recipe import NVFP4Recipe, build_recipe, validate_field

import titan_nvfp4.integration.converter  # noqa: F401  (registers quantize.linear.nvfp4)


@dataclass
class NVFP4LinearConfig:
    recipe: str = "nvidia_paper"
    """Preset from configs/ (nvidia_paper, nvidia_paper_selective, naive_rtn) or a path to a .toml."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linears whose fully qualified name contains one of these strings stay BF16 (default: LM head)."""
    weight_2d: bool | None = None
    """16×16 weight blocks (true) or 1×16 (false)."""
    stochastic_rounding: bool | None = None
    """Stochastic rounding of gradients."""
    rht: bool | None = None
    """Random Hadamard transform on the wgrad operands."""
    rht_seed: int | None = None
    """Seed of the RHT sign vector."""
    sr_seed: int | None = None
    """Base seed of the stochastic-rounding streams."""
    bf16_first_blocks: int | None = None
    """Keep the first N transformer blocks in BF16."""
    bf16_last_blocks: int | None = None
    """Keep the last N transformer blocks in BF16."""
    gemm_backend: str | None = None
    """NVFP4 GEMM implementation: auto | reference."""

    def __post_init__(self) -> None:
        if not isinstance(self.filter_fqns, list) or not all(isinstance(s, str) for s in self.filter_fqns):
            raise ValueError(f"[quantize.linear.nvfp4] filter_fqns must be a list of strings, got {self.filter_fqns!r}")
        if not isinstance(self.recipe, str):
            raise ValueError(f"[quantize.linear.nvfp4] recipe must be a preset name, got {self.recipe!r}")
        for name, value in self.overrides().items():
            validate_field(name, value)
        self.build_recipe()  # an unknown preset fails here, at parse time

    def overrides(self) -> dict:
        """The recipe fields set explicitly in the job file."""
        names = [f for f in NVFP4Recipe.__dataclass_fields__]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def build_recipe(self) -> NVFP4Recipe:
        return build_recipe(self.recipe, self.overrides())


@dataclass
class QuantizedLinear:
    nvfp4: NVFP4LinearConfig = field(default_factory=NVFP4LinearConfig)


@dataclass
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)


@dataclass
class JobConfig:
    quantize: Quantize = field(default_factory=Quantize)
