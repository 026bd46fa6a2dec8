"""End-to-end throughput of TorchTitan runs (BF16 baseline first, then NVFP4) from their logs.

    python -m titan_nvfp4.tools.e2e_report bf16.log nvfp4.log [--skip 5] [--json out.json]

Reads TorchTitan 0.2.2's metric lines (components/metrics.py prints, per logged step,
"step: N  loss: L  grad_norm: G  memory: M GiB(P%)  tps: T  tflops: F  mfu: U%", memory being the
max *reserved* since the previous line) and the "Trainer is initialized with local batch size B, ...,
gradient accumulation steps A, sequence length S, ..." line. TorchTitan's tps is the rank's tokens since
the last log over the wall time since it, so step time = B*A*S / tps for any log_freq (one GPU, or
pure data parallel: with TP/CP/PP tps is divided further). The first --skip steps (compilation,
autotuning, allocator warm-up) are left out of the medians and the peak memory. A log with a rerun appended is
read from where its last run starts (loss_log.split_log, said in the notes column). Where a folder LOG-stem.dump
beside a log holds the run's TensorBoard events (scripts/e2e_bench.sh runs with --metrics.enable_tensorboard and
that dump folder), the peak *active* memory of the measured steps is read from them too: reserved memory keeps
what the first steps' compiles and autotuning once needed, and differs by half a GiB between runs of one job.
``--json`` is written atomically and may not name an input.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .atomic import write_text
from .cli import fail, parser, require_output, writing
from .loss_log import ANSI_ESCAPES, StepMetrics, split_log, tensorboard_run

_INIT = re.compile(
    r"local batch size (?P<b>\d+), global batch size \d+, gradient accumulation steps (?P<a>\d+), "
    r"sequence length (?P<s>\d+)"
)
# torch's CUDA allocator error, not Triton's "OutOfMemoryError: out of resource" (shared memory) that inductor's
# autotuner logs for a flex-attention candidate it then skips.
_OOM = re.compile(r"torch\.OutOfMemoryError|CUDA out of memory")


@dataclass
class RunSummary:
    name: str
    tokens_per_step: int | None
    steps_logged: int
    steps_measured: int
    step_ms: float | None = None
    tps: float | None = None
    peak_memory_gib: float | None = None
    peak_active_gib: float | None = None
    final_loss: float | None = None
    notes: list[str] = field(default_factory=list)


def tokens_per_step(text: str) -> int | None:
    """B*A*S from TorchTitan's last "Trainer is initialized with ..." line (that of the log's last run), or None
    when absent."""
    found = list(_INIT.finditer(ANSI_ESCAPES.sub("", text)))
    m = found[-1] if found else None
    return int(m["b"]) * int(m["a"]) * int(m["s"]) if m else None


def summarize_run(name: str, text: str, skip: int, tokens: int | None = None,
                  active: dict[int, float] | None = None) -> RunSummary:
    """Median step time and tps, peak reserved memory and last loss of the steps after ``skip``, of the log's last
    run (loss_log.split_log: a log with runs appended is read from where the last one restarts, with a note);
    ``active``: max active memory (GiB) by logged step, whose peak over the same steps is reported too."""
    tokens = tokens or tokens_per_step(text)
    runs = split_log(text)
    steps: list[StepMetrics] = runs[-1].steps
    measured = [s for s in steps if s.step > skip and s.tps > 0]
    r = RunSummary(name, tokens, len(steps), len(measured))
    if len(runs) > 1:
        r.notes.append(f"{len(runs)} runs in the log: the last, from {runs[-1].where}")
    if _OOM.search("\n".join(text.splitlines()[runs[-1].line - 1:])):
        r.notes.append("out of memory")
    if steps:
        r.final_loss = steps[-1].loss
    if not measured:
        r.notes.append(f"no step after the first {skip} logged")
        return r
    r.tps = statistics.median(s.tps for s in measured)
    r.peak_memory_gib = max(s.memory_gib for s in measured)
    seen = [active[s.step] for s in measured if s.step in (active or {})]
    if seen:
        r.peak_active_gib = max(seen)
    if tokens:
        r.step_ms = statistics.median(1000.0 * tokens / s.tps for s in measured)
    else:
        r.notes.append("no 'Trainer is initialized' line: step time unknown (pass --tokens-per-step)")
    return r


def active_memory(log: Path) -> dict[int, float] | None:
    """Max active memory (GiB) by logged step of the newest run whose TensorBoard events are in the dump folder
    beside ``log`` (LOG-stem.dump), None without one."""
    dump = log.with_suffix(".dump")
    if not dump.is_dir():
        return None
    steps, _ = tensorboard_run(dump)
    return {s.step: s.active_gib for s in steps if s.active_gib is not None}


def ratio(run: RunSummary, base: RunSummary) -> float | None:
    """Step-time ratio run/base (>1: run is slower), None when either is unknown."""
    return run.step_ms / base.step_ms if run.step_ms and base.step_ms else None


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def to_markdown(runs: list[RunSummary], skip: int) -> str:
    """One table row per run, step-time ratios against the first run, then the headline ratio."""
    base = runs[0]
    out = [
        f"| run | tokens/step | steps measured (after {skip}) | step time ms (median) | tokens/s (median) "
        f"| peak memory GiB (max reserved) | peak active GiB | final loss | step time vs {base.name} | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        out.append(
            f"| {r.name} | {_fmt(r.tokens_per_step, ',')} | {r.steps_measured} | {_fmt(r.step_ms, '.1f')} "
            f"| {_fmt(r.tps, ',.0f')} | {_fmt(r.peak_memory_gib, '.2f')} | {_fmt(r.peak_active_gib, '.2f')} "
            f"| {_fmt(r.final_loss, '.4f')} "
            f"| {_fmt(ratio(r, base), '.3f')}× | {'; '.join(r.notes)} |"
        )
    for r in runs[1:]:
        out.append(f"\n{r.name}/{base.name} step-time ratio: {_fmt(ratio(r, base), '.3f')}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = parser("titan_nvfp4.tools.e2e_report", __doc__)
    ap.add_argument("logs", nargs="+", type=Path, metavar="LOG",
                    help="saved console logs of training runs, the baseline (BF16) first; a missing one gets a "
                         "'log missing' row and exit status 1")
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out (default 5)")
    ap.add_argument("--tokens-per-step", type=int, help="override B*A*S read from the log")
    ap.add_argument("--json", type=Path, help="also write the summaries here")
    args = ap.parse_args(argv)
    if args.skip < 0:
        ap.error(f"--skip must be >= 0, got {args.skip}")
    if args.tokens_per_step is not None and args.tokens_per_step < 1:
        ap.error(f"--tokens-per-step must be a positive integer, got {args.tokens_per_step}")
    if args.json:
        require_output(ap.prog, args.json, "--json", args.logs)
    for p in args.logs:
        if p.is_dir():
            fail(ap.prog, f"{p} is a folder, not a log file")
    runs = []
    for p in args.logs:  # a missing log (the run never started) still gets its row
        try:
            text = p.read_text(errors="replace") if p.exists() else ""
        except OSError as e:
            fail(ap.prog, f"cannot read {p}: {e.strerror}")
        runs.append(summarize_run(p.stem, text, args.skip, args.tokens_per_step, active_memory(p)))
        if not p.exists():
            runs[-1].notes.insert(0, "log missing")
    if not any(p.exists() for p in args.logs):
        fail(ap.prog, f"no such file: {args.logs[0]}")
    print(to_markdown(runs, args.skip), end="")
    if args.json:
        rows = [asdict(r) | {"step_time_ratio": ratio(r, runs[0])} for r in runs]
        with writing(ap.prog, args.json, "--json"):
            write_text(args.json, json.dumps({"skip": args.skip, "runs": rows}, indent=2) + "\n", "--json")
    missing = [str(p) for p in args.logs if not p.exists()]
    if missing:
        print(f"{ap.prog}: missing logs: {', '.join(missing)}", file=sys.stderr)
    empty = [str(p) for p, r in zip(args.logs, runs) if p.exists() and not r.steps_logged]
    if empty:
        print(f"{ap.prog}: no TorchTitan metric lines in: {', '.join(empty)}", file=sys.stderr)
    return 1 if missing or empty else 0


if __name__ == "__main__":
    raise SystemExit(main())
