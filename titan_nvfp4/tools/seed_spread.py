"""Where the seed-to-seed spread of two recipes comes from, from their seed replicates' logs (runs that read the same
batches in the same order, replicate N of each recipe sharing its initialisation):

    python -m titan_nvfp4.tools.seed_spread bf16.log bf16_seed2.log nvfp4.log nvfp4_seed2.log --baseline bf16 --recipe nvfp4

Runs are named by their file name (or NAME=PATH, as in loss_log), "<recipe>" for the first replicate and "<recipe>_seedN" for the others; replicate
N of the recipe is paired with replicate N of the baseline. Prints four tables:
- by validation step: each recipe's s.d. over seeds, the paired gap (recipe − baseline of the same seed, in % of the
  baseline) with its s.d. over seeds, and the correlation of the two recipes' losses across seeds;
- the paired training-loss gap of each seed by window of steps (when the spread arises);
- candidate statistics (the last K validations, the training loss over the last M steps): both recipes' s.d., the
  mean paired gap ± s.d./√n, and the seeds a standard error of ``--target-se`` points needs (``seeds_for``:
  ⌈(s.d./target)²⌉, at least 2);
- loss spikes per run: logged training losses more than ``--spike-k`` robust s.d. above their running median, taken
  on the run's loss minus the median of all given runs at that step (the batch's own difficulty, which every run
  shares, removed); the robust s.d. is 1.4826 × the median absolute deviation over ±50 logged steps.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..compare.paired import recipe_of, seeds_for
from .cli import parser
from .loss_log import read_runs


def _replicates(names: list[str], recipe: str) -> dict[str, str]:
    """{replicate key: run name} of ``recipe``'s runs: "1" for the bare name, "N" for "<recipe>_seedN"."""
    out = {}
    for n in names:
        if recipe_of(n) == recipe:
            out["1" if n == recipe else n.rsplit("_seed", 1)[1]] = n
    return out


def _sd(values: list[float]) -> float:
    """The sample s.d.; NaN for fewer than two values or a non-finite one (a diverged run: statistics.stdev raises)."""
    return statistics.stdev(values) if len(values) > 1 and all(map(math.isfinite, values)) else float("nan")


def _corr(x: list[float], y: list[float]) -> float:
    if len(x) < 2 or _sd(x) == 0 or _sd(y) == 0:
        return float("nan")
    mx, my = statistics.fmean(x), statistics.fmean(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / ((len(x) - 1) * _sd(x) * _sd(y))


def _gaps(base: list[float], rec: list[float]) -> list[float]:
    return [100.0 * (r - b) / b for b, r in zip(base, rec)]


def validation_table(val: dict, pairs: list[tuple[str, str]]) -> str:
    steps = sorted(set.intersection(*(set(val[n]) for p in pairs for n in p)))
    out = ("| step | s.d. baseline | s.d. recipe | paired gap, % (mean) | s.d. of the paired gaps, % | correlation of "
           "the pair across seeds | per-seed gaps, % |\n| ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
    for s in steps:
        b, r = [val[p[0]][s] for p in pairs], [val[p[1]][s] for p in pairs]
        g = _gaps(b, r)
        out += (f"| {s} | {_sd(b):.4f} | {_sd(r):.4f} | {statistics.fmean(g):+.2f} | {_sd(g):.2f} | "
                f"{_corr(b, r):+.2f} | {', '.join(f'{x:+.2f}' for x in g)} |\n")
    return out


def _window_mean(steps, lo: int, hi: int) -> float:
    v = [m.loss for m in steps if lo < m.step <= hi]
    return statistics.fmean(v) if v else float("nan")


def window_table(runs: dict, pairs: list[tuple[str, str]], width: int) -> str:
    last = min(runs[n][-1].step for p in pairs for n in p)
    out = ("| steps | " + " | ".join(f"{r} − {b}, %" for b, r in pairs) + " | s.d., % |\n| --- |"
           + " ---: |" * (len(pairs) + 1) + "\n")
    for lo in range(0, last, width):
        hi = min(lo + width, last)
        g = _gaps([_window_mean(runs[b], lo, hi) for b, _ in pairs], [_window_mean(runs[r], lo, hi) for _, r in pairs])
        out += f"| {lo + 1}–{hi} | " + " | ".join(f"{x:+.2f}" for x in g) + f" | {_sd(g):.2f} |\n"
    return out


def statistics_table(runs: dict, val: dict, pairs: list[tuple[str, str]], target: float) -> str:
    last = min(runs[n][-1].step for p in pairs for n in p)
    vsteps = sorted(set.intersection(*(set(val[n]) for p in pairs for n in p)))
    cands = []
    for k in (1, 2, 3):
        if len(vsteps) >= k:
            at = vsteps[-k:]
            name = f"validation loss at step {at[0]}" if k == 1 else f"mean of the validations at {', '.join(map(str, at))}"
            cands.append((name, lambda n, at=at: statistics.fmean(val[n][s] for s in at)))
    for m in (100, 200, 500):
        cands.append((f"training loss, mean of the logged steps {last - m + 1}–{last}",
                      lambda n, m=m: _window_mean(runs[n], last - m, last)))
    out = ("| statistic | s.d. baseline | s.d. recipe | paired gap, % ± s.e. | s.d. of the paired gaps, % | "
           f"seeds for a s.e. of {target} points |\n| --- | ---: | ---: | ---: | ---: | ---: |\n")
    for name, f in cands:
        b, r = [f(p[0]) for p in pairs], [f(p[1]) for p in pairs]
        g = _gaps(b, r)
        sd = _sd(g)
        need = seeds_for(sd, target) if sd == sd else "—"
        out += (f"| {name} | {_sd(b):.4f} | {_sd(r):.4f} | {statistics.fmean(g):+.2f} ± {sd / math.sqrt(len(g)):.2f} | "
                f"{sd:.2f} | {need} |\n")
    return out


def spikes(runs: dict, k: float) -> dict[str, list[tuple[int, float]]]:
    """{run: [(step, excess over the running median)]} of the logged losses more than ``k`` robust s.d. above their
    running median (±10 logged steps), on each run's loss minus the median of all runs at that step."""
    common = sorted(set.intersection(*({m.step for m in s} for s in runs.values())))
    by = {n: {m.step: m.loss for m in s} for n, s in runs.items()}
    batch = [statistics.median(by[n][t] for n in runs) for t in common]
    out = {}
    for n in runs:
        e = [by[n][t] - b for t, b in zip(common, batch)]
        r = [e[i] - statistics.median(e[max(0, i - 10):i + 11]) for i in range(len(e))]
        found = []
        for i, x in enumerate(r):
            window = r[max(0, i - 50):i + 51]
            mad = 1.4826 * statistics.median(abs(y) for y in window)
            if mad > 0 and x > k * mad:
                found.append((common[i], x))
        out[n] = found
    return out


def spikes_table(found: dict[str, list[tuple[int, float]]], k: float) -> str:
    out = (f"| run | spikes (> {k:g} robust s.d.) | steps (excess loss) |\n| --- | ---: | --- |\n")
    for n, s in found.items():
        out += f"| {n} | {len(s)} | {', '.join(f'{t} ({x:+.2f})' for t, x in s)} |\n"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser("titan_nvfp4.tools.seed_spread", __doc__)
    ap.add_argument("logs", nargs="+", type=Path, metavar="RUN", help="the seed replicates' logs of both recipes, as PATH or NAME=PATH")
    ap.add_argument("--baseline", required=True, help="the baseline recipe's name (e.g. bf16)")
    ap.add_argument("--recipe", required=True, help="the compared recipe's name (e.g. nvfp4)")
    ap.add_argument("--target-se", type=float, default=0.3, help="the standard error, in points of %%, to size for")
    ap.add_argument("--spike-k", type=float, default=5.0, help="robust s.d. above the running median that make a spike")
    ap.add_argument("--window", type=int, default=250, help="steps per window of the training-loss gap table")
    args = ap.parse_args(argv)
    if args.target_se <= 0 or args.spike_k <= 0 or args.window < 1:
        ap.error("--target-se and --spike-k must be positive, --window at least 1")
    runs, val = read_runs(ap.prog, args.logs)
    names = list(runs)  # read_runs keys every run by its name, in argument order
    base, rec = _replicates(names, args.baseline), _replicates(names, args.recipe)
    keys = sorted(set(base) & set(rec), key=int)
    if len(keys) < 2:
        ap.error(f"needs at least two seeds of both {args.baseline!r} and {args.recipe!r} (runs named <recipe> and "
                 f"<recipe>_seedN), got {args.baseline}: {sorted(base.values())}, {args.recipe}: {sorted(rec.values())}")
    pairs = [(base[k], rec[k]) for k in keys]
    if not all(val[n] for p in pairs for n in p):
        ap.error("every run needs validation lines (validate step: N loss: X)")
    print("Validation loss by step, seed by seed:\n\n" + validation_table(val, pairs))
    print(f"\nTraining loss, paired gap by window of {args.window} steps:\n\n" + window_table(runs, pairs, args.window))
    print("\nCandidate statistics:\n\n" + statistics_table(runs, val, pairs, args.target_se))
    print("\nLoss spikes:\n\n" + spikes_table(spikes({n: runs[n] for n in names}, args.spike_k), args.spike_k), end="")


if __name__ == "__main__":
    main()
