"""NVFP4Trainer: TorchTitan 0.3's Trainer whose Config gains a `quantize` section (0.2's [quantize.linear.nvfp4]
and [quantize.grouped_mm.nvfp4]), applied to the model config before the Trainer builds the model; after the
build it attaches the per-step state of the NVFP4 Linears (the late BF16 switch, the activation amax windows, the
low-rank refresh of lora_refresh_steps), advanced by an optimizer step hook, and its checkpointed train_state
carries the SR call counts and the windows (titan_nvfp4/training/train_state.py), so a resumed run continues bit for bit."""

import functools
from dataclasses import dataclass, field

import torch
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..modules.amax_history import AmaxHistory, layers_with_history, register_buffers, roll
from ..modules.decomposed_linear import log_lora_dtype, log_refresh, lora_dtype_without_rank, redecompose, set_lora_dtype
from ..distributed.fsdp_all_gather import precompute_scales, wrap_weight
from ..integration_common.metrics_hook import install_metrics_hook
from ..training.optimizer_states import shared_optimizer_states
from ..training.schedule import (GROUPED_STEPS, LINEAR_STEPS, PrecisionSchedule, StepCounter, attach_step_counter,
                        step_counters, switch_step)
from ..modules.telemetry import Telemetry
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


def attach_linear_state(model_parts: list[torch.nn.Module], section: NVFP4LinearConfigConverter.Config,
                        total_steps: int) -> list[StepCounter]:
    """Give the NVFP4 Linears of the built ``model_parts`` what ``section`` asks for across steps: a StepCounter per
    part (submodule LINEAR_STEPS) whose schedule switches them to high precision at bf16_after_fraction and whose
    count picks the telemetry_every and lora_refresh_steps steps, and the amax windows of activation_amax_history.
    Returns the counters (none when neither the switch, telemetry nor the refresh is on)."""
    linears = [[m for m in part.modules() if isinstance(m, TitanNVFP4Linear)] for part in model_parts]
    if section.activation_amax_history:
        history = AmaxHistory(section.activation_amax_history)
        for m in (m for ms in linears for m in ms):
            register_buffers(m, history)
        logger.info(f"NVFP4: X of {sum(map(len, linears))} Linear layers quantized with the max amax of the last "
                    f"{history.length} optimizer steps (activation_amax_history)")
    counters = _late_switch(model_parts, linears, section.bf16_after_fraction, total_steps, LINEAR_STEPS,
                            "Linear layers", section.telemetry_every > 0 or section.lora_refresh_steps > 0)
    if section.lora_refresh_steps:
        logger.info(f"NVFP4: low-rank modules re-decomposed every {section.lora_refresh_steps} optimizer steps "
                    "(lora_refresh_steps; the experts' too)" + (", their factors' Adam moments projected onto the new "
                    "split" if section.lora_refresh_moments == "project" else ""))
    _attach_telemetry(counters, linears, section.telemetry_every, "Linear layers")
    return counters


def apply_lora_dtype(model_parts: list[torch.nn.Module], section: NVFP4LinearConfigConverter.Config) -> int:
    """The dense section's lora_dtype on every low-rank module of the built parts, the experts' too (as on 0.2);
    returns how many it set. A model without low-rank factors is refused: the knob would change nothing."""
    if section.lora_dtype == "input":
        return 0
    n = set_lora_dtype(model_parts, section.lora_dtype)
    if not n:
        raise lora_dtype_without_rank(section.SECTION, section.lora_dtype, "here or in quantize.grouped_mm")
    log_lora_dtype(logger, n)
    return n


def attach_grouped_state(model_parts: list[torch.nn.Module], section: NVFP4GroupedMMConfigConverter.Config,
                         total_steps: int) -> list[StepCounter]:
    """The routed experts' late switch to high precision (bf16_after_fraction) and telemetry, as attach_linear_state's."""
    experts = [[m for m in part.modules() if isinstance(m, tuple(EXPERT_CLASSES.values()))] for part in model_parts]
    counters = _late_switch(model_parts, experts, section.bf16_after_fraction, total_steps, GROUPED_STEPS,
                            "expert modules", section.telemetry_every > 0)
    _attach_telemetry(counters, experts, section.telemetry_every, "expert modules")
    return counters


def _attach_telemetry(counters: list[StepCounter], modules: list[list[torch.nn.Module]], every: int, what: str) -> None:
    """Every ``every`` steps (and step 1, as the parts' counters count them) the modules measure their operands into
    TorchTitan's next metrics log (titan_nvfp4/modules/telemetry.py)."""
    if not every:
        return
    for counter, ms in zip(counters, modules):
        telemetry = Telemetry(every, counter)
        for m in ms:
            m.telemetry = telemetry
    install_metrics_hook()
    logger.info(f"NVFP4: telemetry of {sum(map(len, modules))} {what} every {every} steps (nvfp4/... in the metrics)")


def _late_switch(model_parts, modules, fraction: float, total_steps: int, name: str, what: str,
                 counted: bool = False) -> list[StepCounter]:
    """A StepCounter per part (submodule ``name``) whose schedule switches ``modules`` to high precision for the last
    ``fraction`` of ``total_steps``; none when ``fraction`` is 0, unless ``counted`` (the steps are counted anyway,
    never switching)."""
    if not (fraction or counted):
        return []
    schedule = PrecisionSchedule(switch_step(fraction, total_steps) if fraction else None)
    counters = [attach_step_counter(part, name, ms, schedule) for part, ms in zip(model_parts, modules)]
    if fraction:
        logger.info(f"NVFP4: {what} switch to high precision after optimizer step {schedule.switch_step} "
                    f"(bf16_after_fraction = {fraction} of {total_steps} steps)")
    return counters


def after_optimizer_step(model_parts: list[torch.nn.Module], nvfp4_gather: bool = False,
                         lora_refresh_steps: int = 0, state_of=None) -> None:
    """Push the step's activation amaxes into the windows, count the step (the late switch follows), re-decompose
    the low-rank modules (Linears and, as on 0.2, experts with a lora_rank) every ``lora_refresh_steps`` steps
    (before the all-gather scales, which read R; with ``state_of``, lora_refresh_moments = "project", the factors'
    Adam moments are projected onto the new split) and, with ``nvfp4_gather``, reduce the NVFP4-gathered weights'
    tile amaxes for their next all-gathers in one all-reduce (fsdp_all_gather.py)."""
    roll(layers_with_history(model_parts))
    for name, what in ((LINEAR_STEPS, "Linear layers"), (GROUPED_STEPS, "expert modules")):
        for i, (part, counter) in enumerate(step_counters(model_parts, name)):
            if counter.step() and i == 0:
                logger.info(f"NVFP4: {what} switched to high precision after optimizer step {counter.count}")
            if name == LINEAR_STEPS and lora_refresh_steps and counter.count % lora_refresh_steps == 0:
                done = redecompose(part, state_of)
                if i == 0:
                    log_refresh(logger, done, counter.count, state_of is not None)
    if nvfp4_gather:
        for part in model_parts:
            precompute_scales(part)


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
        if linear.enable:
            if linear.activation_amax_history and self.parallel_dims.pp_enabled:  # as 0.2's converter refuses it
                raise ValueError(f"[{linear.SECTION}] activation_amax_history = {linear.activation_amax_history} is not "
                                 "supported with pipeline parallelism: its one all-reduce per step needs the same "
                                 "layers on every rank; set it to 0")
            attach_linear_state(self.model_parts, linear, config.training.steps)
        grouped = config.quantize.grouped_mm
        if grouped.enable:
            attach_grouped_state(self.model_parts, grouped, config.training.steps)
        apply_lora_dtype(self.model_parts, linear)
        gather = linear.enable and linear.fsdp_nvfp4_all_gather
        refresh = linear.lora_refresh_steps if linear.enable else 0
        state_of = shared_optimizer_states().state_of if refresh and linear.lora_refresh_moments == "project" else None
        per_step = (linear.bf16_after_fraction or linear.activation_amax_history or linear.telemetry_every or gather
                    or refresh)
        if (linear.enable and per_step) or (grouped.enable and (grouped.bf16_after_fraction or grouped.telemetry_every)):
            self.optimizers.register_step_post_hook(
                lambda *args, **kwargs: after_optimizer_step(self.model_parts, gather, refresh, state_of))


install(NVFP4Trainer)  # the SR call counts and amax windows in the checkpointed train_state
