"""A comparison spec: its TOML read and checked key by key, and the command and environment each arm runs with."""

from __future__ import annotations

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..corpus_pin import CORPUS_ENV_VAR, CORPUS_ID
from .paired import recipe_of, replicate_name

DEFAULT_LAUNCHER = ("torchrun", "--standalone", "--nproc_per_node=1", "-m", "torchtitan.train")
_KEYS = {"base", "steps", "out", "last", "baseline", "reference", "common", "launcher", "timeout_s", "wandb_offline",
         "mode", "parallel", "checkpoint_interval", "module", "paired_validations", "corpus", "target_se"}
_SEED_FLAG = "--debug.seed"
BRANCH_FLAG = "--checkpoint.initial_load_path"
# mode -> (TorchTitan flags, TORCHINDUCTOR_CUDAGRAPHS)
MODES = {"compile+cudagraphs": (("--compile.enable",), "1"), "compile": (("--compile.enable",), "0"), "eager": ((), "0")}
DEFAULT_MODE = "compile+cudagraphs"
#: the runner's own outputs in the out folder: no arm's log or dump folder may take their names
OUTPUTS = ("compare.md", "compare.csv", "compare.png")


@dataclass
class Arm:
    name: str
    overrides: list[str] = field(default_factory=list)
    base: Path | None = None  # the spec's base when None (a config name under a module)
    mode: str | None = None   # the spec's mode when None
    branch_from: str = ""  # the arm (of the same seed) whose checkpoint of ``branch_step`` this one starts from
    branch_step: int = 0


@dataclass
class Spec:
    base: Path
    steps: int
    out: Path
    arms: list[Arm]
    last: int = 20
    baseline: str = ""
    reference: str = ""
    common: list[str] = field(default_factory=list)
    launcher: list[str] = field(default_factory=lambda: list(DEFAULT_LAUNCHER))
    timeout_s: float = 0
    wandb_offline: bool = False
    mode: str | None = None   # None: DEFAULT_MODE
    parallel: int = 1
    checkpoint_interval: int = 0
    module: str = ""
    paired_validations: int = 1  # the paired table's statistic: the mean of each run's last K validation losses
    corpus: str = ""  # the corpus id every arm must train on ($TITAN_NVFP4_CORPUS in its environment): "" any
    target_se: float = 0.0  # the paired table's target standard error of a gap, in points: > 0 adds a line on it

    def arm_mode(self, arm: Arm) -> str:
        """The mode asked for (the arm's, else the spec's), else DEFAULT_MODE."""
        return arm.mode or self.mode or DEFAULT_MODE

    def env(self, arm: Arm) -> dict[str, str]:
        """The variables an arm runs with on top of the runner's own."""
        env = {"TORCHINDUCTOR_CUDAGRAPHS": MODES[self.arm_mode(arm)][1]}
        if self.wandb_offline:
            env["WANDB_MODE"] = "offline"
        if self.corpus:
            env[CORPUS_ENV_VAR] = self.corpus
        return env

    def by_name(self) -> dict[str, Arm]:
        """The arms by name, in the spec's order."""
        return {a.name: a for a in self.arms}

    def log(self, arm: Arm) -> Path:
        return self.out / f"{arm.name}.log"

    def dump(self, arm: Arm) -> Path:
        """The arm's dump folder: TensorBoard events, checkpoints, whatever else its trainer writes."""
        return self.out / arm.name

    def branch_point(self, parent: str, step: int) -> Path:
        """Where the runner keeps arm ``parent``'s checkpoint of ``step`` for the arms that branch from it (its own
        step folder goes when TorchTitan keeps only the latest ones)."""
        return self.out / parent / "branch" / f"step-{step}"

    def branches(self, parent: Arm) -> list[Arm]:
        """The arms that start from ``parent``'s checkpoint."""
        return [a for a in self.arms if a.branch_from == parent.name]

    def seed(self, arm: Arm) -> int | None:
        """The arm's ``--debug.seed``: the last one in its flags, else its job file's ``[debug] seed`` (None when
        neither says, e.g. under a config registry)."""
        words = [*self.common, *arm.overrides]
        for i in range(len(words) - 1, -1, -1):
            w = words[i]
            value = w.partition("=")[2] if w.startswith(_SEED_FLAG + "=") else \
                words[i + 1] if w == _SEED_FLAG and i + 1 < len(words) else None
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    return None
        return _job_seed(self.job_file(arm))

    def job_file(self, arm: Arm) -> Path | None:
        """The job file the arm starts from; None under a config registry (``module``: its base is a name)."""
        return None if self.module else (arm.base or self.base)

    def command(self, arm: Arm) -> list[str]:
        ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(self.checkpoint_interval),
                "--checkpoint.keep_latest_k", "2"] if self.checkpoint_interval else []
        base = str(arm.base or self.base)
        job = (["--module", self.module, "--config", base] if self.module else ["--job.config_file", base])
        dump = "--dump_folder" if self.module else "--job.dump_folder"  # 0.3 moved it to the top level
        if arm.branch_from:  # TorchTitan loads the whole training state there while the arm has no checkpoint
            # (absolute: TorchTitan 0.3 takes no other)
            ckpt += [BRANCH_FLAG, str(self.branch_point(arm.branch_from, arm.branch_step).absolute()),
                     "--checkpoint.no_initial_load_model_only"]
        return [*self.launcher, *job, "--training.steps", str(self.steps), dump, str(self.dump(arm)),
                *MODES[self.arm_mode(arm)][0], *ckpt, *self.common, *arm.overrides]


def _job_seed(job: Path | None) -> int | None:
    """A job file's ``[debug] seed`` (None without a job file, a readable one, or the key)."""
    if job is None:
        return None
    try:
        with open(job, "rb") as f:
            seed = tomllib.load(f).get("debug", {}).get("seed")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _replicates(arm: Arm, seeds, job: Path | None, where: str) -> list[Arm]:
    """An arm with ``seeds = [s1, s2, ...]``: one arm per seed, named "<name>", "<name>_seed2", ... (replicate i of
    the recipe, paired with every other recipe's replicate of the same seed), each with ``--debug.seed s`` after its
    overrides unless s is its job file's own seed (then its command is the plain arm's, whose finished log counts)."""
    if (not isinstance(seeds, list) or not seeds or len(set(map(repr, seeds))) != len(seeds)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds)):
        raise ValueError(f"{where}: arm {arm.name!r} seeds must be a non-empty list of distinct integers >= 0, "
                         f"got {seeds!r}")
    if recipe_of(arm.name) != arm.name:
        raise ValueError(f"{where}: arm {arm.name!r} has seeds, so its name may not end in _seedN (its replicates "
                         "take those names)")
    own = _job_seed(job)
    return [Arm(replicate_name(arm.name, i), arm.overrides + ([] if s == own else [_SEED_FLAG, str(s)]), arm.base,
                arm.mode, arm.branch_from, arm.branch_step) for i, s in enumerate(seeds)]


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings, got {value!r}")
    return value


def _mode(value, where: str) -> str:
    if value not in MODES:
        raise ValueError(f"{where} must be one of {', '.join(repr(m) for m in MODES)}, got {value!r}")
    return value


def _nonnegative(top: dict, key: str, where: str, what: str = "number") -> float:
    """``[compare] key``, a finite number >= 0 (default 0); ``what`` names it in the error."""
    value = top.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{where}: [compare] {key} must be a non-negative {what}, got {value!r}")
    return value


def _count(top: dict, key: str, default: int | None, low: int, where: str) -> int:
    value = top.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: [compare] {key} must be an integer >= {low}, got {value!r}")
    return value


def load_spec(path: Path) -> Spec:
    """Parse and check a comparison spec; errors name the file and the key."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    where = f"{path}"
    top = raw.get("compare")
    if not isinstance(top, dict):
        raise ValueError(f"{where}: needs a [compare] table")
    unknown = set(top) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown [compare] keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    extra = set(raw) - {"compare", "arm"}
    if extra:
        raise ValueError(f"{where}: unknown tables {sorted(extra)} (expected [compare] and [[arm]])")
    for key in ("base", "steps"):
        if key not in top:
            raise ValueError(f"{where}: [compare] {key} is required")
    for key in ("base", "out", "baseline", "reference", "module"):
        if key in top and not isinstance(top[key], str):
            raise ValueError(f"{where}: [compare] {key} must be a string, got {top[key]!r}")
    steps, last = _count(top, "steps", None, 1, where), _count(top, "last", 20, 1, where)
    if not isinstance(raw.get("arm", []), list):
        raise ValueError(f"{where}: arms are [[arm]] tables (an array of tables), got a single [arm] table")
    arms = []
    for i, a in enumerate(raw.get("arm", [])):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not a["name"]:
            raise ValueError(f"{where}: [[arm]] number {i + 1} needs a name")
        bad = set(a) - {"name", "overrides", "base", "mode", "seeds", "branch_from", "branch_step"}
        if bad:
            raise ValueError(f"{where}: arm {a['name']!r} has unknown keys {sorted(bad)}")
        if "/" in a["name"] or "\\" in a["name"] or a["name"].startswith(".") or a["name"] in [x.name for x in arms]:
            raise ValueError(f"{where}: arm name {a['name']!r} must be unique and a plain file name (no '/', no "
                             "leading '.')")
        if a["name"] in OUTPUTS:
            raise ValueError(f"{where}: arm name {a['name']!r} is the name of one of the runner's outputs {OUTPUTS}")
        if "base" in a and not isinstance(a["base"], str):
            raise ValueError(f"{where}: arm {a['name']!r} base must be a string (a job file path), got {a['base']!r}")
        arm_base = Path(a["base"]) if "base" in a else None
        if arm_base is not None and not top.get("module") and not arm_base.is_file():
            raise ValueError(f"{where}: arm {a['name']!r} base = {str(arm_base)!r}: no such job file (paths are relative to the current directory)")
        arm = Arm(a["name"], _str_list(a.get("overrides", []), f"{where}: arm {a['name']!r} overrides"), arm_base,
                  _mode(a.get("mode"), f"{where}: arm {a['name']!r} mode") if "mode" in a else None,
                  *_branch_keys(a, where))
        if "seeds" not in a:
            arms.append(arm)
            continue
        job = None if top.get("module") else arm_base or Path(top["base"])
        for rep in _replicates(arm, a["seeds"], job, where):
            if rep.name in [x.name for x in arms] or rep.name in OUTPUTS:
                raise ValueError(f"{where}: arm {a['name']!r} seeds: its replicate {rep.name!r} takes the name of "
                                 "another arm")
            arms.append(rep)
    if len(arms) < 2:
        raise ValueError(f"{where}: a comparison needs at least two [[arm]] tables, got {len(arms)}")
    names = [a.name for a in arms]
    for key in ("baseline", "reference"):
        if top.get(key) and top[key] not in names:
            raise ValueError(f"{where}: [compare] {key} = {top[key]!r} is not an arm ({names})")
    if top.get("reference") and top["reference"] == (top.get("baseline") or names[0]):
        raise ValueError(f"{where}: [compare] reference = {top['reference']!r} is the baseline arm: the gap needs two arms")
    base = Path(top["base"])
    if not top.get("module") and not base.is_file():
        raise ValueError(f"{where}: [compare] base = {str(base)!r}: " + ("a folder, not a job file" if base.is_dir() else
                         "no such job file (paths are relative to the current directory)"))
    timeout = _nonnegative(top, "timeout_s", where)
    if "launcher" in top and not top["launcher"]:
        raise ValueError(f"{where}: [compare] launcher must name a command, got []")
    if not isinstance(top.get("wandb_offline", False), bool):
        raise ValueError(f"{where}: [compare] wandb_offline must be true or false")
    corpus = top.get("corpus", "")
    if not (isinstance(corpus, str) and (corpus == "" or CORPUS_ID.fullmatch(corpus))):
        raise ValueError(f"{where}: [compare] corpus must be a corpus id (12 lowercase hex digits, as a job logs it "
                         f"for each split it reads), got {corpus!r}")
    target_se = _nonnegative(top, "target_se", where, "number of points (0: no target)")
    checkpoint_interval = _count(top, "checkpoint_interval", 0, 0, where)
    spec = Spec(base=base, steps=steps, out=Path(top.get("out", f"outputs/compare/{path.stem}")), arms=arms,
                last=last, baseline=top.get("baseline", "") or names[0], reference=top.get("reference", ""),
                common=_str_list(top.get("common", []), f"{where}: [compare] common"),
                launcher=_launcher(top, where),
                timeout_s=timeout, wandb_offline=top.get("wandb_offline", False),
                mode=_mode(top["mode"], f"{where}: [compare] mode") if "mode" in top else None,
                parallel=_count(top, "parallel", 1, 1, where),
                checkpoint_interval=checkpoint_interval, module=top.get("module", ""),
                paired_validations=_count(top, "paired_validations", 1, 1, where), corpus=corpus,
                target_se=float(target_se))
    _resolve_branches(spec, where)
    seeded = [a["name"] for a in raw.get("arm", []) if "seeds" in a]
    if seeded and any(w == _SEED_FLAG or w.startswith(_SEED_FLAG + "=") for w in spec.common):
        raise ValueError(f"{where}: [compare] common sets {_SEED_FLAG}, which would override the seed of arm "
                         f"{seeded[0]!r}'s seeds = [...] on the replicate that runs its job file's own seed: set the "
                         "seed in each arm's seeds or overrides")
    _distinct_replicates(spec, where)
    return spec


def _launcher(top: dict, where: str) -> list[str]:
    """[compare] launcher: a non-empty list of non-empty words (the command the job runs under)."""
    words = _str_list(top.get("launcher", list(DEFAULT_LAUNCHER)), f"{where}: [compare] launcher")
    if not words or not all(w.strip() for w in words):
        raise ValueError(f"{where}: [compare] launcher must be a non-empty list of non-empty words, got {words!r}")
    return words


def _distinct_replicates(spec: Spec, where: str) -> None:
    """Refuse two replicates of one recipe (arms "<recipe>", "<recipe>_seedN") on one seed: the paired table keys a
    recipe's statistic by seed and would keep only one of them."""
    seen: dict[tuple[str, int], str] = {}
    for arm in spec.arms:
        seed = spec.seed(arm)
        if seed is None:
            continue
        key = (recipe_of(arm.name), seed)
        if key in seen:
            raise ValueError(f"{where}: arms {seen[key]!r} and {arm.name!r} are both replicates of {key[0]!r} on seed "
                             f"{seed} (--debug.seed or the job file's [debug] seed): the paired table would keep one; "
                             "give them distinct seeds, or one a name that is not <recipe>_seedN")
        seen[key] = arm.name


def _branch_keys(a: dict, where: str) -> tuple[str, int]:
    """An [[arm]]'s ``branch_from`` (an arm name) and ``branch_step``, both or neither."""
    if ("branch_from" in a) != ("branch_step" in a):
        raise ValueError(f"{where}: arm {a['name']!r} needs both branch_from and branch_step, or neither")
    if "branch_from" not in a:
        return "", 0
    parent, step = a["branch_from"], a["branch_step"]
    if not isinstance(parent, str) or not parent:
        raise ValueError(f"{where}: arm {a['name']!r} branch_from must name an arm, got {parent!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{where}: arm {a['name']!r} branch_step must be an integer >= 1, got {step!r}")
    return parent, step


def _resolve_branches(spec: Spec, where: str) -> None:
    """Point each branching arm at its parent's replicate of the same seed, and check that the parent is a plain arm
    that saves a checkpoint at the branch step."""
    for arm in spec.arms:
        if not arm.branch_from:
            continue
        given = arm.branch_from
        if arm.branch_step >= spec.steps:
            raise ValueError(f"{where}: arm {arm.name!r} branch_step = {arm.branch_step} must be below [compare] "
                             f"steps = {spec.steps}")
        if not spec.checkpoint_interval or arm.branch_step % spec.checkpoint_interval:
            raise ValueError(f"{where}: arm {arm.name!r} branch_step = {arm.branch_step} must be a multiple of "
                             f"[compare] checkpoint_interval = {spec.checkpoint_interval} (the steps its parent saves)")
        seed = spec.seed(arm)
        if given in (arm.name, recipe_of(arm.name)):
            raise ValueError(f"{where}: arm {arm.name!r} branch_from = {given!r} branches from itself")
        parents = [a for a in spec.arms if given in (a.name, recipe_of(a.name))]
        same_seed = [a for a in parents if spec.seed(a) == seed]
        if not parents:
            raise ValueError(f"{where}: arm {arm.name!r} branch_from = {given!r} is not an arm")
        if not same_seed:
            raise ValueError(f"{where}: arm {arm.name!r} (seed {seed}) branches from {given!r}, which has no arm of "
                             f"seed {seed} (its seeds: {sorted(spec.seed(a) for a in parents)})")
        parent = same_seed[0]
        if parent.branch_from:
            raise ValueError(f"{where}: arm {arm.name!r} branches from {parent.name!r}, which branches itself")
        arm.branch_from = parent.name


def check_arm_args(spec: Spec, where: str, arms: list[Arm] | None = None) -> None:
    """Parse each arm's job file and flags with TorchTitan's ConfigManager, as its run will, so that a misspelt or
    invalid override stops the comparison before any arm trains (only for a launcher that runs torchtitan.train)."""
    if not spec.launcher or spec.launcher[-1] != "torchtitan.train":
        return
    import contextlib
    import io

    try:
        from torchtitan.config import ConfigManager
    except ImportError as e:
        raise ValueError(f"{where}: the arms run torchtitan.train, but TorchTitan does not import here ({e})") from None

    for arm in arms if arms is not None else spec.arms:
        args = spec.command(arm)[len(spec.launcher):]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ConfigManager().parse_args(args)
        except (SystemExit, ValueError, TypeError, KeyError) as e:
            text = err.getvalue() + ("" if isinstance(e, SystemExit) else str(e))
            lines = [ln.strip(" │╭╮╰╯─┃━-") for ln in text.splitlines()]
            message = " ".join(ln for ln in lines if ln and not ln.startswith(("For full helptext", "Run `")))
            raise ValueError(f"{where}: arm {arm.name!r}: TorchTitan rejects its arguments: {message}") from None
