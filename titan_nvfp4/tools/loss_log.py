"""Read per-step metrics from TorchTitan training runs and compare them.

    python -m titan_nvfp4.tools.loss_log outputs/llama3_bf16.log outputs/llama3_nvfp4.log [--last 20] [--markdown] [--gap]

Each run is a saved console log of a training run (``... 2>&1 | tee run.log``) or its dump folder
(``[job] dump_folder``) holding TensorBoard events (``--metrics.enable_tensorboard``). Parses TorchTitan's metric lines ("step: N  loss: X  grad_norm: G  memory: M GiB ... tps: T") and
validation lines ("validate step: N  loss: X"), colored or not. Prints per run the final loss (mean
over the last k logged steps), its difference to the first run with the standard error of that
difference (the mean of the per-step paired differences over the last k steps both logged: runs on the same
data share most of their batch-to-batch noise, and a run stopped early is compared at the steps it reached), throughput, peak memory, and the last validation loss with its
difference to the first run's at that step (with a validation set every run reads alike, this compares
runs whose training batches differ). ``--gap``: for the third run on, the share of the gap between the
first two runs (e.g. BF16 and plain NVFP4) that it closes (with ``--group``: of the first two groups' means, by
each later group, ± a delta-method standard error). ``--group NAME=PATTERN[,PATTERN]`` (repeated):
pool runs by name (fnmatch) into layouts and compare their validation losses across seeds: per group
and validated step the mean, standard deviation and range, and against the first group the difference
of the means with its standard error (Welch) and the share of cross-group pairs in which the group is lower.
``--train-windows 10-50,60-100`` adds the same table for each run's mean training loss over those steps:
comparable across groups only when they trained on the same batches (``titan_nvfp4.tools.emulated_dp``).
A RUN given as ``NAME=PATH`` takes that name (two logs of one file name). Each log or dump folder is read as one
run: a log with a rerun appended (``tee -a``) from where its last run restarts at step 1 (``split_log``), a dump
folder as its newest TensorBoard run (``tensorboard_runs``), with a note on stderr. ``--csv`` is written atomically and may not name an input.
"""

from __future__ import annotations

import fnmatch
import math
import re
import statistics
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_text
from .cli import fail, parser, require_output, writing

ANSI_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")
_FLOAT = r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"  # a garbled number is no metric line
_LINE = re.compile(
    rf"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_FLOAT})\s+grad_norm:\s*(?P<gn>{_FLOAT})"
    r"\s+memory:\s*(?P<mem>\d+\.?\d*)GiB.*?tps:\s*(?P<tps>\d[0-9,]*)"
)
#: the loss must be followed by whitespace (the line's end included): a line cut mid-number by a killed run is no value
_VALIDATION = re.compile(rf"validate step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_FLOAT})(?=\s)")


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    memory_gib: float  # max reserved since the previous logged step
    tps: int
    active_gib: float | None = None  # max active since the previous logged step (TensorBoard events only)


def parse_log(text: str) -> list[StepMetrics]:
    """Every metric line of the last training run in a TorchTitan log, in step order (see ``split_log``)."""
    return split_log(text)[-1].steps


def parse_validation(text: str) -> dict[int, float]:
    """Validation loss by step of the last training run in a log, from TorchTitan's "validate step: N  loss: X"
    lines (see ``split_log``)."""
    return split_log(text)[-1].validation


@dataclass
class LoggedRun:
    """One training run found in a log or a dump folder: its metrics in step order, its validation losses by
    step, and where it starts (``line`` of a log, 1-based; ``where`` in words: "line 57", or a TensorBoard folder)."""
    steps: list[StepMetrics]
    validation: dict[int, float]
    where: str
    line: int = 1


_STARTS = re.compile(r"Training starts at step (?P<step>\d+)")
_RANK = re.compile(r"^\[(?:rank|default)(?P<rank>\d+)\]:")  # torchrun --tee's prefix of each rank's lines


class _RunBuilder:
    """Records of one run, with TorchTitan's restart rules (``split_log``)."""

    def __init__(self, line: int, where: str):
        self.line, self.where = line, where
        self.steps: dict[int, StepMetrics] = {}
        self.validation: dict[int, float] = {}
        self.last_step = 0

    def empty(self) -> bool:
        return not self.steps and not self.validation

    def resume_at(self, step: int) -> None:
        """A resumed run goes on from ``step``: what the interrupted run logged from there on is dropped."""
        self.steps = {k: v for k, v in self.steps.items() if k < step}
        self.validation = {k: v for k, v in self.validation.items() if k < step}
        self.last_step = max(self.steps, default=0)

    def done(self) -> LoggedRun:
        return LoggedRun([self.steps[k] for k in sorted(self.steps)], dict(sorted(self.validation.items())),
                         self.where, self.line)


def split_log(text: str) -> list[LoggedRun]:
    """The training runs of a console log, oldest first, for logs that hold several (``tee -a``, a rerun into the
    same file). TorchTitan logs step 1 of every run, so "Training starts at step 1" after earlier records, or a
    metric line of step 1 after later steps, begins a new run (which may hold no step yet: a rerun that crashed at
    start). A resume from a checkpoint ("Training starts at step N" with N > 1, or the metric step count going
    back to N > 1) continues the run: its steps and validations from N on replace those the interrupted run
    logged. Within a run, a step logged twice (every rank printing its line) or validated twice keeps its later
    line. With torchrun's ``[rankN]:`` prefixes only the first rank seen is read. Readers take the last run, with
    a note: a rerun appended to an old log is the run just made, and one that crashed at step 120 must be
    reported at step 120, not completed by the old run's later steps (refusing the log would leave the user to
    cut it by hand)."""
    runs: list[LoggedRun] = []
    cur = _RunBuilder(1, "line 1")
    rank = None

    def restart(step: int, n: int) -> None:
        nonlocal cur
        if step > 1:
            cur.resume_at(step)
        elif not cur.empty():
            runs.append(cur.done())
            cur = _RunBuilder(n, f"line {n}")

    for n, line in enumerate(ANSI_ESCAPES.sub("", text).splitlines(keepends=True), 1):
        prefix = _RANK.match(line)
        if prefix:
            rank = prefix["rank"] if rank is None else rank
            if prefix["rank"] != rank:
                continue
        if (m := _STARTS.search(line)) is not None:
            restart(int(m["step"]), n)
        elif (m := _LINE.search(line)) is not None:
            s = StepMetrics(int(m["step"]), float(m["loss"]), float(m["gn"]), float(m["mem"]),
                            int(m["tps"].replace(",", "")))
            if s.step < cur.last_step:
                restart(s.step, n)
            cur.steps[s.step] = s
            cur.last_step = s.step
        elif (m := _VALIDATION.search(line)) is not None:
            cur.validation[int(m["step"])] = float(m["loss"])
    return [*runs, cur.done()]


def runs_note(path, runs: list[LoggedRun]) -> str | None:
    """What a reader says when ``path`` holds several runs and only the last is read (None for one run)."""
    if len(runs) < 2:
        return None
    return (f"{path} holds {len(runs)} training runs (a run restarts at step 1 at {', '.join(r.where for r in runs[1:])}): "
            f"reading only the last, from {runs[-1].where}")


def gap_closed_pct(baseline: float, reference: float, final: float) -> float:
    """100 · (reference − final) / (reference − baseline): 0 = no better than the reference run, 100 =
    as good as the baseline (NaN when the two coincide)."""
    gap = reference - baseline
    return 100.0 * (reference - final) / gap if gap else float("nan")


def paired_delta(steps: list[StepMetrics], base: list[StepMetrics], last: int) -> tuple[float, float, float]:
    """(mean, standard error, the base's mean loss) of the per-step loss difference to ``base`` over the last
    ``last`` steps both runs logged: for runs that logged the same steps, the difference of their final
    losses; for a run stopped early, against the base at the steps it reached (NaN where none are shared;
    the standard error NaN with fewer than two)."""
    ref = {s.step: s.loss for s in base}
    pairs = [(s.loss - ref[s.step], ref[s.step]) for s in steps if s.step in ref][-last:]
    if not pairs:
        return float("nan"), float("nan"), float("nan")
    diffs = [d for d, _ in pairs]
    mean = sum(diffs) / len(diffs)
    base_mean = sum(b for _, b in pairs) / len(pairs)
    if len(diffs) < 2:
        return mean, float("nan"), base_mean
    return mean, (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5, base_mean


def summarize(runs: dict[str, list[StepMetrics]], last: int = 10, gap: bool = False,
              validation: dict[str, dict[int, float]] | None = None, no_gap: Collection[str] = ()) -> list[dict]:
    """One row per run: steps, first/final loss (mean of the last k logged), Δ vs the first run and
    its paired standard error, tps, memory; with ``gap``, rows from the third on but those in ``no_gap``
    (runs not comparable with the first two) get gap_closed_pct against the first two; with ``validation``, runs that
    validated get val_step/val_loss (their last validation) and val_delta (against the first run's
    validation at that step, NaN if it has none)."""
    rows, base, base_steps = [], None, None
    for name, steps in runs.items():
        if not steps:
            raise ValueError(f"no TorchTitan metric lines found in {name}")
        tail = steps[-last:]
        final = sum(s.loss for s in tail) / len(tail)
        base = final if base is None else base
        base_steps = steps if base_steps is None else base_steps
        delta, delta_se, at = paired_delta(steps, base_steps, last) if steps is not base_steps else (0.0, 0.0, base)
        if delta != delta:  # no step in common with the base: the difference of the final losses, unpaired
            delta, at = final - base, base
        rows.append({
            "run": name,
            "steps": steps[-1].step,
            "first_loss": steps[0].loss,
            "final_loss": final,
            "delta": delta,
            "delta_se": delta_se,
            "rel_delta_pct": 100.0 * delta / at if at else float("nan"),
            "tps": sorted(s.tps for s in steps[1:] or steps)[len(steps[1:] or steps) // 2],
            "peak_memory_gib": max(s.memory_gib for s in steps),
        })
    if validation:
        base_val = validation.get(next(iter(runs)), {})
        for r in rows:
            val = validation.get(r["run"], {})
            if val:
                step = max(val)
                r.update(val_step=step, val_loss=val[step], val_delta=val[step] - base_val.get(step, float("nan")))
    if gap and len(rows) >= 3:
        for r in (r for r in rows[2:] if r["run"] not in no_gap):
            r["gap_closed_pct"] = gap_closed_pct(0.0, rows[1]["delta"], r["delta"])  # the paired Δs: same steps
    return rows


def to_markdown(rows: list[dict], last: int) -> str:
    gap = any("gap_closed_pct" in r for r in rows)
    val = any("val_loss" in r for r in rows)
    head = (f"| run | steps | first loss | final loss (mean of last {last} logged) | Δ vs {rows[0]['run']} ± paired s.e. | "
            + (f"gap to {rows[1]['run']} closed | " if gap else "")
            + ("validation loss (step) | Δ validation | " if val else "") + "tokens/s (median) | peak memory GiB |\n")
    head += "| --- | ---: | ---: | ---: | ---: | " + ("---: | " if gap else "") + ("---: | ---: | " if val else "") + "---: | ---: |\n"
    body = "".join(
        f"| {r['run']} | {r['steps']} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
        f"{r['delta']:+.4f} ± {r['delta_se']:.4f} ({r['rel_delta_pct']:+.2f}%) | "
        + ((f"{r['gap_closed_pct']:.1f}% | " if "gap_closed_pct" in r else "– | ") if gap else "")
        + ((f"{r['val_loss']:.4f} ({r['val_step']}) | {r['val_delta']:+.4f} | " if "val_loss" in r else "– | – | ") if val else "")
        + f"{r['tps']:,} | {r['peak_memory_gib']:.2f} |\n"
        for r in rows
    )
    return head + body


def validation_markdown(validation: dict[str, dict[int, float]]) -> str:
    """Validation loss of every run at every validated step, one row per run ("" when none validated)."""
    steps = sorted({s for v in validation.values() for s in v})
    if not steps:
        return ""
    head = "| run | " + " | ".join(f"validation loss @ {s}" for s in steps) + " |\n"
    head += "| --- |" + " ---: |" * len(steps) + "\n"
    return head + "".join(
        f"| {name} | " + " | ".join(f"{v[s]:.4f}" if s in v else "–" for s in steps) + " |\n"
        for name, v in validation.items()
    )


def group_members(runs, groups: list[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """Run names per group: each run joins the first group with a matching fnmatch pattern (or none)."""
    members: dict[str, list[str]] = {name: [] for name, _ in groups}
    for run in runs:
        for name, patterns in groups:
            if any(fnmatch.fnmatchcase(run, p) for p in patterns):
                members[name].append(run)
                break
    return members


def parse_group(spec: str) -> tuple[str, list[str]]:
    """``"NAME=PATTERN[,PATTERN]"`` -> (NAME, [PATTERN, ...])."""
    name, sep, patterns = spec.partition("=")
    if not sep or not name or not patterns:
        raise ValueError(f"--group {spec!r}: expected NAME=PATTERN[,PATTERN]")
    return name, patterns.split(",")


def pool_groups(values: dict[str, dict], groups: list[tuple[str, list[str]]], gap: bool = False) -> list[dict]:
    """Per-run values pooled per group (a run joins the first group with a matching pattern), at every key
    (a validated step, or a window of training steps) the group's runs have: n, mean, s.d., range; vs the
    first group: Δ of the means, its standard error (Welch: sqrt(s1²/n1 + s2²/n2)) and the share of cross
    pairs in which this group is lower; with ``gap``, from the third group on the share of the first two
    groups' gap it closes, ± s.e. (_gap_closed). A group of one run takes the pooled seed variance of the groups
    with several (the seed-to-seed noise assumed alike across arms), so that a single variant arm still gets an
    error bar."""
    members = group_members(values, groups)
    rows = []
    keys = sorted({k for v in values.values() for k in v})
    for key in keys:
        pooled = {g: [values[r][key] for r in runs if key in values[r]] for g, runs in members.items()}
        at = {}
        for g, v in pooled.items():
            if v:
                at[g] = dict(key=key, group=g, n=len(v), mean=statistics.fmean(v),
                             sd=statistics.stdev(v) if len(v) > 1 else float("nan"), lo=min(v), hi=max(v))
        seed_var = _pooled_seed_variance(list(at.values()))
        first = groups[0][0]
        ref = at.get(first)
        for g, row in at.items():
            if g != first and ref:
                row["delta"] = row["mean"] - ref["mean"]
                row["se"] = math.sqrt(_var_of_mean(row, seed_var) + _var_of_mean(ref, seed_var))
                lower = sum((a < b) + 0.5 * (a == b) for a in pooled[g] for b in pooled[first])
                row["lower_pairs"] = lower / (row["n"] * ref["n"])
            rows.append(row)
        if gap and len(groups) >= 3:
            _gap_closed(at, [g for g, _ in groups], seed_var)
    return rows


def _pooled_seed_variance(rows: list[dict]) -> float:
    """The seed-to-seed variance pooled over the groups of several runs (nan if none has two)."""
    multi = [r for r in rows if r["n"] > 1]
    return sum((r["n"] - 1) * r["sd"] ** 2 for r in multi) / sum(r["n"] - 1 for r in multi) if multi else float("nan")


def _var_of_mean(row: dict, seed_var: float) -> float:
    return (row["sd"] ** 2 if row["n"] > 1 else seed_var) / row["n"]


def _gap_closed(at: dict[str, dict], order: list[str], seed_var: float) -> None:
    """For the third group on: the share of the gap between the first two groups' means that it closes,
    100·(m₂ − m)/(m₂ − m₁), with a delta-method standard error from the variances of the three means (independent
    runs)."""
    if order[0] not in at or order[1] not in at:
        return
    base, ref = at[order[0]], at[order[1]]
    b = ref["mean"] - base["mean"]
    for g in order[2:]:
        r = at.get(g)
        if r is None or not b:
            continue
        a = ref["mean"] - r["mean"]
        var = (_var_of_mean(r, seed_var) / b ** 2 + ((b - a) / b ** 2) ** 2 * _var_of_mean(ref, seed_var)
               + (a / b ** 2) ** 2 * _var_of_mean(base, seed_var))
        r["closed_pct"] = gap_closed_pct(base["mean"], ref["mean"], r["mean"])
        r["closed_se_pct"] = 100 * math.sqrt(var)


def window_means(runs: dict[str, list[StepMetrics]], windows: list[tuple[int, int]]) -> dict[str, dict]:
    """Each run's mean training loss over the logged steps in each window [a, b] (windows it logged no step of are left out)."""
    out: dict[str, dict] = {}
    for name, steps in runs.items():
        out[name] = {}
        for a, b in windows:
            losses = [m.loss for m in steps if a <= m.step <= b]
            if losses:
                out[name][(a, b)] = statistics.fmean(losses)
    return out


def parse_windows(spec: str) -> list[tuple[int, int]]:
    """``"10-50,60-100"`` -> [(10, 50), (60, 100)]."""
    windows = []
    for part in spec.split(","):
        a, sep, b = part.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            raise ValueError(f"--train-windows: {part!r} is not FIRST-LAST") from None
        if not sep or lo > hi:
            raise ValueError(f"--train-windows: {part!r} is not FIRST-LAST with FIRST <= LAST")
        windows.append((lo, hi))
    return windows


def groups_markdown(rows: list[dict], key: str = "step") -> str:
    gap = any("closed_pct" in r for r in rows)
    head = (f"| {key} | group | runs | mean ± s.d. | range | Δ mean vs first group ± s.e. | pairs lower than the first group |"
            + (" gap closed ± s.e. |" if gap else "") + "\n| ---: | --- | ---: | ---: | --- | ---: | ---: |"
            + (" ---: |" if gap else "") + "\n")
    body = ""
    for r in rows:
        k = f"{r['key'][0]}–{r['key'][1]}" if isinstance(r["key"], tuple) else r["key"]
        delta = f"{r['delta']:+.4f} ± {r['se']:.4f}" if "delta" in r else ""
        lower = f"{100 * r['lower_pairs']:.0f}%" if "delta" in r else ""
        closed = (f" {r['closed_pct']:.0f}% ± {r['closed_se_pct']:.0f}% |" if "closed_pct" in r else " |") if gap else ""
        mean = f"{r['mean']:.4f} ± {r['sd']:.4f}" if r["n"] > 1 else f"{r['mean']:.4f}"  # one run: no s.d.
        body += f"| {k} | {r['group']} | {r['n']} | {mean} | {r['lo']:.4f}–{r['hi']:.4f} | {delta} | {lower} |{closed}\n"
    return head + body


def write_csv(runs: dict[str, list[StepMetrics]], path: Path, option: str = "output") -> None:
    """Every run's per-step metrics, one row per (run, step), written atomically (``option`` names ``path`` in
    errors)."""
    rows = "".join(f"{name},{s.step},{s.loss},{s.grad_norm},{s.memory_gib},{s.tps}\n"
                   for name, steps in runs.items() for s in steps)
    write_text(path, "run,step,loss,grad_norm,memory_gib,tps\n" + rows, option)


def _event_files(folder: Path) -> list[Path]:
    """The TensorBoard event files under ``folder``; of TorchTitan's per-rank folders (``rank_N``, with
    ``metrics.save_for_all_ranks``) only the lowest rank's: its metrics are those the console log shows."""
    files = sorted(folder.rglob("events.out.tfevents.*")) if folder.is_dir() else []
    ranks = {f: int(m[1]) for f in files for m in [re.fullmatch(r"rank_(\d+)", f.parent.name)] if m}
    if ranks:
        lowest = min(ranks.values())
        files = [f for f in files if ranks.get(f, lowest) == lowest]
    return files


def _read_events(file: Path) -> tuple[float, dict[int, dict[str, float]]]:
    """(wall time of the file's first scalar, {step: {tag: value}}) of one TensorBoard event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
    acc.Reload()
    by_step: dict[int, dict[str, float]] = {}
    first = float("inf")
    for tag in acc.Tags().get("scalars", []):
        for ev in acc.Scalars(tag):
            by_step.setdefault(ev.step, {})[tag] = ev.value
            first = min(first, ev.wall_time)
    return first, by_step


def tensorboard_runs(folder: Path) -> list[LoggedRun]:
    """The training runs TorchTitan's TensorBoard events under ``folder`` hold, oldest first. Each run (and each
    resume) writes its own run folder (``tb/<date-time>``); the event files are taken in the order they were
    written (their first event's wall time) with ``split_log``'s rules: one whose first step is 1 begins a new run
    (a rerun into the same dump folder), one that starts later resumes the run, replacing its steps from there on.
    ``where`` names the run's folders, relative to ``folder``."""
    files = sorted(((first, f, by_step) for f in _event_files(folder) for first, by_step in [_read_events(f)]
                    if by_step), key=lambda t: (t[0], str(t[1])))
    parents = [f.parent for _, f, _ in files]
    runs: list[tuple[list[str], dict[int, dict[str, float]]]] = []
    for _, f, by_step in files:
        named = f if parents.count(f.parent) > 1 else f.parent  # a folder of several event files: name the file
        where = str(named.relative_to(folder)) if named != folder else "."
        start = min(by_step)
        if not runs or start == 1:
            runs.append(([where], dict(by_step)))
            continue
        wheres, merged = runs[-1]
        for step in [k for k in merged if k >= start]:
            del merged[step]
        merged.update(by_step)
        if where not in wheres:
            wheres.append(where)
    return [LoggedRun(*_tensorboard_metrics(merged), ", ".join(wheres)) for wheres, merged in runs]


def _tensorboard_metrics(by_step: dict[int, dict[str, float]]) -> tuple[list[StepMetrics], dict[int, float]]:
    """Per-step metrics and validation losses from TorchTitan's scalar tags by step."""
    steps, validation = [], {}
    for step in sorted(by_step):
        m = by_step[step]
        if "validation_metrics/loss" in m:
            validation[step] = m["validation_metrics/loss"]
        if "loss_metrics/global_avg_loss" in m:
            steps.append(StepMetrics(step, m["loss_metrics/global_avg_loss"], m.get("grad_norm", float("nan")),
                                     m.get("memory/max_reserved(GiB)", 0.0), int(m.get("throughput(tps)", 0)),
                                     m.get("memory/max_active(GiB)")))
    return steps, validation


def tensorboard_run(folder: Path) -> tuple[list[StepMetrics], dict[int, float]]:
    """Per-step metrics and validation losses of the newest training run whose TensorBoard events TorchTitan
    wrote under ``folder`` (``tensorboard_runs``)."""
    runs = tensorboard_runs(folder)
    return (runs[-1].steps, runs[-1].validation) if runs else ([], {})


def read_run(path: Path, notes: list[str] | None = None) -> tuple[list[StepMetrics], dict[int, float]]:
    """A run's per-step metrics and validation losses: from a log file, or a dump folder's TensorBoard events; of
    a log or folder that holds several runs, the last (``split_log``, ``tensorboard_runs``), with a line saying so
    appended to ``notes``."""
    if path.is_dir():
        runs = tensorboard_runs(path)
        if len(runs) > 1 and notes is not None:
            notes.append(f"{path} holds {len(runs)} TensorBoard runs ({'; '.join(r.where for r in runs)}): "
                         f"reading only the newest, {runs[-1].where}")
    else:
        runs = split_log(path.read_text(errors="replace"))
        note = runs_note(path, runs)
        if note and notes is not None:
            notes.append(note)
    return (runs[-1].steps, runs[-1].validation) if runs else ([], {})


def run_name(path: Path) -> str:
    """A log's name without its extension, a folder's name."""
    return path.name if path.is_dir() else path.stem


def named_run(arg: Path) -> tuple[str, Path]:
    """A RUN argument's (name, path): ``NAME=PATH`` names the run (two logs of one file name, e.g. a rerun), a bare
    path is named by ``run_name``."""
    name, sep, rest = str(arg).partition("=")
    if sep and name and rest and len(Path(name).parts) == 1 and not arg.exists():
        return name, Path(rest)
    return run_name(arg), arg


def run_paths(args: list[Path]) -> list[Path]:
    """The files or folders RUN arguments read (``NAME=PATH`` gives PATH): the inputs an output must not replace."""
    return [named_run(a)[1] for a in args]


def read_runs(prog: str, paths: list[Path]) -> tuple[dict[str, list[StepMetrics]], dict[str, dict[int, float]]]:
    """``read_run`` for each path (or ``NAME=PATH``), keyed by its name; a missing path, or one without training
    metrics (one with validation lines only included), ends ``prog``. Notes on runs left out (``read_run``) go to
    stderr."""
    named = [named_run(p) for p in paths]
    for arg, (name, p) in zip(paths, named):
        if not p.exists():
            read_as = f" (RUN {str(arg)!r} read as NAME=PATH)" if p != arg else ""
            fail(prog, f"no such file or folder: {p}{read_as}")
    runs, validation, seen = {}, {}, {}
    for name, p in named:
        if name in seen:
            fail(prog, f"two runs named {name!r} ({seen[name]} and {p}): a run is named by its file or folder name "
                       "unless given as NAME=PATH; give each a name of its own")
        seen[name] = p
        notes: list[str] = []
        try:
            runs[name], validation[name] = read_run(p, notes)
        except OSError as e:
            fail(prog, f"cannot read {p}: {e.strerror}")
        for note in notes:
            print(f"{prog}: note: {note}", file=sys.stderr)
        if not runs[name]:
            only = " (validation lines only)" if validation[name] else ""
            fail(prog, f"no TorchTitan metric lines in {p}{only}" if p.is_file() else
                 f"no TensorBoard events with training metrics under {p}{only}")
    return runs, validation


def require_group_members(prog: str, runs, groups: list[tuple[str, list[str]]]) -> None:
    """``fail`` naming each --group that no run joins, and any run its patterns match that an earlier group took."""
    members = group_members(runs, groups)
    empty = [g for g, m in members.items() if not m]
    if not empty:
        return
    owner = {run: g for g, m in members.items() for run in m}
    patterns = dict(groups)
    taken = {run: owner[run] for g in empty for run in runs if run in owner
             and any(fnmatch.fnmatchcase(run, p) for p in patterns[g])}
    why = "".join(f"; {run} matches but joined --group {g} first (a run joins one group)" for run, g in taken.items())
    fail(prog, f"--group {', '.join(empty)}: no run matches (runs: {', '.join(runs)}){why}")


def main(argv: list[str] | None = None) -> None:
    ap = parser("titan_nvfp4.tools.loss_log", __doc__)
    ap.add_argument("logs", nargs="+", type=Path, metavar="RUN",
                    help="a training run's saved console log, or its dump folder with TensorBoard events, as PATH or "
                         "NAME=PATH; the first is the baseline")
    ap.add_argument("--last", type=int, default=10, help="logged steps averaged for the final loss (default 10)")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables instead of one line per run")
    ap.add_argument("--csv", type=Path, help="also write every run's per-step metrics here")
    ap.add_argument("--gap", action="store_true", help="share of the gap between the first two runs closed by the others "
                    "(with --group: between the first two groups, by the later groups, ± s.e.)")
    ap.add_argument("--group", action="append", default=[], metavar="NAME=PATTERN[,PATTERN]",
                    help="pool runs into a layout for the validation comparison across seeds (repeat; the first is the reference)")
    ap.add_argument("--train-windows", metavar="FIRST-LAST[,FIRST-LAST]",
                    help="with --group: also pool each run's mean training loss over these step windows "
                         "(only meaningful for runs trained on the same batches)")
    args = ap.parse_args(argv)
    if args.last < 1:
        ap.error(f"--last must be a positive number of logged steps, got {args.last}")
    if args.csv:
        require_output(ap.prog, args.csv, "--csv", run_paths(args.logs))
    try:
        windows = parse_windows(args.train_windows) if args.train_windows else []
    except ValueError as e:
        ap.error(str(e))
    try:
        groups = [parse_group(spec) for spec in args.group]
    except ValueError as e:
        ap.error(str(e))
    runs, validation = read_runs(ap.prog, args.logs)
    require_group_members(ap.prog, runs, groups)
    rows = summarize(runs, args.last, args.gap, validation)
    if args.csv:
        with writing(ap.prog, args.csv, "--csv"):
            write_csv(runs, args.csv, "--csv")
    if args.markdown:
        print(to_markdown(rows, args.last), end="")
        if any(validation.values()):
            print("\n" + validation_markdown(validation), end="")
    else:
        for r in rows:
            print(" ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if groups:
        if any(validation.values()):
            print("\n" + groups_markdown(pool_groups(validation, groups, args.gap)), end="")
        if windows:
            print("\nTraining loss, mean of the logged steps in each window:\n\n"
                  + groups_markdown(pool_groups(window_means(runs, windows), groups, args.gap), key="steps"), end="")


if __name__ == "__main__":
    main()
