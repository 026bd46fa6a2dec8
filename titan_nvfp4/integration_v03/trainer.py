"""NVFP4Trainer: TorchTitan 0.3's Trainer whose Config gains a `quantize` section (0.2's [quantize.linear.nvfp4]
and [quantize.grouped_mm.nvfp4]), applied to the model config before the Trainer builds the model. After the
build, the core's per-step state (titan_nvfp4/training/step_state.py: the late BF16 switch, the activation amax
windows, the low-rank refresh of lora_refresh_steps, telemetry) is attached and advanced by an optimizer step
hook, and the checkpointed train_state carries the SR call counts and the windows (training/train_state.py), so a
resumed run continues bit for bit."""

import functools
from dataclasses import dataclass, field

import torch
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..distributed.fsdp_all_gather import wrap_weight
from ..integration_common.metrics_hook import install_metrics_hook
from ..modules.decomposed_linear import lora_dtype_without_rank
from ..training import step_state
from ..training.step_state import SectionSteps
from ..training.train_state import install
from .converter import NVFP4GroupedMMConfigConverter, NVFP4LinearConfigConverter
from .experts import EXPERT_CLASSES
from .modules import TitanNVFP4Linear
from .torch_compat import provide_set_timeout



@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """titan_nvfp4's NVFP4 sections."""

    linear: NVFP4LinearConfigConverter.Config = field(
        default_factory=lambda: NVFP4LinearConfigConverter.Config(enable=False))
    """NVFP4 for the dense Linears (`--quantize.linear.enable` turns it on, `--quantize.linear.no-enable` off)."""
    grouped_mm: NVFP4GroupedMMConfigConverter.Config = field(
        default_factory=lambda: NVFP4GroupedMMConfigConverter.Config(enable=False))
    """NVFP4 for the routed MoE experts (`--quantize.grouped_mm.enable` / `--quantize.grouped_mm.no-enable`)."""


def prepare_offline_data(config: Trainer.Config) -> None:
    """Build (when missing) and register the offline pystdlib corpus at hf_assets_path if the job reads it."""
    from ..data.registry import MEMORIZE_NAME, TRAIN_NAME, VALIDATION_NAME

    names = {getattr(config.dataloader, "dataset", None),
             getattr(getattr(config.validator, "dataloader", None), "dataset", None)}
    if names & {TRAIN_NAME, VALIDATION_NAME, MEMORIZE_NAME}:
        from ..data.prepare import prepare

        prepare(config.hf_assets_path)


def apply_quantize(config: Trainer.Config) -> None:
    """Convert ``config.model_spec.model`` per ``config.quantize`` (in place; converting twice is a no-op); with
    fsdp_nvfp4_all_gather, the model's parallelize_fn first makes the NVFP4 weights gather as NVFP4."""
    spec = config.model_spec
    if spec is None:
        return
    for section in (config.quantize.linear, config.quantize.grouped_mm):
        if section.enable:
            spec.model = section.build().convert(spec.model)
    linear = config.quantize.linear
    if linear.enable and linear.fsdp_nvfp4_all_gather and not getattr(spec.parallelize_fn, "nvfp4_all_gather", False):
        spec.parallelize_fn = with_nvfp4_all_gather(spec.parallelize_fn, linear.SECTION)


def with_nvfp4_all_gather(parallelize_fn, section: str):
    """``parallelize_fn`` that first wraps the NVFP4 Linears' weights for FSDP2's NVFP4 all-gather
    (fsdp_all_gather.wrap_weight; before the model's fully_shard, as 0.2's converter does). It takes effect under
    FSDP on the partial_dtensor backend (with or without tensor parallelism); on spmd_types under FSDP it stops
    naming the knob."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, parallelism, **kwargs):
        key = f"[{section}] fsdp_nvfp4_all_gather"
        if not parallel_dims.fsdp_enabled:
            logger.info(f"NVFP4: {key} has no effect without FSDP (data_parallel_shard_degree = 1)")
        elif parallelism.spmd_backend != "partial_dtensor":
            raise ValueError(f"{key} = true runs on parallelism.spmd_backend = partial_dtensor in the TorchTitan 0.3 "
                             f"integration (got {parallelism.spmd_backend}); set it there or turn the all-gather off")
        else:
            linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
            for m in linears:
                wrap_weight(m)
            logger.info(f"NVFP4: FSDP2 all-gathers the weights of {len(linears)} Linear layers as NVFP4")
        return parallelize_fn(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)

    parallelize.nvfp4_all_gather = True
    return parallelize


class NVFP4Trainer(Trainer):
    """Trainer with the `quantize` section and the NVFP4 per-step state; everything else is TorchTitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
        """titan_nvfp4's NVFP4 sections."""

    def __init__(self, config: Config):
        provide_set_timeout()
        prepare_offline_data(config)
        apply_quantize(config)
        super().__init__(config)
        linear = config.quantize.linear
        if linear.enable and linear.activation_amax_history and self.parallel_dims.pp_enabled:  # as 0.2 refuses it
            raise ValueError(f"[{linear.SECTION}] activation_amax_history = {linear.activation_amax_history} is not "
                             "supported with pipeline parallelism: its one all-reduce per step needs the same "
                             "layers on every rank; set it to 0")
        fraction = linear.build_recipe().outcontrol_fraction if linear.enable else 0
        for on, what in ((self.parallel_dims.tp_enabled, "tensor"), (self.parallel_dims.pp_enabled, "pipeline")):
            if fraction and on:  # as 0.2 refuses it
                raise ValueError(f"[{linear.SECTION}] outcontrol_fraction = {fraction} is not supported with {what} "
                                 "parallelism yet; set it to 0")
        sections = attach_sections(self.model_parts, config.quantize, config.training.steps)
        apply_lora_dtype(self.model_parts, linear)
        if sections:
            self.optimizers.register_step_post_hook(lambda *args, **kwargs: after_optimizer_step(self.model_parts,
                                                                                                 sections))


def attach_sections(model_parts: list[torch.nn.Module], quantize: QuantizeConfig,
                    total_steps: int) -> list[SectionSteps]:
    """The core's per-step state (training/step_state.py) of each enabled section, attached to the NVFP4 modules of
    the built ``model_parts``; returns the sections an optimizer step must advance."""
    sections = []
    experts = tuple(EXPERT_CLASSES.values())
    for section, classes in ((quantize.linear, (TitanNVFP4Linear,)), (quantize.grouped_mm, experts)):
        if not section.enable:
            continue
        gather = getattr(section, "fsdp_nvfp4_all_gather", False)
        steps = SectionSteps(section, total_steps, logger, nvfp4_all_gather=gather)
        steps.attach(model_parts, [[m for m in part.modules() if isinstance(m, classes)] for part in model_parts],
                     install_metrics_hook)
        if steps.per_step:
            sections.append(steps)
    return sections


def apply_lora_dtype(model_parts: list[torch.nn.Module], section: NVFP4LinearConfigConverter.Config) -> int:
    """The dense section's lora_dtype on every low-rank module of the built parts, the experts' too (as on 0.2);
    returns how many it set. A model without low-rank factors is refused: the knob would change nothing."""
    if section.lora_dtype == "input":
        return 0
    n = step_state.apply_lora_dtype(model_parts, section.lora_dtype, logger)
    if not n:
        raise lora_dtype_without_rank(section.SECTION, section.lora_dtype, "here or in quantize.grouped_mm")
    return n


def after_optimizer_step(model_parts: list[torch.nn.Module], sections: list[SectionSteps]) -> None:
    """The optimizer step post hook: each section's per-step core, in order (the Linears' first)."""
    for steps in sections:
        steps.after_optimizer_step(model_parts)


install(NVFP4Trainer)  # the SR call counts and amax windows in the checkpointed train_state
