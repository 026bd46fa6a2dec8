"""The `[quantize.linear.nvfp4]` and `[quantize.grouped_mm.nvfp4]` sections TorchTitan's JobConfig gains through
`[job] custom_config_module = "titan_nvfp4.integration.job_config"`.

Every recipe field defaults to None, meaning "take it from the preset named by `recipe`". Values are
checked when TorchTitan parses the TOML file, so a bad value stops the job before anything starts;
misspelt keys are rejected by TorchTitan's own parser, which names them.
"""


from dataclasses import dataclass, field
from typing import ClassVar

from ..numerics.lowrank import check_rank
from ..recipe import NVFP4Recipe, build_recipe, validate_field

from .training_device import require_training_device

require_training_device()  # before TorchTitan's device set-up: one message on a CPU-only machine

import titan_nvfp4.integration.converter  # noqa: E402, F401  (registers quantize.linear.nvfp4 and grouped_mm.nvfp4)


DEFAULT_FILTER_FQNS = ("output", "router.gate", "shared_experts")


@dataclass
class _RecipeKnobs:
    """The recipe preset and per-field overrides, shared by the dense and the grouped sections."""

    SECTION: ClassVar[str] = "quantize.linear.nvfp4"

    recipe: str = "nvidia_paper"
    """Preset from configs/ (nvidia_paper, nvidia_paper_selective, naive_rtn) or a path to a .toml."""
    weight_2d: bool | None = None
    """16×16 weight blocks (true) or 1×16 (false)."""
    stochastic_rounding: bool | None = None
    """Stochastic rounding of gradients."""
    rht: bool | None = None
    """Random Hadamard transform on the wgrad operands."""
    rht_seed: int | None = None
    """Seed of the RHT sign vector."""
    rht_round_to_input_dtype: bool | None = None
    """Round the RHT'd wgrad operands to the input dtype (bf16) before quantizing, as Transformer Engine does."""
    sr_seed: int | None = None
    """Base seed of the stochastic-rounding streams."""
    bf16_first_blocks: int | None = None
    """Keep the first N transformer blocks in BF16."""
    bf16_last_blocks: int | None = None
    """Keep the last N transformer blocks in BF16."""
    gemm_backend: str | None = None
    """NVFP4 GEMM implementation: auto | reference | emulated | native (auto: native on sm_100+, emulated on other GPUs, reference on CPU)."""
    backward: str | None = None
    """Backward GEMMs of the dense Linears: nvfp4 | mxfp8 | bf16 (the forward stays NVFP4)."""
    block_scale_rule: str | None = None
    """Block scales: six (max to 6) | four_over_six (per block, max to 6 or 4, the lower error)."""
    staged_expert_activations: bool | None = None
    """Grouped experts only: keep X's and h's wgrad operands staged (fp16) for backward, faster, or as codes,
    smaller ([quantize.linear.nvfp4] refuses it)."""
    bf16_after_fraction: float = 0.0
    """Switch this section's NVFP4 layers to high precision (BF16 under TorchTitan's mixed precision)
    for the last fraction of training.steps (0 = never; 1 = from the start, a control arm with the
    same modules)."""

    def _check_fqns(self, key: str) -> None:
        value = getattr(self, key)
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"[{self.SECTION}] {key} must be a list of strings, got {value!r}")
        if any(not s.strip() for s in value):
            raise ValueError(f"[{self.SECTION}] {key} holds an empty pattern, which every module name contains: "
                             f"got {value!r}")

    def __post_init__(self) -> None:
        f = self.bf16_after_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"[{self.SECTION}] bf16_after_fraction must be a number in [0, 1], got {f!r}")
        if not isinstance(self.recipe, str) or not self.recipe.strip():
            raise ValueError(f"[{self.SECTION}] recipe must be a preset name or a path to a .toml file, "
                             f"got {self.recipe!r}")
        for name, value in self.overrides().items():
            validate_field(name, value, self.SECTION)
        self.build_recipe()  # an unknown preset fails here, at parse time

    def overrides(self) -> dict:
        """The recipe fields set explicitly in the job file."""
        names = [f for f in NVFP4Recipe.__dataclass_fields__]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def build_recipe(self) -> NVFP4Recipe:
        return build_recipe(self.recipe, self.overrides())


@dataclass
class NVFP4LinearConfig(_RecipeKnobs):
    """`[quantize.linear.nvfp4]`: dense nn.Linear layers."""

    filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))
    """Linears whose fully qualified name contains one of these strings stay BF16 (default: the LM
    head, MoE router gates and shared experts; drop "shared_experts" to convert those too)."""
    lora_rank: int = 0
    """DecomposedLinear: keep the top-r singular directions of every converted Linear's weight in a
    high-precision branch beside the NVFP4 residual (0 = off; else a multiple of 16)."""
    lora_nvfp4: bool = False
    """Run the branch's two GEMMs in NVFP4 too (default: the input's dtype, BF16 in training)."""
    lora_refresh_steps: int = 0
    """Re-decompose every N optimizer steps (0 = only at initialization). AdamW's moments keep describing
    the old split, which cost loss in docs/results.md (DecomposedLinear): leave it at 0 unless you study it."""
    telemetry_every: int = 0
    """Per-layer numerics telemetry: every N steps (and step 1) each converted Linear measures amax,
    saturated and underflowed blocks and the quantization SNR of W, X and dY, logged with TorchTitan's
    next metrics log as nvfp4/<layer>/<operand>/<stat> (0 = off)."""
    activation_amax_history: int = 0
    """X's tensor scale from the largest amax of the last N optimizer steps (delayed scaling; the current
    amax on the first step; all ranks share one history) instead of X's own amax (0 = off, the
    default). Elements above the history's amax saturate. Dense Linears only."""
    fsdp_nvfp4_all_gather: bool = False
    """Under FSDP2, all-gather the converted Linears' weights as NVFP4 codes (4 bits per element)
    instead of BF16: each rank quantizes its shard with the whole weight's scales (with tensor
    parallelism, its TP shard's, with the whole weight's tensor amax). Needs 16×16 weight blocks (weight_2d)."""

    def __post_init__(self) -> None:
        self._check_fqns("filter_fqns")
        check_rank(self.lora_rank, self.SECTION)
        if not isinstance(self.lora_nvfp4, bool):
            raise ValueError(f"[{self.SECTION}] lora_nvfp4 must be true or false, got {self.lora_nvfp4!r}")
        r = self.lora_refresh_steps
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"[{self.SECTION}] lora_refresh_steps must be a non-negative integer, got {r!r}")
        if r and not self.lora_rank:
            raise ValueError(f"[{self.SECTION}] lora_refresh_steps = {r} needs lora_rank > 0")
        t = self.telemetry_every
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"[{self.SECTION}] telemetry_every must be a non-negative integer, got {t!r}")
        h = self.activation_amax_history
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"[{self.SECTION}] activation_amax_history must be a non-negative integer (0 = off), "
                             f"got {h!r}")
        if not isinstance(self.fsdp_nvfp4_all_gather, bool):
            raise ValueError(f"[{self.SECTION}] fsdp_nvfp4_all_gather must be true or false, "
                             f"got {self.fsdp_nvfp4_all_gather!r}")
        if self.staged_expert_activations is not None:
            raise ValueError(f"[{self.SECTION}] staged_expert_activations applies to the routed experts only: set it "
                             "in [quantize.grouped_mm.nvfp4]")
        super().__post_init__()
        recipe = self.build_recipe()
        if self.fsdp_nvfp4_all_gather and not recipe.weight_2d:
            raise ValueError(f"[{self.SECTION}] fsdp_nvfp4_all_gather = true needs weight_2d = true (16x16 weight "
                             "blocks: the gathered codes then serve forward and dgrad alike)")
        if self.fsdp_nvfp4_all_gather and self.bf16_after_fraction:
            raise ValueError(f"[{self.SECTION}] fsdp_nvfp4_all_gather = true cannot be combined with bf16_after_fraction "
                             f"= {self.bf16_after_fraction}: FSDP2 keeps the all-gather buffers of the first step "
                             "(packed codes), so the weights cannot switch to a BF16 all-gather mid-run")
        if self.fsdp_nvfp4_all_gather and recipe.four_over_six:
            raise ValueError(f"[{self.SECTION}] fsdp_nvfp4_all_gather = true does not support block_scale_rule = "
                             "\"four_over_six\" yet (a tile's choice needs the error of all its rows, which "
                             "straddle shards); use block_scale_rule = \"six\" or the BF16 all-gather")
        if self.fsdp_nvfp4_all_gather and recipe.backward != "nvfp4":
            raise ValueError(f"[{self.SECTION}] fsdp_nvfp4_all_gather = true needs backward = \"nvfp4\" (an MXFP8 or "
                             f"BF16 backward reads the high-precision weight), got {recipe.backward!r}")


@dataclass
class NVFP4GroupedMMConfig(_RecipeKnobs):
    """`[quantize.grouped_mm.nvfp4]`: routed MoE experts (TorchTitan's GroupedExperts and gpt-oss's)."""

    SECTION: ClassVar[str] = "quantize.grouped_mm.nvfp4"

    fqns: list[str] = field(default_factory=lambda: ["experts"])
    """Expert modules whose fully qualified name contains one of these strings are converted."""
    lora_rank: int = 0
    """Keep the top-r singular directions of every expert weight in a BF16 branch beside the NVFP4
    residual, per expert (0 = off; else a multiple of 16). [quantize.linear.nvfp4] lora_refresh_steps
    re-decomposes these too."""
    telemetry_every: int = 0
    """Numerics telemetry of every grouped GEMM of the converted experts: every N steps (and step 1)
    amax, saturated and underflowed blocks and SNR of the expert weights (per expert: each has its own
    tensor scale; plus the worst expert's SNR), the routed tokens and dY, logged as
    nvfp4/<experts>/<weight>/<operand>/<stat> (0 = off)."""

    def __post_init__(self) -> None:
        self._check_fqns("fqns")
        check_rank(self.lora_rank, self.SECTION)
        t = self.telemetry_every
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"[{self.SECTION}] telemetry_every must be a non-negative integer, got {t!r}")
        super().__post_init__()
        backward = self.build_recipe().backward
        if backward != "nvfp4":
            raise ValueError(f"[{self.SECTION}] backward = {backward!r}: the experts run an NVFP4 "
                             "backward only (set it in [quantize.linear.nvfp4] for the dense Linears)")


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
