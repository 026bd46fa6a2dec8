"""Loss curves of training runs and their difference to the first run, as a PNG.

    python -m titan_nvfp4.tools.loss_plot bf16.log nvfp4.log [more.log ...] --out curves.png [--smooth 0.6]

Reads TorchTitan logs (loss_log.parse_log). Top: each run's loss per logged step (thin) and its
exponential moving average (thick). Bottom: loss minus the first run's at the steps both logged
(same seed and data, so batch-to-batch noise cancels), with its moving average. Runs that validated
(loss_log.parse_validation) add their validation losses as dashed lines with markers, in both panels.
Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .loss_log import StepMetrics, parse_log, parse_validation


def ema(values: list[float], decay: float) -> list[float]:
    """Exponential moving average, bias-corrected so that early points are not pulled towards 0."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = decay * acc + (1 - decay) * v
        weight = decay * weight + (1 - decay)
        out.append(acc / weight)
    return out


def plot_runs(runs: dict[str, list[StepMetrics]], out: Path, smooth: float = 0.6, title: str = "",
              validation: dict[str, dict[int, float]] | None = None) -> Path:
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
            diff = [s.loss - base[s.step] for s in common]
            bottom.plot([s.step for s in common], diff, color=color, alpha=0.25, linewidth=0.8)
            bottom.plot([s.step for s in common], ema(diff, smooth), color=color, linewidth=2, label=f"{name} − {names[0]}")
        val = validation.get(name, {})
        if val:
            steps = sorted(val)
            top.plot(steps, [val[k] for k in steps], color=color, linestyle="--", marker="o", markersize=4)
            both = [k for k in steps if k in base_val]
            if i and both:
                bottom.plot(both, [val[k] - base_val[k] for k in both], color=color, linestyle="--", marker="o",
                            markersize=4)
    top.set_ylabel("loss")
    if any(validation.values()):
        top.plot([], [], color="grey", linestyle="--", marker="o", markersize=4, label="dashed: validation loss")
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    top.set_title(title or f"loss per logged step (thick: EMA {smooth})")
    bottom.axhline(0.0, color="k", linewidth=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel("Δ loss")
    bottom.grid(alpha=0.3)
    if len(names) > 1:
        bottom.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smooth", type=float, default=0.6, help="EMA decay per logged step")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    texts = {p.stem: p.read_text(errors="replace") for p in args.logs}
    runs = {name: parse_log(t) for name, t in texts.items()}
    validation = {name: parse_validation(t) for name, t in texts.items()}
    print(f"loss_plot: wrote {plot_runs(runs, args.out, args.smooth, args.title, validation)}")


if __name__ == "__main__":
    main()
