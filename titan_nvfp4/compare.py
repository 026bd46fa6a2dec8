"""Loss-convergence comparisons in one command: arms of TorchTitan overrides on one base job file, run
with the same seed and data one after another, then a table, a CSV and a plot.

    python -m titan_nvfp4.compare configs/compare/llama3_debug.toml [--only ARM ...] [--rerun] [--report-only] [--out DIR]
    python -m titan_nvfp4.compare llama3_debug          # a spec shipped with the package, by name

Job-file paths in a spec are relative to the current directory: run it from a titan-nvfp4 checkout.

The spec (TOML):

    [compare]
    base = "train_configs/llama3_nvfp4.toml"   # the job file every arm starts from
    steps = 1000                               # --training.steps of every arm
    out = "outputs/compare/llama3_debug"       # logs, table, CSV and plot
    last = 20                                  # logged steps averaged for the final loss
    baseline = "bf16"                          # Δ is against this arm (default: the first)
    reference = "nvfp4"                        # optional: the gap baseline–reference each arm closes
    common = ["--metrics.log_freq", "10"]      # overrides for every arm
    launcher = ["torchrun", "--standalone", "--nproc_per_node=1", "-m", "torchtitan.train"]   # the default (a free port each)
    timeout_s = 0                              # per arm (0: none)
    mode = "compile+cudagraphs"                # or "compile", or "eager" (an arm may set its own); see Modes
    parallel = 1                               # arms at once, each on its own GPU (arm slot i on GPU i % GPUs)
    checkpoint_interval = 0                    # > 0: checkpoint every N steps; running the spec again resumes
    module = ""                                # TorchTitan 0.3: the config registry; base names are its configs

    [[arm]]
    name = "bf16"
    base = "train_configs/llama3_bf16.toml"    # an arm may start from another job file
    [[arm]]
    name = "nvfp4"                             # no overrides: the base job as it is
    [[arm]]
    name = "no_rht"
    overrides = ["--quantize.linear.nvfp4.rht", "False"]

Modes: ``compile+cudagraphs`` (the fastest on a GPU) runs each arm with ``--compile.enable`` and
TORCHINDUCTOR_CUDAGRAPHS=1 (Inductor's CUDA graph trees, which remove the host time of the NVFP4 launches);
``compile`` without the graphs; ``eager`` neither. ``--mode`` on the command line overrides the spec's. With no
mode given an arm runs ``compile+cudagraphs``.

With ``parallel = N`` (or ``--parallel N``) N arms train at once, slot i pinned to visible GPU i modulo the
GPU count (several slots may share a GPU). With ``checkpoint_interval = N`` each arm checkpoints every N steps
under its dump folder (TorchTitan's DCP: model, optimizer, schedule, data position), and an arm stopped
before ``steps`` (``timeout_s``, a lost machine) resumes from its latest checkpoint when the spec runs again,
its log continued; later log lines for a step win. ``timeout_s`` stops an arm's whole process group.

TorchTitan 0.3 (a config registry instead of job files): ``module = "titan_nvfp4.integration_v03.configs"``, and
each ``base`` names a config of it (``base = "llama3_debug_nvfp4"``); an arm runs ``--module M --config BASE``.

An arm whose log already reached ``steps`` is not run again unless ``--rerun`` (``--only`` picks arms). Losses
come from the arm's log (TorchTitan's metric lines, tools/loss_log.py); when the log has none (a job
that logs elsewhere) from the TensorBoard events under its dump folder (``--metrics.enable_tensorboard``).
W&B: add ``--metrics.enable_wandb`` to ``common``; ``wandb_offline = true`` in ``[compare]`` sets
WANDB_MODE=offline, which needs no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .recipe.nvfp4_recipe import shipped_compare_specs
from .tools.cli import fail, parser
from .tools.loss_log import (StepMetrics, parse_log, parse_validation, summarize, tensorboard_run, to_markdown,
                             validation_markdown, write_csv)

DEFAULT_LAUNCHER = ("torchrun", "--standalone", "--nproc_per_node=1", "-m", "torchtitan.train")
_KEYS = {"base", "steps", "out", "last", "baseline", "reference", "common", "launcher", "timeout_s", "wandb_offline",
         "mode", "parallel", "checkpoint_interval", "module"}
# mode -> (TorchTitan flags, TORCHINDUCTOR_CUDAGRAPHS)
MODES = {"compile+cudagraphs": (("--compile.enable",), "1"), "compile": (("--compile.enable",), "0"), "eager": ((), "0")}
DEFAULT_MODE = "compile+cudagraphs"


@dataclass
class Arm:
    name: str
    overrides: list[str] = field(default_factory=list)
    base: Path | None = None  # the spec's base when None (a config name under a module)
    mode: str | None = None   # the spec's mode when None


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

    def arm_mode(self, arm: Arm) -> str:
        """The mode asked for (the arm's, else the spec's), else DEFAULT_MODE."""
        return arm.mode or self.mode or DEFAULT_MODE

    def env(self, arm: Arm) -> dict[str, str]:
        """The variables an arm runs with on top of the runner's own."""
        env = {"TORCHINDUCTOR_CUDAGRAPHS": MODES[self.arm_mode(arm)][1]}
        if self.wandb_offline:
            env["WANDB_MODE"] = "offline"
        return env

    def log(self, arm: Arm) -> Path:
        return self.out / f"{arm.name}.log"

    def command(self, arm: Arm) -> list[str]:
        ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(self.checkpoint_interval),
                "--checkpoint.keep_latest_k", "2"] if self.checkpoint_interval else []
        base = str(arm.base or self.base)
        job = (["--module", self.module, "--config", base] if self.module else ["--job.config_file", base])
        dump = "--dump_folder" if self.module else "--job.dump_folder"  # 0.3 moved it to the top level
        return [*self.launcher, *job, "--training.steps", str(self.steps), dump, str(self.out / arm.name),
                *MODES[self.arm_mode(arm)][0], *ckpt, *self.common, *arm.overrides]


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings, got {value!r}")
    return value


def _mode(value, where: str) -> str:
    if value not in MODES:
        raise ValueError(f"{where} must be one of {', '.join(repr(m) for m in MODES)}, got {value!r}")
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
        bad = set(a) - {"name", "overrides", "base", "mode"}
        if bad:
            raise ValueError(f"{where}: arm {a['name']!r} has unknown keys {sorted(bad)}")
        if "/" in a["name"] or "\\" in a["name"] or a["name"].startswith(".") or a["name"] in [x.name for x in arms]:
            raise ValueError(f"{where}: arm name {a['name']!r} must be unique and a plain file name (no '/', no "
                             "leading '.')")
        if "base" in a and not isinstance(a["base"], str):
            raise ValueError(f"{where}: arm {a['name']!r} base must be a string (a job file path), got {a['base']!r}")
        arm_base = Path(a["base"]) if "base" in a else None
        if arm_base is not None and not top.get("module") and not arm_base.is_file():
            raise ValueError(f"{where}: arm {a['name']!r} base = {str(arm_base)!r}: no such job file (paths are relative to the current directory)")
        arms.append(Arm(a["name"], _str_list(a.get("overrides", []), f"{where}: arm {a['name']!r} overrides"), arm_base,
                        _mode(a.get("mode"), f"{where}: arm {a['name']!r} mode") if "mode" in a else None))
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
    timeout = top.get("timeout_s", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"{where}: [compare] timeout_s must be a non-negative number, got {timeout!r}")
    if "launcher" in top and not top["launcher"]:
        raise ValueError(f"{where}: [compare] launcher must name a command, got []")
    if not isinstance(top.get("wandb_offline", False), bool):
        raise ValueError(f"{where}: [compare] wandb_offline must be true or false")
    spec = Spec(base=base, steps=steps, out=Path(top.get("out", f"outputs/compare/{path.stem}")), arms=arms,
                last=last, baseline=top.get("baseline", "") or names[0], reference=top.get("reference", ""),
                common=_str_list(top.get("common", []), f"{where}: [compare] common"),
                launcher=_str_list(top.get("launcher", list(DEFAULT_LAUNCHER)), f"{where}: [compare] launcher"),
                timeout_s=timeout, wandb_offline=top.get("wandb_offline", False),
                mode=_mode(top["mode"], f"{where}: [compare] mode") if "mode" in top else None,
                parallel=_count(top, "parallel", 1, 1, where),
                checkpoint_interval=_count(top, "checkpoint_interval", 0, 0, where), module=top.get("module", ""))
    return spec


def check_arm_args(spec: Spec, where: str, arms: list[Arm] | None = None) -> None:
    """Parse each arm's job file and flags with TorchTitan's ConfigManager, as its run will, so that a misspelt or
    invalid override stops the comparison before any arm trains (only for a launcher that runs torchtitan.train)."""
    if not spec.launcher or spec.launcher[-1] != "torchtitan.train":
        return
    import contextlib
    import io

    from torchtitan.config import ConfigManager

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


def arm_metrics(spec: Spec, arm: Arm) -> list[StepMetrics]:
    log = spec.log(arm)
    steps = parse_log(log.read_text(errors="replace")) if log.is_file() else []
    return steps or tensorboard_run(spec.out / arm.name)[0]


def is_done(spec: Spec, arm: Arm) -> bool:
    steps = arm_metrics(spec, arm)
    return bool(steps) and steps[-1].step >= spec.steps


def _resumes(spec: Spec, arm: Arm) -> bool:
    """Whether the arm will load a checkpoint: checkpointing on and a step folder saved under its dump folder."""
    return spec.checkpoint_interval > 0 and any((spec.out / arm.name).glob("checkpoint/step-*"))


def run_arm(spec: Spec, arm: Arm, index: int, gpu: str | None = None) -> int:
    """Run one arm (on ``gpu`` when given), its output in its log; print one progress line when it ends.
    Returns the exit code (124 after ``timeout_s``, which stops the arm's whole process group)."""
    extra = spec.env(arm)
    if gpu is not None:
        extra["CUDA_VISIBLE_DEVICES"] = gpu
    if spec.parallel > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun leaves a one-process job every core's worth of OpenMP threads; N arms at once then oversubscribe
        # the host, and a host-bound arm slows (gpt_oss at seq 512, 4 arms on one host: NVFP4 56k -> 72.5k
        # tokens/s with 4 threads each, in part because the BF16 arms finished meanwhile)
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.parallel))
    env = {**os.environ, **extra}
    resume = _resumes(spec, arm)
    start = time.time()
    with open(spec.log(arm), "a" if resume else "w") as log:
        log.write("# " + " ".join([*(f"{k}={v}" for k, v in extra.items()), *spec.command(arm)]) + "\n")
        log.flush()
        proc = subprocess.Popen(spec.command(arm), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=spec.timeout_s or None)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = 124
        finally:
            _LIVE.discard(proc)
    steps = arm_metrics(spec, arm)
    last = f"step {steps[-1].step}, loss {steps[-1].loss:.4f}" if steps else "no metric lines"
    where = f" on GPU {gpu}" if gpu is not None else ""
    print(f"[{index}/{len(spec.arms)}] {arm.name}{where}: exit {rc} in {time.time() - start:.0f} s"
          f"{' (resumed)' if resume else ''}, {last}", flush=True)
    return rc


#: the arms' processes running now (each leads its own process group: a signal to the runner does not reach them)
_LIVE: set[subprocess.Popen] = set()


def _stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the arm's process group (torchrun and its workers), SIGKILL to what outlives the grace period."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _gpu_slots(parallel: int) -> list[str | None]:
    """The GPU of each of ``parallel`` slots: visible GPU i modulo the count; None (no pinning) for one slot
    or on a machine without CUDA."""
    if parallel == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        try:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        except ImportError:
            gpus = []
    return [gpus[i % len(gpus)] if gpus else None for i in range(parallel)]


def run_arms(spec: Spec, todo: list[tuple[int, Arm]]) -> list[str]:
    """Run ``todo`` (index, arm) with ``spec.parallel`` at a time; returns the names of the arms that failed."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    slots: queue.Queue = queue.Queue()
    for gpu in _gpu_slots(spec.parallel):
        slots.put(gpu)

    def one(item):
        i, arm = item
        gpu = slots.get()
        try:
            return arm.name, run_arm(spec, arm, i, gpu)
        finally:
            slots.put(gpu)

    import signal

    def stop(signum, frame):  # SIGTERM to the runner: stop like Ctrl-C, below
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        with ThreadPoolExecutor(max_workers=spec.parallel) as pool:
            try:
                return [name for name, rc in pool.map(one, todo) if rc]
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the arms' process groups go down with the runner
                for proc in list(_LIVE):
                    _stop_group(proc, grace_s=10)
                raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def report(spec: Spec) -> str:
    """Write <out>/compare.md, compare.csv and compare.png from the arms that logged; return the table."""
    order = [a for a in spec.arms if a.name == spec.baseline] + [a for a in spec.arms if a.name != spec.baseline]
    if spec.reference:  # the gap columns read the reference as the second run
        order = order[:1] + [a for a in order[1:] if a.name == spec.reference] + \
                [a for a in order[1:] if a.name != spec.reference]
    runs = {a.name: arm_metrics(spec, a) for a in order}
    missing = [n for n, s in runs.items() if not s]
    runs = {n: s for n, s in runs.items() if s}
    if spec.baseline not in runs:
        raise RuntimeError(f"the baseline arm {spec.baseline!r} has no logged steps in {spec.out}")
    validation = {n: parse_validation(spec.log(a).read_text(errors="replace")) for a in order
                  if (n := a.name) in runs and spec.log(a).is_file()}
    validation = {n: v for n, v in validation.items() if v}
    rows = summarize(runs, spec.last, gap=bool(spec.reference) and spec.reference in runs, validation=validation or None)
    table = to_markdown(rows, spec.last)
    if validation:
        table += "\n" + validation_markdown(validation)
    if missing:
        table += f"\nNo logged steps yet: {', '.join(missing)}\n"
    (spec.out / "compare.md").write_text(table)
    write_csv(runs, spec.out / "compare.csv")
    try:
        from .tools.loss_plot import plot_runs

        plot_runs(runs, spec.out / "compare.png", title=f"{spec.base.name}: {spec.steps} steps per arm")
    except ImportError:
        print("compare: no plot (matplotlib missing: pip install -e .[plot])", file=sys.stderr)
    return table


PROG = "python -m titan_nvfp4.compare"


def resolve_spec(name: str) -> Path:
    """A spec file: ``name`` if it is a file, else the shipped spec of that name (configs/compare/<name>.toml)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = shipped_compare_specs()
    if name not in shipped:
        fail(PROG, f"no such spec file: {name} (shipped specs: {', '.join(sorted(shipped))})")
    if isinstance(shipped[name], Path):
        return shipped[name]
    copy = Path(tempfile.mkdtemp(prefix="titan_nvfp4_compare_")) / shipped[name].name  # a zipped install
    copy.write_bytes(shipped[name].read_bytes())
    return copy


def main(argv: list[str] | None = None) -> int:
    ap = parser("titan_nvfp4.compare", __doc__)
    ap.add_argument("spec", help="a comparison spec (.toml file), or the name of a shipped one: "
                                 + ", ".join(sorted(shipped_compare_specs())))
    ap.add_argument("--only", nargs="+", default=None, metavar="ARM", help="run these arms and no others")
    ap.add_argument("--rerun", action="store_true", help="run arms that already reached the spec's steps again, afresh")
    ap.add_argument("--timeout-s", type=float, default=None, metavar="S",
                    help="stop each arm after S seconds, instead of the spec's timeout_s (a checkpointed arm resumes later)")
    ap.add_argument("--report-only", action="store_true", help="write the table and plot from existing logs")
    ap.add_argument("--out", type=Path, default=None, help="logs, table and plot here instead of [compare] out")
    ap.add_argument("--parallel", type=int, default=None, metavar="N",
                    help="arms at once, each on its own GPU, instead of the spec's parallel")
    ap.add_argument("--mode", choices=list(MODES), default=None,
                    help=f"how every arm runs, instead of the spec's mode (default {DEFAULT_MODE})")
    args = ap.parse_args(argv)
    args.spec = resolve_spec(args.spec)
    try:
        spec = load_spec(args.spec)
    except (ValueError, OSError) as e:
        fail(PROG, str(e))
    if args.out is not None:
        spec.out = args.out
    if args.timeout_s is not None:
        if not 0 <= args.timeout_s < float("inf"):
            fail(PROG, f"--timeout-s must be a non-negative number, got {args.timeout_s}")
        spec.timeout_s = args.timeout_s
    if args.parallel is not None:
        if args.parallel < 1:
            fail(PROG, f"--parallel must be >= 1, got {args.parallel}")
        spec.parallel = args.parallel
    if args.mode is not None:
        spec.mode = args.mode
        for arm in spec.arms:
            arm.mode = None
    names = [a.name for a in spec.arms]
    for n in args.only or []:
        if n not in names:
            fail(PROG, f"--only {n!r} is not an arm of {args.spec} ({names})")
    if not args.report_only:
        try:
            check_arm_args(spec, str(args.spec), [a for a in spec.arms if args.only is None or a.name in args.only])
        except ValueError as e:
            fail(PROG, str(e))
    spec.out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        todo = []
        for i, arm in enumerate(spec.arms, 1):
            if args.only is not None and arm.name not in args.only:
                continue
            if not args.rerun and is_done(spec, arm):
                print(f"[{i}/{len(spec.arms)}] {arm.name}: already reached step {spec.steps}", flush=True)
                continue
            if args.rerun:  # afresh: no resuming from an earlier run's checkpoints
                shutil.rmtree(spec.out / arm.name / "checkpoint", ignore_errors=True)
            todo.append((i, arm))
        failed = run_arms(spec, todo)
    try:
        print(report(spec), end="")
        print(f"compare: wrote {spec.out / 'compare.md'}, compare.csv, compare.png")
    except RuntimeError as e:  # the baseline has not logged yet (--only another arm, or it failed)
        print(f"compare: no table yet: {e}", file=sys.stderr)
    if failed:
        print(f"compare: arms that failed: {', '.join(failed)} (see their logs in {spec.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
