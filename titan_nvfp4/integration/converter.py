"""The `quantize.linear.nvfp4` and `quantize.grouped_mm.nvfp4` model converters: swap a meta-device
model's nn.Linear layers for NVFP4Linear and its routed MoE experts for the NVFP4 expert modules
(experts.py). Registered in TorchTitan's converter registry on import (which also registers our
Llama3 flavors, see flavors.py). The conversion and the per-step logic are the core's (titan_nvfp4/conversion.py,
titan_nvfp4/training/step_state.py); what is here is TorchTitan 0.2's: the job config, its hooks, its logger."""

from __future__ import annotations

from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.tools.logging import logger

from ..conversion import convert_dense, convert_routed_experts, register_experts, require_backend_runs_here
from ..integration_common.metrics_hook import install_metrics_hook
from ..modules.decomposed_linear import lora_dtype_without_rank
from ..recipe.knobs import GroupedKnobs, LinearKnobs
from ..training.step_state import SectionSteps
from .experts import EXPERT_CLASSES

CONVERTER_NAME = LinearKnobs.SECTION  # "quantize.linear.nvfp4"
GROUPED_CONVERTER_NAME = GroupedKnobs.SECTION  # "quantize.grouped_mm.nvfp4"

for _source, _nvfp4 in EXPERT_CLASSES.items():
    register_experts(_source, _nvfp4)


def require_listed_once(job_config: JobConfig, name: str) -> None:
    """Refuse a converter listed twice in ``[model] converters``: the second copy would convert nothing but
    replace the first's step counter (bf16_after_fraction, lora_refresh_steps, amax history, telemetry)."""
    listed = list(getattr(getattr(job_config, "model", None), "converters", None) or [])
    if listed.count(name) > 1:
        raise ValueError(f"[model] converters lists {name!r} {listed.count(name)} times ({listed}); list it once")


def require_lowrank_for_lora_dtype(job_config: JobConfig) -> None:
    """Refuse lora_dtype other than "input" when no listed converter has a lora_rank: the knob would change nothing."""
    linear = _section(job_config, "linear")
    if linear.lora_dtype == "input":
        return
    listed = list(getattr(getattr(job_config, "model", None), "converters", None) or [])
    ranks = {CONVERTER_NAME: linear.lora_rank, GROUPED_CONVERTER_NAME: _section(job_config, "grouped_mm").lora_rank}
    if not any(ranks[name] for name in listed if name in ranks):
        raise lora_dtype_without_rank(linear.SECTION, linear.lora_dtype,
                                      f"in a listed converter's section ([model] converters = {listed})")


def _section(job_config: JobConfig, kind: str):
    """The parsed `[quantize.<kind>.nvfp4]` section; its defaults, with a warning, when the job file
    did not load our config module."""
    section = getattr(getattr(getattr(job_config, "quantize", None), kind, None), "nvfp4", None)
    if section is None:  # the knobs' own defaults (job_config's sections add nothing to them): no import back
        section = {"linear": LinearKnobs, "grouped_mm": GroupedKnobs}[kind]()
        logger.warning(
            f"[{section.SECTION}] section not available (set [job] custom_config_module = "
            f'"titan_nvfp4.integration.job_config"); using its defaults: {section}'
        )
    return section


def _fsdp_all_gather_applies(parallel_dims: ParallelDims | None) -> bool:
    """Whether fsdp_nvfp4_all_gather = true takes effect here: FSDP2 shards the weights (with tensor
    parallelism too: each TP shard then gathers with the whole weight's tensor amax, fsdp_all_gather.py)."""
    key = f"[{CONVERTER_NAME}] fsdp_nvfp4_all_gather"
    if parallel_dims is None or not parallel_dims.fsdp_enabled:
        logger.info(f"NVFP4: {key} has no effect without FSDP (data_parallel_shard_degree = 1)")
        return False
    return True


def require_outcontrol_parallelism(fraction: float, parallel_dims) -> None:
    """Refuse outcontrol_fraction > 0 with tensor or pipeline parallelism (the channel split of a sharded weight; the
    selection's one all_reduce over every rank needs the same layers on each)."""
    if not fraction or parallel_dims is None:
        return
    for on, what, n in ((parallel_dims.tp_enabled, "tensor", parallel_dims.tp),
                        (parallel_dims.pp_enabled, "pipeline", parallel_dims.pp)):
        if on:
            raise ValueError(f"[{CONVERTER_NAME}] outcontrol_fraction = {fraction} is not supported with {what} "
                             f"parallelism (parallelism.{what}_parallel_degree = {n}) yet; set it to 0")


class NVFP4LinearConverter(QuantizationConverter):
    """Converts dense Linears to NVFP4 per the `[quantize.linear.nvfp4]` section."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        super().__init__(job_config, parallel_dims)
        require_listed_once(job_config, CONVERTER_NAME)
        self.section = _section(job_config, "linear")
        self.recipe = self.section.build_recipe()
        self.filter_fqns = list(self.section.filter_fqns)
        require_backend_runs_here(self.recipe, CONVERTER_NAME)
        self.fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
        require_lowrank_for_lora_dtype(job_config)
        if self.section.activation_amax_history and parallel_dims is not None and parallel_dims.pp_enabled:
            raise ValueError(f"[{CONVERTER_NAME}] activation_amax_history = {self.section.activation_amax_history} is "
                             "not supported with pipeline parallelism (parallelism.pipeline_parallel_degree = "
                             f"{parallel_dims.pp}): its one all-reduce per step needs the same layers on every rank; "
                             "set it to 0")
        require_outcontrol_parallelism(self.recipe.outcontrol_fraction, parallel_dims)
        gather = self.section.fsdp_nvfp4_all_gather and _fsdp_all_gather_applies(parallel_dims)
        self.steps = SectionSteps(self.section, job_config.training.steps, logger, nvfp4_all_gather=gather)
        if self.section.telemetry_every:
            install_metrics_hook()
        self.enabled = True

    def convert(self, model: nn.Module) -> None:
        convert_dense(model, self.section, self.steps, logger, one_dtype=self.fsdp,  # metrics hook: in __init__
                      drop_hint=f"drop {CONVERTER_NAME!r} from [model] converters")

    def post_optimizer_hook(self, model) -> None:
        """The per-step core (training/step_state.py): amax windows, step count, late switch, low-rank refresh,
        the NVFP4 all-gather's scales."""
        self.steps.after_optimizer_step(model)


class NVFP4GroupedMMConverter(QuantizationConverter):
    """Converts routed MoE experts to NVFP4 per the `[quantize.grouped_mm.nvfp4]` section, and aligns
    TorchTitan's token groups to 16 so that wgrad blocks along tokens stay inside one expert."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        super().__init__(job_config, parallel_dims)
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m

        require_listed_once(job_config, GROUPED_CONVERTER_NAME)
        self.section = _section(job_config, "grouped_mm")
        self.recipe = self.section.build_recipe()
        require_backend_runs_here(self.recipe, GROUPED_CONVERTER_NAME)
        self.fqns = list(self.section.fqns)
        self.lora_rank = self.section.lora_rank
        self.lora_dtype = _section(job_config, "linear").lora_dtype  # the dense section's knob covers the experts
        self.fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
        require_lowrank_for_lora_dtype(job_config)
        self.steps = SectionSteps(self.section, job_config.training.steps, logger)
        compile_config = getattr(job_config, "compile", None)
        self.compile_backend = (compile_config.backend if compile_config is not None and compile_config.enable
                                and "model" in compile_config.components else None)
        if self.section.telemetry_every:
            install_metrics_hook()
        set_token_group_alignment_size_m(16)
        self.enabled = True

    def convert(self, model: nn.Module) -> None:
        convert_routed_experts(model, self.section, self.steps, logger, lora_dtype=self.lora_dtype, one_dtype=self.fsdp)
        if self.compile_backend is not None:  # compiled as TorchTitan compiles BF16's expert GEMMs (experts.py)
            for m in model.modules():
                if isinstance(m, tuple(EXPERT_CLASSES.values())):
                    m.compile_backend = self.compile_backend

    def post_optimizer_hook(self, model) -> None:
        """The per-step core: the experts' step count and late switch."""
        self.steps.after_optimizer_step(model)


if CONVERTER_NAME not in _registry_model_converter_cls:
    register_model_converter(NVFP4LinearConverter, CONVERTER_NAME)
if GROUPED_CONVERTER_NAME not in _registry_model_converter_cls:
    register_model_converter(NVFP4GroupedMMConverter, GROUPED_CONVERTER_NAME)

from . import flavors  # noqa: E402,F401  (registers the llama3 "2B_bench" flavor beside the converter)
from . import torchtitan_fixes  # noqa: E402

torchtitan_fixes.apply()
