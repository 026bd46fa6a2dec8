"""The knobs of the NVFP4 config sections, defined once for every TorchTitan generation (imports no TorchTitan).

`RecipeKnobs` holds the recipe preset and one override per `NVFP4Recipe` field, generated from the dataclass
(type `T | None`, default None = the preset's value, help = the field's docstring), so a new recipe field costs
one place. `LinearKnobs` adds the dense-only keys, `GroupedKnobs` the grouped-only ones; each checks its values
in `__post_init__`, which TorchTitan's parsers (TOML in 0.2, tyro in both) run before anything starts.
"""

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from ..numerics.lowrank import check_rank
from .nvfp4_recipe import NVFP4Recipe, build_recipe, dense_only_values, preset_schedule, validate_field

DEFAULT_FILTER_FQNS = ("output", "router.gate", "shared_experts")  # TorchTitan 0.2's LM head is `output`


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of class ``cls``, by name ({} when its source is not available)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclass(kw_only=True, slots=True)
class _Preset:
    """The recipe preset."""

    SECTION: ClassVar[str] = "quantize.linear.nvfp4"

    recipe: str = "nvidia_paper"
    """Preset from configs/ (nvidia_paper, quartet2, tetrajet2, nvidia_paper_selective, naive_rtn) or a path to a
    .toml."""


def _overrides_class() -> type:
    """A dataclass below `_Preset` with a `T | None = None` field per NVFP4Recipe field; tyro reads each field's
    help from the generated class docstring's Attributes section (docstring_parser)."""
    hints = typing.get_type_hints(NVFP4Recipe)
    docs = field_docs(NVFP4Recipe)
    names = [f.name for f in dataclasses.fields(NVFP4Recipe)]
    cls = dataclasses.make_dataclass(
        "RecipeOverrides", [(n, Optional[hints[n]], field(default=None)) for n in names],
        bases=(_Preset,), kw_only=True, slots=True)
    lines = ["Overrides of the preset's recipe fields (None: the preset's value).", "", "Attributes:"]
    for n in names:
        text = " ".join(docs.get(n, "").split()) or f"NVFP4Recipe.{n}."
        lines.append(f"    {n}: {text} Unset: the preset's value.")
    cls.__doc__ = "\n".join(lines)
    cls.__module__, cls.__qualname__ = __name__, "RecipeOverrides"
    return cls


RecipeOverrides = _overrides_class()


#: lora_refresh_moments values
REFRESH_MOMENTS = ("keep", "project")
#: lora_dtype values
LORA_DTYPES = ("input", "float32")
#: bf16_after_scope values: what the bf16_after_fraction switch moves to high precision (NVIDIA, arXiv 2509.25149)
SWITCH_FORWARD_BACKWARD, SWITCH_FORWARD = "forward_backward", "forward"
SWITCH_SCOPES = (SWITCH_FORWARD_BACKWARD, SWITCH_FORWARD)


def _nonneg_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


@dataclass(kw_only=True, slots=True)
class RecipeKnobs(RecipeOverrides):
    """The recipe preset and per-field overrides, shared by the dense and the grouped sections."""

    bf16_after_fraction: Optional[float] = None
    """Switch this section's NVFP4 layers to high precision (BF16 under TorchTitan's mixed precision)
    for the last fraction of training.steps (0 = never; 1 = from the start, a control arm with the
    same modules). Unset: the preset's, else 0."""
    bf16_after_scope: Optional[str] = None
    """What the bf16_after_fraction switch moves to high precision: "forward_backward", all three GEMMs (the
    layers then run F.linear); "forward", the forward GEMM only, while dgrad and wgrad keep the NVFP4 recipe
    (NVIDIA, arXiv 2509.25149). Dense Linears only; needs bf16_after_fraction > 0. Unset: the preset's, else
    "forward_backward"."""

    def switch(self) -> tuple[float, str]:
        """The section's precision switch (bf16_after_fraction, bf16_after_scope): each key as set here, else as the
        preset sets it, else 0 (never) and "forward_backward"."""
        preset = preset_schedule(self.recipe)
        fraction = self.bf16_after_fraction
        scope = self.bf16_after_scope
        return (preset.get("bf16_after_fraction", 0.0) if fraction is None else fraction,
                preset.get("bf16_after_scope", SWITCH_FORWARD_BACKWARD) if scope is None else scope)

    def _origin(self, key: str) -> str:
        """Where the switch key ``key`` comes from, for an error message: "" when set in the section."""
        return "" if getattr(self, key) is not None else f" (from the recipe {self.recipe!r})"

    def _check_fqns(self, key: str) -> None:
        value = getattr(self, key)
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"[{self.SECTION}] {key} must be a list of strings, got {value!r}")
        if any(not s.strip() for s in value):
            raise ValueError(f"[{self.SECTION}] {key} holds an empty pattern, which every module name contains: "
                             f"got {value!r}")

    def _check_count(self, key: str, what: str = "a non-negative integer") -> None:
        value = getattr(self, key)
        if not _nonneg_int(value):
            raise ValueError(f"[{self.SECTION}] {key} must be {what}, got {value!r}")

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str) or not self.recipe.strip():
            raise ValueError(f"[{self.SECTION}] recipe must be a preset name or a path to a .toml file, "
                             f"got {self.recipe!r}")
        f, scope = self.switch()  # reads the preset's file: an unknown preset fails here, at parse time
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"[{self.SECTION}] bf16_after_fraction must be a number in [0, 1], got {f!r}"
                             f"{self._origin('bf16_after_fraction')}")
        if scope not in SWITCH_SCOPES:
            raise ValueError(f"[{self.SECTION}] bf16_after_scope must be one of {list(SWITCH_SCOPES)}, got "
                             f"{scope!r}{self._origin('bf16_after_scope')}")
        # a preset's scope is inert when the section turns its switch off (bf16_after_fraction = 0)
        if scope != SWITCH_FORWARD_BACKWARD and not f and self.bf16_after_scope is not None:
            raise ValueError(f"[{self.SECTION}] bf16_after_scope = {scope!r} needs bf16_after_fraction > 0 (it sets "
                             "what that switch moves to high precision)")
        for name, value in self.overrides().items():
            validate_field(name, value, self.SECTION)
        self.build_recipe()  # the preset's fields with the overrides: a bad combination fails here

    def overrides(self) -> dict:
        """The recipe fields set explicitly in the job file."""
        names = [f.name for f in dataclasses.fields(NVFP4Recipe)]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def build_recipe(self) -> NVFP4Recipe:
        return build_recipe(self.recipe, self.overrides(), self.SECTION)


@dataclass(kw_only=True, slots=True)
class LinearKnobs(RecipeKnobs):
    """Dense nn.Linear layers."""

    GROUPED_SECTION: ClassVar[str] = "quantize.grouped_mm.nvfp4"

    filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))
    """Linears whose fully qualified name contains one of these strings stay BF16 (default: the LM
    head, MoE router gates and shared experts; drop "shared_experts" to convert those too)."""
    lora_rank: int = 0
    """DecomposedLinear: keep the top-r singular directions of every converted Linear's weight in a
    high-precision branch beside the NVFP4 residual (0 = off; else a multiple of 16)."""
    lora_nvfp4: bool = False
    """Run the branch's two GEMMs in NVFP4 too (default: the input's dtype, BF16 in training)."""
    lora_dtype: str = "input"
    """The high-precision branch's precision (the experts' branch too): "input", GEMMs in the input's dtype (BF16
    under mixed precision), the factors stored like the weights; "float32", the factors stored (so trained, Adam
    moments included) in FP32 whatever the model's dtype, e.g. gpt_oss's BF16 blocks, the GEMMs in FP32 and their
    sum with R's output taken in FP32 (under FSDP2 the weights must be FP32 too, and its BF16 parameters
    all-gather the factors in BF16)."""
    lora_refresh_steps: int = 0
    """Re-decompose every N optimizer steps (0 = only at initialization). With lora_refresh_moments "keep",
    AdamW's moments keep describing the old split, which cost loss in docs/results.md (DecomposedLinear)."""
    lora_refresh_moments: str = "keep"
    """What a refresh does to the factors' Adam moments: "keep" them as they are, or "project" them onto the
    new split (from the residual's moments, which estimate W's gradient: numerics/lowrank.py project_moments)."""
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
        s = self.SECTION
        self._check_fqns("filter_fqns")
        check_rank(self.lora_rank, s)
        if not isinstance(self.lora_nvfp4, bool):
            raise ValueError(f"[{s}] lora_nvfp4 must be true or false, got {self.lora_nvfp4!r}")
        if self.lora_nvfp4 and not self.lora_rank:
            raise ValueError(f"[{s}] lora_nvfp4 = true needs lora_rank > 0 (it sets how the dense low-rank branch runs)")
        self._check_count("lora_refresh_steps")
        if self.lora_refresh_steps and not self.lora_rank:
            raise ValueError(f"[{s}] lora_refresh_steps = {self.lora_refresh_steps} needs lora_rank > 0")
        if self.lora_refresh_moments not in REFRESH_MOMENTS:
            raise ValueError(f"[{s}] lora_refresh_moments must be one of {list(REFRESH_MOMENTS)}, got "
                             f"{self.lora_refresh_moments!r}")
        if self.lora_refresh_moments != "keep" and not self.lora_refresh_steps:
            raise ValueError(f"[{s}] lora_refresh_moments = {self.lora_refresh_moments!r} needs lora_refresh_steps > 0")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"[{s}] lora_dtype must be one of {list(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.lora_dtype != "input" and self.lora_nvfp4:
            raise ValueError(f"[{s}] lora_dtype = {self.lora_dtype!r} sets the dtype of a high-precision branch; "
                             "lora_nvfp4 = true runs the branch in NVFP4: set one of them")
        self._check_count("telemetry_every")
        self._check_count("activation_amax_history", "a non-negative integer (0 = off)")
        if not isinstance(self.fsdp_nvfp4_all_gather, bool):
            raise ValueError(f"[{s}] fsdp_nvfp4_all_gather must be true or false, got {self.fsdp_nvfp4_all_gather!r}")
        for key in ("staged_expert_activations", "requantize_expert_weights"):
            if getattr(self, key) is not None:
                raise ValueError(f"[{s}] {key} applies to the routed experts only: set it in [{self.GROUPED_SECTION}]")
        RecipeKnobs.__post_init__(self)  # slots=True: no zero-argument super()
        recipe = self.build_recipe()
        self._check_all_gather(recipe)
        self._check_osci_reset(recipe)
        self._check_outcontrol(recipe)

    def _check_osci_reset(self, recipe: NVFP4Recipe) -> None:
        """OsciReset's own values are recipe fields (nvfp4_recipe.py); here what it cannot be combined with."""
        if recipe.osci_reset_every and self.fsdp_nvfp4_all_gather:
            raise ValueError(f"[{self.SECTION}] osci_reset_every = {recipe.osci_reset_every} cannot be combined with "
                             "fsdp_nvfp4_all_gather = true yet (the reset writes the sharded weights whose NVFP4 codes "
                             "the all-gather keeps)")

    def _check_outcontrol(self, recipe: NVFP4Recipe) -> None:
        """OutControl (outcontrol_fraction, TetraJet-v2) with the keys it cannot run with, refused by name; its window
        keys set without it, too (they would change nothing)."""
        s, f = self.SECTION, recipe.outcontrol_fraction
        if not f:
            for key in ("outcontrol_start", "outcontrol_steps"):
                if getattr(self, key) is not None and getattr(self, key) != getattr(NVFP4Recipe, key):
                    raise ValueError(f"[{s}] {key} = {getattr(self, key)!r} needs outcontrol_fraction > 0 (it sets the "
                                     "OutControl window)")
            return
        clash = [(k, v) for k, v, on in (
            ("fsdp_nvfp4_all_gather", "true", self.fsdp_nvfp4_all_gather),
            ("lora_rank", self.lora_rank, self.lora_rank)) if on]
        if clash:
            key, value = clash[0]
            why = {"fsdp_nvfp4_all_gather": "the gathered NVFP4 codes hold every input channel in FP4",
                   "lora_rank": "the low-rank layers' residual has no channel split"}[key]
            raise ValueError(f"[{s}] outcontrol_fraction = {f} cannot be combined with {key} = {value} yet ({why})")

    def _check_all_gather(self, recipe: NVFP4Recipe) -> None:
        if not self.fsdp_nvfp4_all_gather:
            return
        s = self.SECTION
        if not recipe.weight_2d:
            raise ValueError(f"[{s}] fsdp_nvfp4_all_gather = true needs weight_2d = true (16x16 weight "
                             "blocks: the gathered codes then serve forward and dgrad alike)")
        fraction = self.switch()[0]
        if fraction:
            raise ValueError(f"[{s}] fsdp_nvfp4_all_gather = true cannot be combined with bf16_after_fraction "
                             f"= {fraction}{self._origin('bf16_after_fraction')}: FSDP2 keeps the all-gather "
                             "buffers of the first step (packed codes), so the weights cannot switch to a BF16 "
                             "all-gather mid-run")
        if recipe.four_over_six:
            raise ValueError(f"[{s}] fsdp_nvfp4_all_gather = true does not support block_scale_rule = "
                             "\"four_over_six\" yet (a tile's choice needs the error of all its rows, which "
                             "straddle shards); use block_scale_rule = \"six\" or the BF16 all-gather")
        if recipe.backward != "nvfp4":
            raise ValueError(f"[{s}] fsdp_nvfp4_all_gather = true needs backward = \"nvfp4\" (an MXFP8 or "
                             f"BF16 backward reads the high-precision weight), got {recipe.backward!r}")


#: why each dense-only recipe field stays off for the routed experts
_DENSE_ONLY_WHY = {
    "ms_eden": "the grouped GEMMs have no MS-EDEN backward yet",
    "rht_size": "the grouped GEMMs transform with 16-point RHT kernels",
    "osci_reset_every": "OsciReset applies to the dense Linears only",
    "outcontrol_fraction": "OutControl applies to the dense Linears only",
}


@dataclass(kw_only=True, slots=True)
class GroupedKnobs(RecipeKnobs):
    """Routed MoE experts."""

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
        f, scope = self.switch() if isinstance(self.recipe, str) and self.recipe.strip() else (0.0, None)
        if scope == SWITCH_FORWARD and (self.bf16_after_scope is not None or f):
            raise ValueError(f"[{self.SECTION}] bf16_after_scope = {scope!r}{self._origin('bf16_after_scope')}: the "
                             "routed experts switch forward and backward together (their grouped GEMMs have no "
                             f"forward-only mode): set {SWITCH_FORWARD_BACKWARD!r} here (titan_nvfp4.convert: pass "
                             "experts as a dict without it), or bf16_after_fraction = 0; the dense Linears take "
                             "'forward' in [quantize.linear.nvfp4]")
        self._check_fqns("fqns")
        check_rank(self.lora_rank, self.SECTION)
        self._check_count("telemetry_every")
        RecipeKnobs.__post_init__(self)
        self._check_dense_only(self.build_recipe())
        backward = self.build_recipe().backward
        if backward != "nvfp4":
            raise ValueError(f"[{self.SECTION}] backward = {backward!r}: the experts run an NVFP4 "
                             "backward only (set it in [quantize.linear.nvfp4] for the dense Linears)")

    def _check_dense_only(self, recipe: NVFP4Recipe) -> None:
        """Refuse the dense-only recipe fields (DENSE_ONLY_FIELDS) by name, set here or by the preset."""
        for key, value in dense_only_values(recipe).items():
            origin = "" if getattr(self, key) is not None else f" (from the recipe {self.recipe!r})"
            why = _DENSE_ONLY_WHY.get(key, "it applies to the dense Linears only")
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ValueError(f"[{self.SECTION}] {key} = {shown}{origin}: {why} (set it in [quantize.linear.nvfp4]); "
                             "for the experts leave it unset, with a preset without it (e.g. recipe = \"nvidia_paper\")")
