"""The `quantize.linear.nvfp4` and `quantize.grouped_mm.nvfp4` model converters: swap a meta-device
model's nn.Linear layers for NVFP4Linear and its routed MoE experts for the NVFP4 expert modules
(experts.py). Registered in TorchTitan's converter registry on import (which also registers our
Llama3 flavors, see flavors.py)."""

from __future__ import annotations

import types

import torch
from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.tools.logging import logger

from ..modules.amax_history import AmaxHistory, layers_with_history, register_buffers, roll
from ..modules.decomposed_linear import (DecomposedLinear, check_lowrank_args, log_lora_dtype, log_refresh,
                                 lora_dtype_without_rank, redecompose, set_lora_dtype)
from ..distributed.fsdp_all_gather import TRAFFIC, precompute_scales, wrap_weight
from ..modules.expert_groups import experts_layer_id
from ..recipe.layer_selection import check_block_counts, skip_reason
from ..integration_common.metrics_hook import install_metrics_hook
from ..modules.nvfp4_linear import NVFP4Linear, check_linear_dims
from ..training.optimizer_states import shared_optimizer_states
from ..ops.backends import resolve_backend
from ..recipe.nvfp4_recipe import NVFP4Recipe
from ..training.schedule import (GROUPED_STEPS, LINEAR_STEPS, PrecisionSchedule, StepCounter, attach_step_counter,
                        step_counters, switch_step)
from ..modules.telemetry import Telemetry

CONVERTER_NAME = "quantize.linear.nvfp4"
GROUPED_CONVERTER_NAME = "quantize.grouped_mm.nvfp4"


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


def require_backend_runs_here(recipe: NVFP4Recipe, section: str) -> None:
    """Check an explicit gemm_backend against this machine at conversion, not at the first forward after the
    whole model has been materialized."""
    if recipe.gemm_backend in ("auto", "reference"):
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolve_backend(recipe.gemm_backend, device)
    except RuntimeError as e:
        raise ValueError(f"[{section}] gemm_backend = {recipe.gemm_backend!r} cannot run here: {e}") from None


def _section(job_config: JobConfig, kind: str):
    """The parsed `[quantize.<kind>.nvfp4]` section; its defaults, with a warning, when the job file
    did not load our config module."""
    from .job_config import NVFP4GroupedMMConfig, NVFP4LinearConfig

    section = getattr(getattr(getattr(job_config, "quantize", None), kind, None), "nvfp4", None)
    if section is None:
        section = {"linear": NVFP4LinearConfig, "grouped_mm": NVFP4GroupedMMConfig}[kind]()
        logger.warning(
            f"[{section.SECTION}] section not available (set [job] custom_config_module = "
            f'"titan_nvfp4.integration.job_config"); using its defaults: {section}'
        )
    return section


def _n_blocks(model: nn.Module) -> int:
    """Number of transformer blocks (for bf16_first_blocks / bf16_last_blocks), 0 if unknown."""
    layers = getattr(model, "layers", None)
    return len(layers) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else 0


def warn_unmatched(section: str, key: str, patterns: list[str], fqns: list[str], what: str,
                   expected: tuple[str, ...] = ()) -> None:
    """Warn about each pattern of ``patterns`` (other than the ``expected`` defaults) that no fqn contains: a typo."""
    for p in patterns:
        if p not in expected and not any(p in f for f in fqns):
            logger.warning(f"[{section}] {key} pattern {p!r} matches no {what} of the model (a typo?): it has no effect")


def convert_linears(model: nn.Module, recipe: NVFP4Recipe, filter_fqns: list[str], lora_rank: int = 0,
                    lora_nvfp4: bool = False) -> dict[str, list]:
    """Swap every eligible nn.Linear of ``model`` in place (DecomposedLinear when ``lora_rank``);
    returns {"converted": [...], "skipped": [(fqn, why)]}."""
    n_blocks = _n_blocks(model)
    report: dict[str, list] = {"converted": [], "skipped": []}
    for fqn, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        why = skip_reason(fqn, filter_fqns, recipe, n_blocks)
        if why:
            report["skipped"].append((fqn, why))
            continue
        check_linear_dims(fqn, mod.in_features, mod.out_features)
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer_id = len(report["converted"])
        if lora_rank:
            check_lowrank_args(fqn, lora_rank, mod.in_features, mod.out_features, lora_nvfp4,
                               f"[{CONVERTER_NAME}] lora_rank")
            new = DecomposedLinear.from_linear(mod, recipe, layer_id, fqn, rank=lora_rank, lora_nvfp4=lora_nvfp4)
        else:
            new = NVFP4Linear.from_linear(mod, recipe, layer_id=layer_id, name=fqn)
        setattr(parent, child, new)
        report["converted"].append(fqn)
    return report


def _fsdp_all_gather_applies(parallel_dims: ParallelDims | None) -> bool:
    """Whether fsdp_nvfp4_all_gather = true takes effect here: FSDP2 shards the weights (with tensor
    parallelism too: each TP shard then gathers with the whole weight's tensor amax, fsdp_all_gather.py)."""
    key = f"[{CONVERTER_NAME}] fsdp_nvfp4_all_gather"
    if parallel_dims is None or not parallel_dims.fsdp_enabled:
        logger.info(f"NVFP4: {key} has no effect without FSDP (data_parallel_shard_degree = 1)")
        return False
    return True


class NVFP4LinearConverter(QuantizationConverter):
    """Converts dense Linears to NVFP4 per the `[quantize.linear.nvfp4]` section."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        super().__init__(job_config, parallel_dims)
        require_listed_once(job_config, CONVERTER_NAME)
        section = _section(job_config, "linear")
        self.recipe = section.build_recipe()
        require_backend_runs_here(self.recipe, CONVERTER_NAME)
        self.filter_fqns = list(section.filter_fqns)
        self.lora_rank, self.lora_nvfp4 = section.lora_rank, section.lora_nvfp4
        self.lora_refresh_steps, self.lora_dtype = section.lora_refresh_steps, section.lora_dtype
        self.fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
        require_lowrank_for_lora_dtype(job_config)
        # lora_refresh_moments = "project": the refresh finds the factors' optimizer state through this
        self.optimizer_states = shared_optimizer_states() if section.lora_refresh_moments == "project" else None
        self.bf16_after_fraction = section.bf16_after_fraction
        self.total_steps = job_config.training.steps
        self.nvfp4_all_gather = section.fsdp_nvfp4_all_gather and _fsdp_all_gather_applies(parallel_dims)
        self._traffic_logged = False
        self.telemetry_every = section.telemetry_every
        if self.telemetry_every:
            install_metrics_hook()
        self.amax_history = section.activation_amax_history
        if self.amax_history and parallel_dims is not None and parallel_dims.pp_enabled:
            raise ValueError(f"[{CONVERTER_NAME}] activation_amax_history = {self.amax_history} is not supported with "
                             f"pipeline parallelism (parallelism.pipeline_parallel_degree = {parallel_dims.pp}): "
                             "its one all-reduce per step needs the same layers on every rank; set it to 0")
        self.enabled = True

    def convert(self, model: nn.Module) -> None:
        from .job_config import DEFAULT_FILTER_FQNS

        check_block_counts(self.recipe, _n_blocks(model), CONVERTER_NAME)
        report = convert_linears(model, self.recipe, self.filter_fqns, self.lora_rank, self.lora_nvfp4)
        if not report["converted"] and any(isinstance(m, NVFP4Linear) for m in model.modules()):
            logger.info(f"NVFP4: [{CONVERTER_NAME}] the model is already converted: nothing to do")
            return  # converted twice: a no-op (the step counter and the logs stay the first conversion's)
        linears = report["converted"] + [fqn for fqn, _ in report["skipped"]]
        warn_unmatched(CONVERTER_NAME, "filter_fqns", self.filter_fqns, linears, "Linear", DEFAULT_FILTER_FQNS)
        if not report["converted"]:
            why = ("the model has no nn.Linear" if not linears else f"all {len(linears)} Linears kept in high precision, "
                   f"e.g. {report['skipped'][0][0]} by {report['skipped'][0][1]}")
            raise ValueError(f"[{CONVERTER_NAME}] converted no Linear layer ({why}); check filter_fqns, or drop "
                             f"{CONVERTER_NAME!r} from [model] converters")
        if self.nvfp4_all_gather:
            for fqn in report["converted"]:
                wrap_weight(model.get_submodule(fqn))
            logger.info(f"NVFP4: FSDP2 all-gathers the weights of {len(report['converted'])} Linear layers as NVFP4")
        lora = f", DecomposedLinear rank {self.lora_rank}" if self.lora_rank else ""
        logger.info(f"NVFP4: converted {len(report['converted'])} Linear layers with {self.recipe}{lora}")
        for fqn, why in report["skipped"]:
            logger.info(f"NVFP4: kept {fqn} in high precision ({why})")
        if self.lora_rank and report["converted"]:
            decompose_after_init(model)
        apply_lora_dtype(model, self.lora_dtype, self.fsdp)
        if self.amax_history:
            history = AmaxHistory(self.amax_history)
            for fqn in report["converted"]:
                register_buffers(model.get_submodule(fqn), history)
            logger.info(f"NVFP4: X of {len(report['converted'])} Linear layers quantized with the max amax of the "
                        f"last {self.amax_history} optimizer steps (activation_amax_history)")
        if self.bf16_after_fraction or self.lora_refresh_steps or self.telemetry_every:
            c = attach_step_counter(model, LINEAR_STEPS, [model.get_submodule(f) for f in report["converted"]],
                                    PrecisionSchedule(switch_step(self.bf16_after_fraction, self.total_steps)))
            log_switch_plan("Linear layers", c, self.bf16_after_fraction, self.total_steps)
            if self.telemetry_every:
                attach_telemetry(model, report["converted"], self.telemetry_every, c, "Linear layers",
                                 "nvfp4/<layer>/<operand>/<stat>")

    def post_optimizer_hook(self, model) -> None:
        """Push the step's activation amaxes into the histories; count the optimizer step; switch to high
        precision at bf16_after_fraction; re-decompose the low-rank modules every lora_refresh_steps; after
        the first step, log the NVFP4 all-gather's traffic on this rank; reduce the gathered weights' tile
        amaxes for their next all-gathers, all in one all-reduce (fsdp_all_gather.precompute_scales)."""
        if self.nvfp4_all_gather:
            first = not self._traffic_logged
            if first:
                self._traffic_logged = True
                logger.info(f"NVFP4: FSDP2 all-gather, first step on this rank: {TRAFFIC.summary(TRAFFIC.take())}")
            n = precompute_scales(model)
            if first:
                logger.info(f"NVFP4: after each optimizer step the tile amaxes of {n} NVFP4-gathered weights are "
                            "all-reduced at once (one all-reduce per FSDP group), ahead of their next all-gathers")
        if self.amax_history:
            roll(layers_with_history(model))
        for i, (part, counter) in enumerate(step_counters(model, LINEAR_STEPS)):
            if counter.step() and i == 0:
                logger.info(f"NVFP4: Linear layers switched to high precision after optimizer step {counter.count}")
            if self.lora_refresh_steps and counter.count % self.lora_refresh_steps == 0:
                states = self.optimizer_states
                done = redecompose(part, states.state_of if states else None)
                log_refresh(logger, done, counter.count, states is not None)


def attach_telemetry(model: nn.Module, converted: list[str], every: int, counter: StepCounter, what: str,
                     names: str) -> None:
    """Share one Telemetry (measured steps follow ``counter``) among the modules at the ``converted`` fqns."""
    telemetry = Telemetry(every, counter)
    for fqn in converted:
        model.get_submodule(fqn).telemetry = telemetry
    logger.info(f"NVFP4: telemetry of {len(converted)} {what} every {every} steps ({names} in the metrics)")


def log_switch_plan(what: str, counter: StepCounter, fraction: float, total_steps: int) -> None:
    if fraction:
        logger.info(f"NVFP4: {what} switch to high precision after optimizer step {counter.schedule.switch_step} "
                    f"(bf16_after_fraction = {fraction} of {total_steps} steps)")


def _init_weights_then_decompose(self, *args, **kwargs):
    """The model's own init_weights, then the SVD split of every DecomposedLinear's fresh weight."""
    out = type(self).init_weights(self, *args, **kwargs)
    redecompose(self)
    return out


def apply_lora_dtype(model: nn.Module, lora_dtype: str, fsdp: bool) -> None:
    """Run the low-rank branches converted so far in ``lora_dtype`` (either converter may run last); ``fsdp``:
    FSDP2 will shard the model, which takes one parameter dtype per module."""
    if lora_dtype != "input":
        log_lora_dtype(logger, set_lora_dtype(model, lora_dtype, one_dtype=fsdp), " converted so far")


def decompose_after_init(model: nn.Module) -> None:
    """Hook the decomposition into TorchTitan's init_weights protocol: TorchTitan materializes the
    meta model, then calls model.init_weights(), which now splits each DecomposedLinear's weight
    after initializing it. A bound method (not a closure), so pipeline parallelism's deep copies of
    the model call it on their own copy."""
    if not hasattr(type(model), "init_weights"):
        raise ValueError(f"lora_rank needs a model with init_weights (TorchTitan's protocol); {type(model).__name__} "
                         "has none: call DecomposedLinear.decompose_() after initializing the weights")
    model.init_weights = types.MethodType(_init_weights_then_decompose, model)


def convert_experts(model: nn.Module, recipe: NVFP4Recipe, fqns: list[str], lora_rank: int = 0) -> dict[str, list]:
    """Swap (in place) every routed-expert module whose name contains one of ``fqns`` (with per-expert
    low-rank factors when ``lora_rank``)."""
    from .experts import EXPERT_CLASSES

    n_blocks = _n_blocks(model)
    report: dict[str, list] = {"converted": [], "skipped": []}
    for fqn, mod in list(model.named_modules()):
        cls = EXPERT_CLASSES.get(type(mod))
        if cls is None:
            continue
        if not any(f in fqn for f in fqns):
            report["skipped"].append((fqn, f"not in fqns {fqns}"))
            continue
        why = skip_reason(fqn, [], recipe, n_blocks)
        if why:
            report["skipped"].append((fqn, why))
            continue
        cls.convert(mod, recipe, layer_id=experts_layer_id(len(report["converted"])), name=fqn,
                    lora_rank=lora_rank)
        report["converted"].append(fqn)
    return report


class NVFP4GroupedMMConverter(QuantizationConverter):
    """Converts routed MoE experts to NVFP4 per the `[quantize.grouped_mm.nvfp4]` section, and aligns
    TorchTitan's token groups to 16 so that wgrad blocks along tokens stay inside one expert."""

    lora_rank: int = 0

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        super().__init__(job_config, parallel_dims)
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m

        require_listed_once(job_config, GROUPED_CONVERTER_NAME)
        section = _section(job_config, "grouped_mm")
        self.recipe = section.build_recipe()
        require_backend_runs_here(self.recipe, GROUPED_CONVERTER_NAME)
        self.fqns = list(section.fqns)
        self.lora_rank = section.lora_rank
        self.lora_dtype = _section(job_config, "linear").lora_dtype  # the dense section's knob covers the experts
        self.fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
        require_lowrank_for_lora_dtype(job_config)
        self.bf16_after_fraction = section.bf16_after_fraction
        self.total_steps = job_config.training.steps
        self.telemetry_every = section.telemetry_every
        if self.telemetry_every:
            install_metrics_hook()
        set_token_group_alignment_size_m(16)
        self.enabled = True

    def convert(self, model: nn.Module) -> None:
        check_block_counts(self.recipe, _n_blocks(model), GROUPED_CONVERTER_NAME)
        from .experts import EXPERT_CLASSES

        report = convert_experts(model, self.recipe, self.fqns, self.lora_rank)
        if not report["converted"] and any(isinstance(m, tuple(EXPERT_CLASSES.values())) for m in model.modules()):
            logger.info(f"NVFP4: {GROUPED_CONVERTER_NAME}: the experts are already converted: nothing to do")
            return  # converted twice: a no-op, as for the Linear converter
        if report["converted"]:
            experts = report["converted"] + [fqn for fqn, _ in report["skipped"]]
            warn_unmatched(GROUPED_CONVERTER_NAME, "fqns", self.fqns, experts, "routed-expert module")
        if not report["converted"]:
            raise ValueError(
                f"{GROUPED_CONVERTER_NAME}: no routed-expert module matched fqns {self.fqns} "
                f"(skipped: {report['skipped'] or 'the model has no GroupedExperts / GptOssGroupedExperts'})"
            )
        lora = f", per-expert low-rank branch rank {self.lora_rank}" if self.lora_rank else ""
        logger.info(f"NVFP4: converted {len(report['converted'])} expert modules with {self.recipe}{lora}; "
                    "token groups aligned to 16")
        if self.lora_rank:
            decompose_after_init(model)
        apply_lora_dtype(model, self.lora_dtype, self.fsdp)
        for fqn, why in report["skipped"]:
            logger.info(f"NVFP4: kept experts {fqn} in high precision ({why})")
        if self.bf16_after_fraction or self.telemetry_every:
            c = attach_step_counter(model, GROUPED_STEPS, [model.get_submodule(f) for f in report["converted"]],
                                    PrecisionSchedule(switch_step(self.bf16_after_fraction, self.total_steps)))
            log_switch_plan("experts", c, self.bf16_after_fraction, self.total_steps)
            if self.telemetry_every:
                attach_telemetry(model, report["converted"], self.telemetry_every, c, "expert modules",
                                 "nvfp4/<experts>/<weight>/<operand>/<stat>")

    def post_optimizer_hook(self, model) -> None:
        """Count the optimizer step (telemetry steps follow it); switch the experts to high precision at
        bf16_after_fraction."""
        for i, (_, counter) in enumerate(step_counters(model, GROUPED_STEPS)):
            if counter.step() and i == 0:
                logger.info(f"NVFP4: experts switched to high precision after optimizer step {counter.count}")


if CONVERTER_NAME not in _registry_model_converter_cls:
    register_model_converter(NVFP4LinearConverter, CONVERTER_NAME)
if GROUPED_CONVERTER_NAME not in _registry_model_converter_cls:
    register_model_converter(NVFP4GroupedMMConverter, GROUPED_CONVERTER_NAME)

from . import flavors  # noqa: E402,F401  (registers the llama3 "2B_bench" flavor beside the converter)
from . import torchtitan_fixes  # noqa: E402

torchtitan_fixes.apply()
