"""What is live at a training step's memory peak, by the code that allocated it, from CUDA memory snapshots.

    python -m titan_nvfp4.tools.memory_peak bf16.pickle nvfp4.pickle [--top 15] [--out peak.md]

Each input is a snapshot ``torch.cuda.memory._snapshot()`` pickled with allocation history on, as TorchTitan writes
it under ``--profiling.enable_memory_snapshot`` (``<dump>/memory_snapshot/iteration_N/rank0_memory_snapshot.pickle``;
scripts/profile_step.sh runs this tool on both arms). The history is replayed backwards from the snapshot's live
blocks (an allocation undone, a completed free redone), which gives the live set at every event of the recorded
window, blocks allocated before the window included; the largest total is the peak. Its blocks are grouped by the
innermost frame of TorchTitan's or this package's code that allocated them (else the innermost Python frame outside
torch), with the bytes, the block count and the share of the peak. The first input is the baseline: each later one
gets its peak's difference to it. ``--out`` is written atomically and may not name an input.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_text
from .cli import fail, parser, require_inputs, require_output, writing

_OURS = ("titan_nvfp4/", "torchtitan/")
_GIB = 2**30


@dataclass
class Peak:
    name: str
    total: int  # bytes live at the peak
    at_event: int  # events of the window before the peak (the window's length: the snapshot itself)
    events: int
    by_site: dict[str, tuple[int, int]] = field(default_factory=dict)  # site -> (bytes, blocks)
    notes: list[str] = field(default_factory=list)


def site(frames: list[dict] | None) -> str:
    """The code an allocation is charged to: the innermost frame in TorchTitan's or this package's files, else the
    innermost Python frame outside torch, as "path:line function" (the path from the package folder on)."""
    frames = frames or []
    for f in frames:
        name = f.get("filename", "")
        for pkg in _OURS:
            if pkg in name:
                return f"{pkg}{name.split(pkg, 1)[1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{name}:{f.get('line')} {f.get('name')}"
    return "no Python frame (C++ only, or allocated before the history started)"


def _live_at_end(snapshot: dict, device: int) -> dict[int, tuple[int, list | None]]:
    """{address: (size, frames of its allocation)} of the snapshot's allocated blocks on ``device``."""
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[addr] = (block["size"], block.get("frames"))
            addr += block["size"]
    return live


def peak(name: str, snapshot: dict, device: int = 0) -> Peak:
    """The peak of live bytes over the snapshot's recorded window on ``device``, and what was live then."""
    traces = snapshot.get("device_traces") or []
    events = [e for e in (traces[device] if device < len(traces) else [])
              if e.get("action") in ("alloc", "free_completed")]
    live = _live_at_end(snapshot, device)
    total = sum(size for size, _ in live.values())
    best, best_at, best_live = total, len(events), dict(live)
    mismatched = 0
    for i in range(len(events) - 1, -1, -1):  # undo events[i]: the state before it
        e = events[i]
        addr, size = e["addr"], e["size"]
        if e["action"] == "alloc":
            if addr in live:
                total -= live.pop(addr)[0]
            else:
                mismatched += 1
        else:  # a completed free: the block was live before it
            if addr in live:
                mismatched += 1
            else:
                live[addr] = (size, None)  # allocated before the window, unless an alloc event below says where
                total += size
        if total > best:
            best, best_at, best_live = total, i, dict(live)
    result = Peak(name, best, best_at, len(events))
    if mismatched:
        result.notes.append(f"{mismatched} events did not match the live blocks (a history that lost entries)")
    # the frames of the allocation of each block live at the peak: its last alloc event at or before the peak
    last_alloc = {}
    for i, e in enumerate(events[:best_at]):
        if e["action"] == "alloc":
            last_alloc[e["addr"]] = e.get("frames")
    for addr, (size, frames) in best_live.items():
        key = site(last_alloc[addr]) if addr in last_alloc else site(frames)
        nbytes, blocks = result.by_site.get(key, (0, 0))
        result.by_site[key] = (nbytes + size, blocks + 1)
    return result


def to_markdown(peaks: list[Peak], top: int) -> str:
    out = []
    base = peaks[0]
    for p in peaks:
        diff = "" if p is base else f"; {(p.total - base.total) / _GIB:+.2f} GiB against {base.name}"
        out += [f"## {p.name}: peak {p.total / _GIB:.2f} GiB live, at event {p.at_event} of {p.events}{diff}", ""]
        out += ["| allocated at | GiB | blocks | share |", "| --- | ---: | ---: | ---: |"]
        rows = sorted(p.by_site.items(), key=lambda kv: -kv[1][0])
        for key, (nbytes, blocks) in rows[:top]:
            out.append(f"| `{key}` | {nbytes / _GIB:.3f} | {blocks} | {100 * nbytes / max(p.total, 1):.1f}% |")
        rest = rows[top:]
        if rest:
            nbytes = sum(v[0] for _, v in rest)
            out.append(f"| {len(rest)} other sites | {nbytes / _GIB:.3f} | {sum(v[1] for _, v in rest)} "
                       f"| {100 * nbytes / max(p.total, 1):.1f}% |")
        out += [f"\n{note}" for note in p.notes] + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("titan_nvfp4.tools.memory_peak", __doc__)
    ap.add_argument("snapshots", nargs="+", type=Path, metavar="SNAPSHOT",
                    help="pickled CUDA memory snapshots with allocation history, the baseline first")
    ap.add_argument("--top", type=int, default=15, help="sites listed per snapshot (default 15)")
    ap.add_argument("--device", type=int, default=0, help="the CUDA device of the snapshots (default 0)")
    ap.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error(f"--top must be >= 1, got {args.top}")
    require_inputs(ap.prog, args.snapshots, "snapshot")
    if args.out:
        require_output(ap.prog, args.out, "--out", args.snapshots)
    peaks = []
    for path in args.snapshots:
        try:
            with open(path, "rb") as f:
                snapshot = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            fail(ap.prog, f"cannot read {path} as a pickled memory snapshot: {e}")
        if not isinstance(snapshot, dict) or "segments" not in snapshot:
            fail(ap.prog, f"{path} is not a CUDA memory snapshot (no 'segments')")
        if not any(snapshot.get("device_traces") or []):
            fail(ap.prog, f"{path} holds no allocation history: take it with torch.cuda.memory._record_memory_history "
                          "on (TorchTitan: --profiling.enable_memory_snapshot)")
        peaks.append(peak(str(path) if path.stem.startswith("rank") else path.stem, snapshot, args.device))
    text = to_markdown(peaks, args.top)
    print(text, end="")
    if args.out:
        with writing(ap.prog, args.out, "--out"):
            write_text(args.out, text, "--out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
