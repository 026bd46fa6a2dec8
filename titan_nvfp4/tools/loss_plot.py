"""Loss curves of training runs and their difference to the first run, as a PNG.

    python -m titan_nvfp4.tools.loss_plot outputs/llama3_bf16.log outputs/llama3_nvfp4.log --out curves.png [--smooth 0.6]

Reads saved console logs of training runs, or their dump folders' TensorBoard events, named as loss_log names them (``NAME=PATH`` too). Top: each run's loss per logged step (thin) and its
exponential moving average (thick). Bottom: loss minus the first run's at the steps both logged
(same seed and data, so batch-to-batch noise cancels), with its moving average. Runs that validated
(loss_log.parse_validation) add their validation losses as dashed lines with markers, in both panels.
``--group NAME=PATTERN[,PATTERN]`` (repeated, as in loss_log) plots layouts pooled over seeds instead: per
group the mean training loss per logged step (EMA) with a ±1 s.d. band across its runs, and the mean
validation loss with ±1 s.d. bars; the bottom panel shows each group's means minus the first group's.
``--log-y``: the loss on a log scale and the differences in % of the first run's, for runs that memorize
their corpus (losses near 0, where an absolute difference of 0.001 can be several percent).
A NaN loss is a gap in the curves (the moving averages go on after it). ``--out`` is written atomically and may
not name an input. Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .atomic import atomic_file
from .cli import fail, parser, require_output, writing
from .loss_log import StepMetrics, group_members, parse_group, read_runs, require_group_members, run_paths


def ema(values: list[float], decay: float) -> list[float]:
    """Exponential moving average, bias-corrected so that early points are not pulled towards 0. A NaN or
    infinite value is a missing point: NaN there (a gap in the curve), and the average goes on from the values
    around it rather than staying NaN for the rest of the run."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(float("nan"))
            continue
        acc = decay * acc + (1 - decay) * v
        weight = decay * weight + (1 - decay)
        out.append(acc / weight)
    return out


def _diff(value: float, ref: float, relative: bool) -> float:
    """value − ref, or with ``relative`` in % of ref (the bottom panel under --log-y)."""
    return 100.0 * (value - ref) / ref if relative else value - ref


def _finish(fig, top, bottom, out: Path, title: str, delta_label: str, validation_label: str, bottom_legend: bool,
            log_y: bool = False) -> Path:
    """Labels, grids and legends of the two panels; save the PNG and close the figure."""
    import matplotlib.pyplot as plt

    top.set_ylabel("loss")
    if log_y:
        top.set_yscale("log")
    if validation_label:
        top.plot([], [], color="grey", linestyle="--", marker="o", markersize=4, label=validation_label)
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    top.set_title(title)
    bottom.axhline(0.0, color="k", linewidth=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel(delta_label)
    bottom.grid(alpha=0.3)
    if bottom_legend:
        bottom.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    try:
        with atomic_file(out) as tmp:  # the format from out's suffix (tmp's is .tmp)
            fig.savefig(tmp, dpi=110, format=out.suffix.lstrip(".").lower() or plt.rcParams["savefig.format"])
    finally:
        plt.close(fig)
    return out


def plot_runs(runs: dict[str, list[StepMetrics]], out: Path, smooth: float = 0.6, title: str = "",
              validation: dict[str, dict[int, float]] | None = None, log_y: bool = False) -> Path:
    """Write the two-panel PNG for ``runs`` (name -> metrics; the first is the reference), with the
    ``validation`` losses (name -> step -> loss) of the runs that have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(runs) < 1 or any(not m for m in runs.values()):
        raise ValueError("loss_plot: every run needs at least one logged step")
    names = list(runs)
    validation = validation or {}
    base = {s.step: s.loss for s in runs[names[0]]}
    base_val = validation.get(names[0], {})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, name in enumerate(names):
        color = f"C{i}"
        steps = [s.step for s in runs[name]]
        loss = [s.loss for s in runs[name]]
        top.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
        top.plot(steps, ema(loss, smooth), color=color, linewidth=2, label=name)
        if i:
            common = [s for s in runs[name] if s.step in base]
            diff = [_diff(s.loss, base[s.step], log_y) for s in common]
            bottom.plot([s.step for s in common], diff, color=color, alpha=0.25, linewidth=0.8)
            bottom.plot([s.step for s in common], ema(diff, smooth), color=color, linewidth=2, label=f"{name} − {names[0]}")
        val = validation.get(name, {})
        if val:
            steps = sorted(val)
            top.plot(steps, [val[k] for k in steps], color=color, linestyle="--", marker="o", markersize=4)
            both = [k for k in steps if k in base_val]
            if i and both:
                bottom.plot(both, [_diff(val[k], base_val[k], log_y) for k in both], color=color, linestyle="--", marker="o",
                            markersize=4)
    return _finish(fig, top, bottom, out, title or f"loss per logged step (thick: EMA {smooth})",
                   f"Δ loss (% of {names[0]})" if log_y else "Δ loss",
                   "dashed: validation loss" if any(validation.values()) else "", len(names) > 1, log_y)


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def group_curves(runs: dict[str, list[StepMetrics]], groups: list[tuple[str, list[str]]],
                 validation: dict[str, dict[int, float]]) -> tuple[dict, dict, dict]:
    """Per group: its runs, (steps every run logged, [(mean, s.d.) of the training loss]), and the same for
    the validation steps every run validated."""
    members = group_members(runs, groups)
    empty = [g for g, m in members.items() if not m]
    if empty:
        raise ValueError(f"loss_plot: no run matches group(s) {empty}")
    curves, vals = {}, {}
    for g, names in members.items():
        per_run = [{s.step: s.loss for s in runs[n]} for n in names]
        steps = sorted(set.intersection(*(set(r) for r in per_run)))
        if not steps:
            raise ValueError(f"loss_plot: the runs of group {g!r} ({names}) share no logged step")
        curves[g] = (steps, [_mean_sd([r[k] for r in per_run]) for k in steps])
        vsteps = sorted(set.intersection(*(set(validation.get(n, {})) for n in names)))
        vals[g] = (vsteps, [_mean_sd([validation[n][k] for n in names]) for k in vsteps])
    return members, curves, vals


def plot_groups(runs: dict[str, list[StepMetrics]], groups: list[tuple[str, list[str]]], out: Path,
                smooth: float = 0.6, title: str = "", validation: dict[str, dict[int, float]] | None = None,
                log_y: bool = False) -> Path:
    """Write the two-panel PNG of runs pooled into ``groups`` (the first is the reference): per group and
    logged step the mean training loss across its runs (steps every run logged), EMA-smoothed, with a ±1 s.d.
    band; validation means with ±1 s.d. bars; bottom: group means minus the first group's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members, curves, vals = group_curves(runs, groups, validation or {})
    ref = groups[0][0]
    base = dict(zip(curves[ref][0], (m for m, _ in curves[ref][1])))
    vbase = dict(zip(vals[ref][0], (m for m, _ in vals[ref][1])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, (g, (steps, stats)) in enumerate(curves.items()):
        color = f"C{i}"
        mean = ema([m for m, _ in stats], smooth)
        sd = [s for _, s in stats]
        n = len(members[g])
        top.plot(steps, mean, color=color, linewidth=2, label=f"{g} ({n} run{'' if n == 1 else 's'})")
        top.fill_between(steps, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                         color=color, alpha=0.15, linewidth=0)
        vsteps, vstats = vals[g]
        if vsteps:
            top.errorbar(vsteps, [m for m, _ in vstats], yerr=[s for _, s in vstats], color=color, linestyle="--",
                         marker="o", markersize=4, capsize=3)
        if g != ref:
            common = [(k, m) for k, (m, _) in zip(steps, stats) if k in base]
            bottom.plot([k for k, _ in common], ema([_diff(m, base[k], log_y) for k, m in common], smooth), color=color,
                        linewidth=2, label=f"{g} − {ref}")
            vcommon = [(k, m) for k, (m, _) in zip(vsteps, vstats) if k in vbase]
            if vcommon:
                bottom.plot([k for k, _ in vcommon], [_diff(m, vbase[k], log_y) for k, m in vcommon], color=color, linestyle="--",
                            marker="o", markersize=4)
    return _finish(fig, top, bottom, out, title or f"mean training loss per group (EMA {smooth}; band: ±1 s.d. across runs)",
                   f"Δ mean loss (% of {ref})" if log_y else "Δ mean loss", "dashed: validation mean ± s.d." if any(v[0] for v in vals.values()) else "",
                   len(curves) > 1, log_y)


def main(argv: list[str] | None = None) -> None:
    ap = parser("titan_nvfp4.tools.loss_plot", __doc__)
    ap.add_argument("logs", nargs="+", type=Path, metavar="RUN",
                    help="a training run's saved console log, or its dump folder with TensorBoard events, as PATH or NAME=PATH; "
                         "the first is the reference")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--smooth", type=float, default=0.6, help="EMA decay per logged step (default 0.6)")
    ap.add_argument("--title", default="", help="figure title")
    ap.add_argument("--group", action="append", default=[], metavar="NAME=PATTERN[,PATTERN]",
                    help="plot runs pooled into layouts (repeat; the first is the reference)")
    ap.add_argument("--log-y", action="store_true",
                    help="the loss on a log scale and the differences in %% of the first run's (runs that go on "
                         "to memorize their corpus)")
    args = ap.parse_args(argv)
    if not 0 <= args.smooth < 1:
        ap.error(f"--smooth must be in [0, 1) (the EMA decay), got {args.smooth}")
    try:
        groups = [parse_group(spec) for spec in args.group]
    except ValueError as e:
        ap.error(str(e))
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        fail(ap.prog, "needs matplotlib: pip install -e .[plot]")
    formats = FigureCanvasBase.get_supported_filetypes()
    if args.out.suffix.lower().lstrip(".") not in formats:
        fail(ap.prog, f"--out {args.out}: unknown image format {args.out.suffix!r} (one of .{', .'.join(sorted(formats))})")
    require_output(ap.prog, args.out, "--out", run_paths(args.logs))
    runs, validation = read_runs(ap.prog, args.logs)
    require_group_members(ap.prog, runs, groups)
    try:
        with writing(ap.prog, args.out, "--out"):
            if groups:
                out = plot_groups(runs, groups, args.out, args.smooth, args.title, validation, args.log_y)
            else:
                out = plot_runs(runs, args.out, args.smooth, args.title, validation, args.log_y)
    except ValueError as e:
        fail(ap.prog, str(e).removeprefix("loss_plot: "))
    print(f"loss_plot: wrote {out}")


if __name__ == "__main__":
    main()
