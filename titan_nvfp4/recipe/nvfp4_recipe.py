"""The NVFP4 training recipe: one dataclass holding every numerics switch, and named presets.

Presets are TOML files in the repo's configs/ directory (installed as ``titan_nvfp4.configs``);
a job file picks one with ``recipe = "nvidia_paper"`` and may override any field next to it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


@dataclass(frozen=True)
class NVFP4Recipe:
    """What each NVFP4 GEMM does (defaults: the NVIDIA report's recipe, every block in NVFP4)."""

    weight_2d: bool = True
    """16×16 weight blocks, so forward and dgrad read one quantized weight (else 1×16 along K for
    forward and 1×16 along N for dgrad)."""
    stochastic_rounding: bool = True
    """Stochastic rounding of dY in dgrad and wgrad (else nearest-even)."""
    rht: bool = True
    """16-point random Hadamard transform on both wgrad operands along the token dim."""
    rht_seed: int = 0
    """Seed of the RHT sign vector, identical on every rank."""
    rht_round_to_input_dtype: bool = False
    """Round the transformed wgrad operands to their input's dtype (bf16 under TorchTitan) before their amax
    and quantization, as Transformer Engine does, for codes bit-identical to its NVFP4 quantizer; else they
    stay fp32 (docs/numerics.md measures both)."""
    sr_seed: int = 0
    """Base seed of the stochastic-rounding streams (mixed with layer index and call count)."""
    bf16_first_blocks: int = 0
    """Keep the Linears of the first N transformer blocks in BF16."""
    bf16_last_blocks: int = 0
    """Keep the Linears of the last N transformer blocks in BF16."""
    gemm_backend: str = "auto"
    """NVFP4 GEMM implementation: auto | reference | emulated | native (auto: native on sm_100+, emulated on
    other GPUs, reference on CPU; titan_nvfp4.ops.gemm)."""
    backward: str = "nvfp4"
    """Precision of the two backward GEMMs of the dense Linears: "nvfp4" (the recipe above), "mxfp8"
    (dY, W and X in MXFP8, 1×32 blocks along each contraction dim, nearest-even) or "bf16" (the input's
    dtype). The forward stays NVFP4. With "mxfp8" / "bf16" forward saves X in its dtype, not in FP4."""
    block_scale_rule: str = "six"
    """How each block's E4M3 scale is chosen: "six" (the block max maps to 6, the NVIDIA recipe) or
    "four_over_six" (per block, max to 6 or to 4, whichever encodes the block with lower error; the
    tensor scale then targets 6·256: arXiv 2512.02010, numerics/nvfp4.py). Applies to every NVFP4
    operand: weights, activations and gradients."""

    eager_graphs: str = "off"
    """Eager mode only: "small" replays each NVFP4Linear's forward and backward kernels as one CUDA graph
    per layer and shape when small (M·(K+N) ≤ 2^26, M·K·N ≤ 2^35: the host-bound debug-model sizes; body_graphs.py), and so each
    routed-expert grouped GEMM's on the grouped kernels (N: the outputs of its weights together; not under
    expert or tensor parallelism); "off" launches them one by one. The same bits either way; "small" keeps
    each such layer's staged operands allocated between steps. Under torch.compile inductor's own CUDA
    graphs serve instead."""

    staged_expert_activations: bool = True
    """MoE grouped experts on the emulated backend: keep the wgrad operands of the routed tokens X and of
    the SwiGLU output h between forward and backward as the emulated GEMM's fp16 values (exact q·e_b)
    instead of NVFP4 codes. Backward then skips a staging pass per operand (0.2–0.4 ms of a
    DeepSeek-V3-16B-like expert block on an H100, ``benchmarks/bench_grouped.py``) at 2 bytes per
    saved element instead of 0.56, what a BF16 block saves of X and h. The same bits either way."""
    requantize_expert_weights: bool = False
    """MoE grouped experts on the emulated backend: quantize the expert weights again in backward for dgrad
    instead of keeping forward's Wᵀ codes in between (about half a byte per expert parameter, which a BF16
    block does not hold: 0.78 GiB of a 3-MoE-block DeepSeek-V3-16B-shaped job) at the price of one more
    quantizing read of the weights per step. The same bits either way."""

    ms_eden: bool = False
    """Quartet II's backward (arXiv 2601.22813): dY, and W and X re-read from their forward quantization, each
    rotated by a random Hadamard transform of rht_size along its GEMM's inner dim (dgrad and wgrad) with signs
    redrawn every backward call, then quantized with MS-EDEN (nearest codes, unbiased stochastic scales:
    numerics/ms_eden.py) instead of stochastic rounding. Dense Linears; needs rht = true, stochastic_rounding = false."""
    rht_size: int = 16
    """Size of the backward random Hadamard transform: 16 (the NVIDIA recipe, wgrad only), or 32, 64, 128 with
    ms_eden (both backward GEMMs; also MS-EDEN's correction group; Quartet II ran 128)."""

    osci_reset_every: int = 0
    """TetraJet-v2's OsciReset (arXiv 2510.27527): every N optimizer steps a window opens in which each converted
    Linear's weight elements that oscillate between two FP4 values are found; the step after it, their master
    weights are set to their current FP4 value (0 = off; the authors ran 200 to 400). N >= osci_reset_window + 2.
    Dense Linears only."""
    osci_reset_window: int = 50
    """OsciReset: the optimizer steps over which each element's movement is summed (the authors' 50)."""
    osci_reset_threshold: float = 8.0
    """OsciReset: an element counts as oscillating when its FP4 value moved more than this many times as far as its
    master weight over the window, both summed over the steps (the authors' released runs: 8; their code: 16)."""
    osci_reset_start_fraction: float = 0.0
    """OsciReset: windows open from this fraction of training.steps on (0 = from step osci_reset_every; the
    authors' runs started at 0.59 to 0.69, in the learning-rate decay)."""

    outcontrol_fraction: float = 0.0
    """TetraJet-v2's OutControl (arXiv 2510.27527): this fraction of each dense Linear's input channels, those with the
    largest ‖X[:, k]‖₂ summed over the window's forwards, run in MXFP8 instead of NVFP4 once selected (after
    outcontrol_start + outcontrol_steps optimizer steps; static from then on). Rounded to a multiple of 32 channels
    (upwards), at most in_features. 0 = off; the authors' released runs: 0.1. Dense Linears only."""
    outcontrol_start: int = 500
    """OutControl: the window of forwards whose ‖X[:, k]‖₂ is summed opens after this many optimizer steps (the
    authors' iteration 501 is the forward of step 501, after 500 steps)."""
    outcontrol_steps: int = 50
    """OutControl: the window's length in optimizer steps; the channels are selected after its last step."""

    sr_block_scale: str = "nearest"
    """Block scales of the stochastically rounded dY (dgrad and wgrad; dense and experts): "nearest" (published), or
    "up" so no element clips at 6 and SR is unbiased (≈20% more error per draw; docs/configuration.md). Needs SR on."""

    @property
    def four_over_six(self) -> bool:
        return self.block_scale_rule == "four_over_six"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            validate_field(f.name, getattr(self, f.name))
        validate_combination(self)


#: gemm_backend values (titan_nvfp4.ops.backends resolves them on a device)
BACKEND_NAMES = ("auto", "reference", "emulated", "native")
_BOOL_FIELDS = ("weight_2d", "stochastic_rounding", "rht", "rht_round_to_input_dtype", "staged_expert_activations",
                "requantize_expert_weights", "ms_eden")
BACKWARDS = ("nvfp4", "mxfp8", "bf16")
BLOCK_SCALE_RULES = ("six", "four_over_six")
EAGER_GRAPHS = ("off", "small")
_INT_FIELDS = ("rht_seed", "sr_seed", "bf16_first_blocks", "bf16_last_blocks", "osci_reset_every",
               "outcontrol_start")
RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(NVFP4Recipe))
#: rht_size values (the MS-EDEN kernels' Hadamard sizes)
RHT_SIZES = (16, 32, 64, 128)
#: fields that apply to the dense Linears only: the routed experts refuse values other than their defaults
DENSE_ONLY_FIELDS = ("ms_eden", "rht_size", "osci_reset_every", "osci_reset_window",
                     "osci_reset_threshold", "osci_reset_start_fraction", "outcontrol_fraction", "outcontrol_start",
                     "outcontrol_steps")
#: the OsciReset keys that need osci_reset_every > 0
OSCI_RESET_KEYS = ("osci_reset_window", "osci_reset_threshold", "osci_reset_start_fraction")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(NVFP4Recipe)}


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def validate_field(name: str, value: Any, where: str = "quantize.linear.nvfp4") -> None:
    """Raise a ValueError naming the key and value unless ``value`` is valid for recipe field ``name``."""
    if name not in RECIPE_FIELDS:
        raise ValueError(f"[{where}] unknown recipe key {name!r}; valid keys: {', '.join(RECIPE_FIELDS)}")
    if name in _BOOL_FIELDS and not isinstance(value, bool):
        raise ValueError(f"[{where}] {name} must be true or false, got {value!r}")
    if name in _INT_FIELDS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        zero = " (0 = off)" if name == "osci_reset_every" else ""
        raise ValueError(f"[{where}] {name} must be a non-negative integer{zero}, got {value!r}")
    if name in ("rht_seed", "sr_seed") and value >= 2**63:
        raise ValueError(f"[{where}] {name} must be below 2**63 (it seeds an int64 generator), got {value!r}")
    if name == "backward" and value not in BACKWARDS:
        raise ValueError(f"[{where}] backward must be one of {list(BACKWARDS)}, got {value!r}")
    if name == "block_scale_rule" and value not in BLOCK_SCALE_RULES:
        raise ValueError(f"[{where}] block_scale_rule must be one of {list(BLOCK_SCALE_RULES)}, got {value!r}")
    if name == "eager_graphs" and value not in EAGER_GRAPHS:
        raise ValueError(f"[{where}] eager_graphs must be one of {list(EAGER_GRAPHS)}, got {value!r}")
    if name == "outcontrol_fraction" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or not 0 <= value < 1):
        raise ValueError(f"[{where}] outcontrol_fraction must be a number in [0, 1) (0 = off), got {value!r}")
    if name == "outcontrol_steps" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"[{where}] outcontrol_steps must be a positive integer, got {value!r}")
    if name == "sr_block_scale":
        from ..numerics.nvfp4 import SR_BLOCK_SCALES  # here: numerics brings torch, which a spec's reader needs not

        if value not in SR_BLOCK_SCALES:
            raise ValueError(f"[{where}] sr_block_scale must be one of {list(SR_BLOCK_SCALES)}, got {value!r}")
    if name == "gemm_backend" and value not in BACKEND_NAMES:
        raise ValueError(f"[{where}] gemm_backend must be one of {list(BACKEND_NAMES)}, got {value!r}")
    if name == "rht_size" and (isinstance(value, bool) or value not in RHT_SIZES):
        raise ValueError(f"[{where}] rht_size must be one of {list(RHT_SIZES)}, got {value!r}")
    if name == "osci_reset_window" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"[{where}] osci_reset_window must be a positive integer, got {value!r}")
    if name == "osci_reset_threshold" and not (_number(value) and 0 < value < float("inf")):
        raise ValueError(f"[{where}] osci_reset_threshold must be a positive finite number, got {value!r}")
    if name == "osci_reset_start_fraction" and not (_number(value) and 0 <= value < 1):
        raise ValueError(f"[{where}] osci_reset_start_fraction must be a number in [0, 1), got {value!r}")


def validate_combination(recipe: "NVFP4Recipe | SimpleNamespace", where: str = "quantize.linear.nvfp4") -> None:
    """Raise a ValueError naming the keys unless the recipe's fields make sense together."""
    if recipe.ms_eden:
        if not recipe.rht:
            raise ValueError(f"[{where}] ms_eden = true needs rht = true (MS-EDEN is unbiased through the random "
                             "Hadamard rotation of every backward operand)")
        if recipe.stochastic_rounding:
            raise ValueError(f"[{where}] ms_eden = true replaces stochastic rounding of the gradients: set "
                             "stochastic_rounding = false (the preset quartet2 does)")
        if recipe.backward != "nvfp4":
            raise ValueError(f"[{where}] ms_eden = true quantizes an NVFP4 backward; backward = {recipe.backward!r} "
                             "runs it in higher precision: set one of them")
    elif recipe.rht_size != 16:
        raise ValueError(f"[{where}] rht_size = {recipe.rht_size} needs ms_eden = true (the stochastic-rounding "
                         "backward transforms the wgrad operands with 16-point RHT kernels)")
    if recipe.sr_block_scale == "up" and not recipe.stochastic_rounding:
        raise ValueError(f"[{where}] sr_block_scale = 'up' needs stochastic_rounding = true: it rounds up the block "
                         "scales of the stochastically rounded gradients, and with stochastic_rounding = false there "
                         "are none (it would do nothing)")
    every = recipe.osci_reset_every
    if not every:
        for key in OSCI_RESET_KEYS:
            if getattr(recipe, key) != _DEFAULTS[key]:
                raise ValueError(f"[{where}] {key} = {getattr(recipe, key)!r} needs osci_reset_every > 0 (it sets "
                                 "the OsciReset windows)")
    elif every < recipe.osci_reset_window + 2:
        raise ValueError(f"[{where}] osci_reset_every = {every} needs to be at least osci_reset_window + 2 = "
                         f"{recipe.osci_reset_window + 2}: a window of {recipe.osci_reset_window} steps opens every "
                         f"{every} steps and resets the step after it")


def dense_only_values(recipe: NVFP4Recipe) -> dict[str, Any]:
    """The dense-only fields of ``recipe`` set to other than their defaults (DENSE_ONLY_FIELDS)."""
    return {k: getattr(recipe, k) for k in DENSE_ONLY_FIELDS if getattr(recipe, k) != _DEFAULTS[k]}


def _configs_package() -> ModuleType:
    """``titan_nvfp4.configs``: installed (a wheel, an editable install), or the repo's configs/ folder when
    the package runs from a source tree on PYTHONPATH (as on the GPU machines)."""
    try:
        from .. import configs
    except ImportError:
        init = Path(__file__).resolve().parents[2] / "configs" / "__init__.py"
        if not init.is_file():
            raise
        spec = importlib.util.spec_from_file_location("titan_nvfp4.configs", init,
                                                      submodule_search_locations=[str(init.parent)])
        configs = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = configs
        spec.loader.exec_module(configs)
    return configs


def _shipped(folder: str = "") -> dict[str, "Traversable"]:
    return _configs_package().shipped(folder)  # imported lazily: needed only when a preset is named


def available_presets() -> list[str]:
    """Names of the recipe presets shipped with the package."""
    return sorted(_shipped())


def shipped_compare_specs() -> dict[str, "Traversable"]:
    """The comparison specs shipped with the package (``configs/compare/<name>.toml``), by name."""
    return _shipped("compare")


#: the keys a preset may set beside NVFP4Recipe's fields: the late precision switch, a knob of the config section
#: (knobs.py, which checks the values) that belongs to how some recipes train (NVIDIA, arXiv 2509.25149)
SCHEDULE_KEYS = ("bf16_after_fraction", "bf16_after_scope")


def load_preset(name: str) -> dict[str, Any]:
    """The recipe fields of preset ``name`` (a shipped name, or a path to a .toml file)."""
    return {k: v for k, v in _read_preset(name).items() if k not in SCHEDULE_KEYS}


def preset_schedule(name: str) -> dict[str, Any]:
    """The precision switch preset ``name`` sets (its SCHEDULE_KEYS present in the file; {} for most presets)."""
    return {k: v for k, v in _read_preset(name).items() if k in SCHEDULE_KEYS}


def _read_preset(name: str) -> dict[str, Any]:
    """Every key of preset ``name`` but its description, the recipe fields checked."""
    path = Path(name)
    if name.endswith(".toml") and path.is_file():
        source = str(path)
        try:
            text = path.read_bytes()
        except OSError as e:
            raise ValueError(f"[quantize.linear.nvfp4] recipe file {path}: cannot read it ({e.strerror})") from None
    else:
        shipped = _shipped()
        if name not in shipped:
            if path.is_dir() or path.is_file():
                raise ValueError(f"[quantize.linear.nvfp4] recipe {name!r} is a " + ("folder" if path.is_dir() else
                                 "file not ending in .toml") + ": a recipe file is a path ending in .toml")
            raise ValueError(f"[quantize.linear.nvfp4] unknown recipe {name!r}; available: {available_presets()}"
                             + (" (no such .toml file either)" if name.endswith(".toml") else ""))
        source, text = f"{name}.toml", shipped[name].read_bytes()
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"[quantize.linear.nvfp4] recipe file {source}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"[quantize.linear.nvfp4] recipe file {source}: invalid TOML: {e}") from None
    data.pop("description", None)
    for key, value in data.items():
        if key not in SCHEDULE_KEYS:
            validate_field(key, value, where=f"recipe preset {source}")
    return data


def build_recipe(preset: str | None, overrides: dict[str, Any], where: str = "quantize.linear.nvfp4") -> NVFP4Recipe:
    """A recipe from a preset (or the dataclass defaults) with explicit overrides on top; errors name ``where``."""
    if not isinstance(overrides, dict):
        raise TypeError(f"build_recipe: overrides must be a dict of recipe keys, got {type(overrides).__name__}")
    fields = load_preset(preset) if preset else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    for key, value in fields.items():
        validate_field(key, value, where)
    validate_combination(SimpleNamespace(**{**_DEFAULTS, **fields}), where)  # before __post_init__: names ``where``
    return NVFP4Recipe(**fields)
