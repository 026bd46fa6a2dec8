"""The framework-free entry point, exported as ``titan_nvfp4.convert``: ``convert(model, recipe="nvidia_paper",
**knobs)`` swaps a model's nn.Linear layers (and, with ``experts``, its routed experts) for NVFP4 modules in place
and returns the model with the per-step object its training loop calls after each optimizer step. Works on
meta-device models. The knobs are the TOML section's, checked by the same code with the same messages; TorchTitan
0.2's converters call the functions below too."""

from __future__ import annotations

import dataclasses
import logging
import types

import torch
from torch import nn

from .distributed.fsdp_all_gather import wrap_weight
from .kernels import launch, precompile
from .modules.decomposed_linear import DecomposedLinear, check_lowrank_args, lora_dtype_without_rank, redecompose
from .modules.expert_groups import experts_layer_id
from .modules.layer_state import NVFP4LayerState
from .modules.nvfp4_linear import NVFP4Linear, check_linear_dims
from .ops.backends import resolve_backend
from .recipe.knobs import DEFAULT_FILTER_FQNS, GroupedKnobs, LinearKnobs
from .recipe.layer_selection import check_block_counts, skip_reason
from .recipe.nvfp4_recipe import DENSE_ONLY_FIELDS, NVFP4Recipe
from .training.step_state import SectionSteps, TrainingSteps, apply_lora_dtype

LOG = logging.getLogger("titan_nvfp4")

#: routed-expert module classes -> their NVFP4 classes (each with a ``convert(mod, recipe, layer_id, name,
#: lora_rank)`` classmethod); an integration registers the expert modules of its framework
EXPERT_CLASSES: dict[type, type] = {}


def register_experts(source: type, nvfp4: type) -> None:
    """Let ``convert_experts`` swap modules of class ``source`` for ``nvfp4``."""
    EXPERT_CLASSES[source] = nvfp4


def n_blocks(model: nn.Module) -> int:
    """Number of transformer blocks (``model.layers``, for bf16_first_blocks / bf16_last_blocks), 0 if unknown."""
    layers = getattr(model, "layers", None)
    return len(layers) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else 0


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


def start_precompile(recipe: NVFP4Recipe, log=LOG, experts: bool = False) -> None:
    """Compile the shipped kernel specializations for this GPU in the background while the model is built
    (kernels/precompile.py), when this run launches Triton kernels on a CUDA GPU. ``experts``: called for NVFP4
    grouped experts (the Linears' call leaves out the kernels only those launch; the experts' call adds them)."""
    if recipe.gemm_backend == "reference":
        return
    launch.tune_threads()  # a bad TITAN_NVFP4_TUNE_THREADS is named now, not at the first autotuned launch
    if precompile.wanted(experts) and torch.cuda.is_available() and torch.version.hip is None:
        precompile.start(torch.cuda.current_device(), log, experts=experts)


def warn_unmatched(log, section: str, key: str, patterns: list[str], fqns: list[str], what: str,
                   expected: tuple[str, ...] = ()) -> None:
    """Warn about each pattern of ``patterns`` (other than the ``expected`` defaults) that no fqn contains: a typo."""
    for p in patterns:
        if p not in expected and not any(p in f for f in fqns):
            log.warning(f"[{section}] {key} pattern {p!r} matches no {what} of the model (a typo?): it has no effect")


def convert_linears(model: nn.Module, recipe: NVFP4Recipe, filter_fqns: list[str], lora_rank: int = 0,
                    lora_nvfp4: bool = False, section: str = LinearKnobs.SECTION) -> dict[str, list]:
    """Swap every eligible nn.Linear of ``model`` in place (DecomposedLinear when ``lora_rank``);
    returns {"converted": [...], "skipped": [(fqn, why)]}."""
    blocks = n_blocks(model)
    report: dict[str, list] = {"converted": [], "skipped": []}
    eligible = []
    for fqn, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        why = skip_reason(fqn, filter_fqns, recipe, blocks)
        if why:
            report["skipped"].append((fqn, why))
            continue
        check_linear_dims(fqn, mod.in_features, mod.out_features)
        if lora_rank:
            check_lowrank_args(fqn, lora_rank, mod.in_features, mod.out_features, lora_nvfp4, f"[{section}] lora_rank")
        eligible.append((fqn, mod))
    # every layer checked before the first swap: a refused conversion leaves the model as it was
    for layer_id, (fqn, mod) in enumerate(eligible):
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if lora_rank:
            new = DecomposedLinear.from_linear(mod, recipe, layer_id, fqn, rank=lora_rank, lora_nvfp4=lora_nvfp4)
        else:
            new = NVFP4Linear.from_linear(mod, recipe, layer_id=layer_id, name=fqn)
        setattr(parent, child, new)
        report["converted"].append(fqn)
    return report


def plan_experts(model: nn.Module, recipe: NVFP4Recipe, fqns: list[str]) -> tuple[list, list]:
    """The routed-expert modules ``convert_experts`` would swap, [(fqn, module, NVFP4 class)], and those it would
    skip, [(fqn, why)]; nothing is changed."""
    blocks = n_blocks(model)
    eligible, skipped = [], []
    for fqn, mod in list(model.named_modules()):
        cls = EXPERT_CLASSES.get(type(mod))
        if cls is None:
            continue
        if not any(f in fqn for f in fqns):
            skipped.append((fqn, f"not in fqns {fqns}"))
            continue
        why = skip_reason(fqn, [], recipe, blocks)
        if why:
            skipped.append((fqn, why))
            continue
        eligible.append((fqn, mod, cls))
    return eligible, skipped


def check_experts_match(knobs: GroupedKnobs, skipped: list) -> None:
    """Refuse an experts' section that would convert no module, naming what it skipped."""
    known = ", ".join(c.__name__ for c in EXPERT_CLASSES) or "none registered (import an integration)"
    raise ValueError(f"{knobs.SECTION}: no routed-expert module matched fqns {knobs.fqns} (skipped: "
                     f"{skipped or f'the model has no routed-expert module of a known class: {known}'})")


def convert_experts(model: nn.Module, recipe: NVFP4Recipe, fqns: list[str], lora_rank: int = 0) -> dict[str, list]:
    """Swap (in place) every registered routed-expert module whose name contains one of ``fqns`` (with per-expert
    low-rank factors when ``lora_rank``)."""
    eligible, skipped = plan_experts(model, recipe, fqns)
    report: dict[str, list] = {"converted": [], "skipped": skipped}
    for i, (fqn, mod, cls) in enumerate(eligible):
        cls.convert(mod, recipe, layer_id=experts_layer_id(i), name=fqn, lora_rank=lora_rank)
        report["converted"].append(fqn)
    return report


def _init_weights_then_decompose(self, *args, **kwargs):
    """The model's own init_weights, then the SVD split of every DecomposedLinear's fresh weight."""
    out = type(self).init_weights(self, *args, **kwargs)
    redecompose(self)
    return out


def decompose_after_init(model: nn.Module) -> None:
    """Hook the low-rank split into the model's init_weights (TorchTitan's protocol: the meta model is materialized,
    then model.init_weights() runs, which now splits each low-rank module's fresh weight). A bound method, not a
    closure, so pipeline parallelism's deep copies of the model call it on their own copy."""
    if not hasattr(type(model), "init_weights"):
        raise ValueError(f"lora_rank needs a model with init_weights (TorchTitan's protocol); {type(model).__name__} "
                         "has none: call titan_nvfp4.modules.decomposed_linear.redecompose(model) after initializing "
                         "the weights")
    model.init_weights = types.MethodType(_init_weights_then_decompose, model)


def _split_after_init(model: nn.Module, log) -> None:
    """The low-rank split of a model whose weights are still to be written: hooked into its init_weights when it
    has one; else, on meta, the caller splits after initializing (docs/plain_pytorch.md), which is logged."""
    if hasattr(type(model), "init_weights"):
        decompose_after_init(model)
    elif any(p.is_meta for p in model.parameters()):
        log.info("NVFP4: lora_rank on a meta model without init_weights: call "
                 "titan_nvfp4.modules.decomposed_linear.redecompose(model) after initializing its weights (a forward "
                 "before that raises, naming the layer)")


def convert_dense(model: nn.Module, knobs: LinearKnobs, steps: SectionSteps, log=LOG, *, one_dtype: bool = False,
                  on_telemetry=None, drop_hint: str = "leave the Linears unconverted") -> list[str]:
    """The dense section on ``model``: swap its Linears per ``knobs``, wrap their weights for the NVFP4 all-gather
    (when ``steps`` has it on), hook the low-rank split, set lora_dtype and attach the per-step state. Returns the
    converted fqns ([] when the model was already converted: a no-op); converting nothing is an error, whose message
    ends with ``drop_hint``."""
    section, recipe = knobs.SECTION, knobs.build_recipe()
    check_block_counts(recipe, n_blocks(model), section)
    report = convert_linears(model, recipe, list(knobs.filter_fqns), knobs.lora_rank, knobs.lora_nvfp4, section)
    if not report["converted"] and any(isinstance(m, NVFP4Linear) for m in model.modules()):
        log.info(f"NVFP4: [{section}] the model is already converted: nothing to do")
        return []
    if report["converted"]:
        start_precompile(recipe, log)
    linears = report["converted"] + [fqn for fqn, _ in report["skipped"]]
    warn_unmatched(log, section, "filter_fqns", knobs.filter_fqns, linears, "Linear", DEFAULT_FILTER_FQNS)
    if not report["converted"]:
        why = ("the model has no nn.Linear" if not linears else f"all {len(linears)} Linears kept in high precision, "
               f"e.g. {report['skipped'][0][0]} by {report['skipped'][0][1]}")
        raise ValueError(f"[{section}] converted no Linear layer ({why}); check filter_fqns, or {drop_hint}")
    modules = [model.get_submodule(fqn) for fqn in report["converted"]]
    if steps.nvfp4_all_gather:
        for m in modules:
            wrap_weight(m)
        log.info(f"NVFP4: FSDP2 all-gathers the weights of {len(modules)} Linear layers as NVFP4")
    lora = f", DecomposedLinear rank {knobs.lora_rank}" if knobs.lora_rank else ""
    log.info(f"NVFP4: converted {len(modules)} Linear layers with {recipe}{lora}")
    for fqn, why in report["skipped"]:
        log.info(f"NVFP4: kept {fqn} in high precision ({why})")
    if knobs.lora_rank:
        _split_after_init(model, log)
    apply_lora_dtype(model, knobs.lora_dtype, log, one_dtype=one_dtype, scope=" converted so far")
    steps.attach([model], [modules], on_telemetry)
    return report["converted"]


def convert_routed_experts(model: nn.Module, knobs: GroupedKnobs, steps: SectionSteps, log=LOG, *,
                           lora_dtype: str = "input", one_dtype: bool = False, on_telemetry=None) -> list[str]:
    """The experts' section on ``model``, as convert_dense for the Linears (``lora_dtype``: the dense section's knob,
    which covers the experts' branches too)."""
    section, recipe = knobs.SECTION, knobs.build_recipe()
    check_block_counts(recipe, n_blocks(model), section)
    report = convert_experts(model, recipe, list(knobs.fqns), knobs.lora_rank)
    if not report["converted"] and any(isinstance(m, tuple(EXPERT_CLASSES.values())) for m in model.modules()):
        log.info(f"NVFP4: {section}: the experts are already converted: nothing to do")
        return []
    if report["converted"]:
        start_precompile(recipe, log, experts=True)
        experts = report["converted"] + [fqn for fqn, _ in report["skipped"]]
        warn_unmatched(log, section, "fqns", knobs.fqns, experts, "routed-expert module")
    if not report["converted"]:
        check_experts_match(knobs, report["skipped"])
    lora = f", per-expert low-rank branch rank {knobs.lora_rank}" if knobs.lora_rank else ""
    log.info(f"NVFP4: converted {len(report['converted'])} expert modules with {recipe}{lora}; "
             "token groups aligned to 16")
    if knobs.lora_rank:
        _split_after_init(model, log)
    apply_lora_dtype(model, lora_dtype, log, one_dtype=one_dtype, scope=" converted so far")
    for fqn, why in report["skipped"]:
        log.info(f"NVFP4: kept experts {fqn} in high precision ({why})")
    steps.attach([model], [[model.get_submodule(f) for f in report["converted"]]], on_telemetry)
    return report["converted"]


def _knobs(cls: type, where: str, values: dict):
    """``cls(**values)`` with an unknown key refused by name, as TorchTitan's parser refuses it in a job file."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"[{cls.SECTION}] unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                         f" ({where}); valid keys: {', '.join(sorted(names))}")
    return cls(**values)


def convert(model: nn.Module, recipe: str = "nvidia_paper", *, experts: bool | dict = False, total_steps: int = 0,
            logger: logging.Logger | None = None, **knobs) -> tuple[nn.Module, TrainingSteps]:
    """Convert ``model`` in place for NVFP4 training; returns ``(model, steps)``: call ``steps.step()`` after every
    ``optimizer.step()``, and checkpoint ``steps`` beside the model and optimizer (a Stateful).

    ``recipe``: a preset (nvidia_paper, quartet2, tetrajet2, nvidia_paper_selective, naive_rtn) or a path to a .toml.
    ``knobs``: any key of the TOML section ``[quantize.linear.nvfp4]`` (recipe fields such as stochastic_rounding,
    ms_eden, osci_reset_every, and filter_fqns, lora_rank, bf16_after_fraction, bf16_after_scope,
    activation_amax_history, telemetry_every, ...: docs/configuration.md).
    ``experts``: also convert registered routed-expert modules (True: with the same recipe and recipe overrides; a
    dict: the keys of ``[quantize.grouped_mm.nvfp4]``). ``total_steps``: the run's optimizer steps, needed by
    bf16_after_fraction and osci_reset_start_fraction. Bad values raise a ValueError naming the key and the value."""
    log = logger or LOG
    done = next((n for n, m in model.named_modules() if isinstance(m, NVFP4LayerState)), None)
    if done is not None:
        raise ValueError(f"titan_nvfp4.convert: the model already holds NVFP4 layers (e.g. {done!r}) from an earlier "
                         "convert, whose per-step object drives them: convert a model once, keeping layers in high "
                         "precision with filter_fqns")
    linear = _knobs(LinearKnobs, "titan_nvfp4.convert keyword", {"recipe": recipe, **knobs})
    grouped = None
    if experts is not False and experts is not None:
        if experts is True:
            recipe_fields = {f.name for f in dataclasses.fields(NVFP4Recipe)} - set(DENSE_ONLY_FIELDS)
            experts = {k: v for k, v in knobs.items()
                       if k in recipe_fields or k in ("bf16_after_fraction", "bf16_after_scope")}
        elif not isinstance(experts, dict):
            raise ValueError(f"titan_nvfp4.convert: experts must be True, False or a dict of "
                             f"[{GroupedKnobs.SECTION}] keys, got {experts!r}")
        grouped = _knobs(GroupedKnobs, "titan_nvfp4.convert experts", {"recipe": recipe, **experts})
    if linear.lora_dtype != "input" and not linear.lora_rank and not (grouped and grouped.lora_rank):
        raise lora_dtype_without_rank(linear.SECTION, linear.lora_dtype, "here or in experts")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
        raise ValueError(f"titan_nvfp4.convert: total_steps must be a non-negative integer, got {total_steps!r}")
    require_backend_runs_here(linear.build_recipe(), linear.SECTION)
    sections = [SectionSteps(linear, total_steps, log, nvfp4_all_gather=linear.fsdp_nvfp4_all_gather)]
    if grouped is not None:  # checked before the Linears are swapped: a refused call leaves the model as it was
        require_backend_runs_here(grouped.build_recipe(), grouped.SECTION)
        check_block_counts(grouped.build_recipe(), n_blocks(model), grouped.SECTION)
        eligible, skipped = plan_experts(model, grouped.build_recipe(), list(grouped.fqns))
        if not eligible:
            check_experts_match(grouped, skipped)
        sections.append(SectionSteps(grouped, total_steps, log))
    convert_dense(model, linear, sections[0], log)
    if grouped is not None:
        convert_routed_experts(model, grouped, sections[1], log, lora_dtype=linear.lora_dtype)
    return model, TrainingSteps(model, [s for s in sections if s.per_step])


__all__ = ["EXPERT_CLASSES", "check_experts_match", "convert", "convert_dense", "convert_experts", "convert_linears",
           "convert_routed_experts", "decompose_after_init", "n_blocks", "plan_experts", "register_experts",
           "require_backend_runs_here", "start_precompile", "warn_unmatched"]
