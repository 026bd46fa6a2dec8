"""The comparison's table, CSV and plot: only arms whose logs are runs of this spec (flagged when partial, or when
an older runner's log cannot say), never a stale or mixed one; each file written atomically."""

from __future__ import annotations

import os
import sys

from ..tools.atomic import atomic_file, write_text
from ..tools.loss_log import parse_validation, summarize, to_markdown, validation_markdown, write_csv
from .armlog import ArmLog, read_arm_log
from .lock import holder
from .paired import (final_validations, pairwise_markdown, pairwise_rows, paired_markdown, paired_rows, recipe_of,
                     target_markdown)
from .spec import Spec


def _notes(spec: Spec, states: dict[str, ArmLog]) -> str:
    """The lines under the table: arms left out and why, unchecked, partial (and who runs them now), not logged."""
    arms = spec.by_name()
    lines = []
    left_out = [f"{n} ({s.why})" for n, s in states.items() if s.status in ("stale", "mixed")]
    if left_out:
        lines.append(f"Not tabled (not a run of this spec; --rerun starts them afresh): {'; '.join(left_out)}")
    unchecked = [n for n, s in states.items() if s.status == "unchecked" and s.tabled]
    if unchecked:
        lines.append("Not checked against this spec (no spec line: an older runner's logs, or gathered ones): "
                     + ", ".join(unchecked))
    ids = {s.corpus for s in states.values() if s.tabled and s.corpus}
    unlogged = [n for n, s in states.items() if s.tabled and not s.corpus]
    if ids and unlogged:
        lines.append(f"Corpus not logged (a log from before 2026-12-06, or another dataset), so not checked against "
                     f"the others' {', '.join(sorted(ids))} (tabled all the same; [compare] corpus would leave them "
                     f"out): {', '.join(unlogged)}")
    partial = []
    for n, s in states.items():
        if s.tabled and s.steps[-1].step < spec.steps:
            who = holder(spec, arms[n])
            partial.append(f"{n} at step {s.steps[-1].step}" + (f" (running: {who})" if who else ""))
    if partial:
        lines.append(f"Partial (below step {spec.steps}): {', '.join(partial)}")
    missing = [n for n, s in states.items() if s.status in ("none", "current", "unchecked") and not s.steps]
    if missing:
        lines.append(f"No logged steps yet: {', '.join(missing)}")
    return "".join(f"\n{line}\n" for line in lines)


def one_corpus(spec: Spec, states: dict[str, ArmLog]) -> dict[str, ArmLog]:
    """``states`` with every arm that logged another corpus than the baseline's, else than the one most arms logged
    (a tie: the first in table order), left out as stale: their losses are of other data. (An arm off the spec's
    ``corpus`` pin is stale already: ``read_arm_log``.)"""
    ids = [s.corpus for s in states.values() if s.tabled and s.corpus]
    if len(set(ids)) < 2:
        return states
    base = states[spec.baseline].corpus if states[spec.baseline].tabled else ""
    if base:
        keep, whose = base, "the baseline's"
    else:
        keep = max(dict.fromkeys(ids), key=ids.count)
        whose = "that of most arms" if ids.count(keep) > max(ids.count(i) for i in set(ids) - {keep}) else \
            "that of the first arm tabled (a tie)"
    return {n: ArmLog("stale", why=f"read corpus {s.corpus}, not {keep}, {whose}", corpus=s.corpus)
            if s.tabled and s.corpus and s.corpus != keep else s for n, s in states.items()}


def paired_table(spec: Spec, runs: dict, validation: dict[str, dict[int, float]]) -> str:
    """The paired table of the arms' seed replicates ("" unless a recipe besides the baseline's has two seeds paired
    with it): each finished arm's statistic, the mean of its last ``paired_validations`` validation losses, keyed by
    recipe and seed (``paired.paired_rows``); a partial arm waits (its last validations are earlier steps)."""
    k = spec.paired_validations
    finished = [a for a in spec.arms if a.name in runs and runs[a.name][-1].step >= spec.steps]
    # the protocol's steps: the last k validation steps any finished arm logged
    steps = sorted({s for a in finished for s in validation.get(a.name, {})})[-k:]
    stats: dict[str, dict[int, float]] = {}
    lacking = []
    for arm in finished:
        value = final_validations(validation.get(arm.name, {}), steps)
        seed = spec.seed(arm)
        if value is None:
            lacking.append(arm.name)
        elif seed is not None:
            stats.setdefault(recipe_of(arm.name), {})[seed] = value
    baseline, reference = recipe_of(spec.baseline), recipe_of(spec.reference) if spec.reference else ""
    if baseline not in stats:
        return ""
    rows = paired_rows(stats, baseline, reference if reference in stats else "")
    if not any(r["n"] > 1 for r in rows):
        return ""
    what = "the last validation loss" if k == 1 else f"the mean of the last {k} validation losses"
    pairwise = pairwise_markdown(pairwise_rows(stats, baseline), baseline)
    target = "\n" + target_markdown(rows, spec.target_se) if spec.target_se else ""
    left_out = ("\nLeft out of the paired rows, without a finite validation loss at step"
                f"{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}: {', '.join(lacking)}\n"
                if lacking else "")
    return paired_markdown(rows, baseline, reference if reference in stats else "", what) + left_out + target + \
        ("\n" + pairwise if pairwise else "")


def report(spec: Spec) -> str:
    """Write <out>/compare.md, compare.csv and compare.png from the arms whose logs may be tabled; return the table."""
    order = [a for a in spec.arms if a.name == spec.baseline] + [a for a in spec.arms if a.name != spec.baseline]
    if spec.reference:  # the gap columns read the reference as the second run
        order = order[:1] + [a for a in order[1:] if a.name == spec.reference] + \
                [a for a in order[1:] if a.name != spec.reference]
    states = one_corpus(spec, {a.name: read_arm_log(spec, a) for a in order})
    runs = {n: s.steps for n, s in states.items() if s.tabled}
    if spec.baseline not in runs:
        why = states[spec.baseline].why
        raise RuntimeError(f"the baseline arm {spec.baseline!r} has no logged steps in {spec.out} to table"
                           + (f" ({why})" if why and states[spec.baseline].status in ("stale", "mixed") else ""))
    validation = {a.name: parse_validation(spec.log(a).read_text(errors="replace")) for a in order
                  if a.name in runs and spec.log(a).is_file()}
    validation = {n: v for n, v in validation.items() if v}
    # the gap closed reads the baseline and the reference as the first two rows: only arms of another recipe on
    # their seed get one (a replicate of either closes nothing; another seed's gap mixes in the seed's spread)
    pair = {recipe_of(spec.baseline), recipe_of(spec.reference)} if spec.reference else set()
    arms = spec.by_name()
    no_gap = {n for n in runs if recipe_of(n) in pair or spec.seed(arms[n]) != spec.seed(arms[spec.baseline])}
    rows = summarize(runs, spec.last, gap=bool(spec.reference) and spec.reference in runs, validation=validation or None,
                     no_gap=no_gap)
    table = to_markdown(rows, spec.last)
    if validation:
        table += "\n" + validation_markdown(validation)
        paired = paired_table(spec, runs, validation)
        table += "\n" + paired if paired else ""
    table += _notes(spec, states)
    write_text(spec.out / "compare.md", table, "table")
    with atomic_file(spec.out / "compare.csv", "CSV") as tmp:
        write_csv(runs, tmp)
    try:
        from ..tools.loss_plot import plot_runs

        with atomic_file(spec.out / "compare.png", "plot") as tmp:
            staged = tmp.with_name(tmp.name + ".png")  # matplotlib takes the image format from the suffix
            try:
                plot_runs(runs, staged, title=f"{spec.base.name}: {spec.steps} steps per arm")
                os.replace(staged, tmp)
            finally:
                staged.unlink(missing_ok=True)
    except ImportError:
        print("compare: no plot (matplotlib missing: pip install -e .[plot])", file=sys.stderr)
    return table
