"""Where a training step's time goes, from PyTorch profiler chrome traces (scripts/profile_step.sh writes them):

    python benchmarks/trace_breakdown.py bf16_trace.json.gz nvfp4_trace.json.gz [--top 12]

Per trace: the step's wall time (its ProfilerStep span), GPU busy time (the union of kernel intervals) and
idle time, GPU time by kernel category (GEMMs, our NVFP4 quantization / GEMM / staging kernels, inductor's
fused kernels, attention, other), the number of kernel launches per category, and the top kernels by time.
Host side: the time the step's thread spends in our custom ops (``titan_nvfp4::*``) and in kernel-launch
API calls, and the top-level host operations (those no other operation encloses) by time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

#: (category, pattern on the kernel name), first match wins
CATEGORIES = (
    ("inductor fused", re.compile(r"^triton_")),  # inductor's own kernels (their names list the fused ops)
    ("mxfp8 quantize (ours)", re.compile(r"_mxfp8")),
    ("nvfp4 gemm (ours)", re.compile(r"_nvfp4_gemm|_grouped_rows|_grouped_tokens")),
    ("nvfp4 quantize/stage (ours)", re.compile(r"_quantize|_amax_kernel|_dequant_kernel|_swiglu_|_encode_rows|_tile_scales")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("cuBLAS gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
)


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if pat.search(name):
            return cat
    return "other aten"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit("no ProfilerStep span in the trace")
    step = max(steps, key=lambda e: e["dur"])
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    # a kernel belongs to the step if it starts within it (GPU work lags the host's step span a little)
    kernels = [e for e in kernels if t0 <= e["ts"] <= t1 + 0.5 * step["dur"]]
    gpu_end = max((e["ts"] + e["dur"] for e in kernels), default=t1)
    by_cat, launches, by_name = defaultdict(float), defaultdict(int), defaultdict(float)
    for e in kernels:
        c = category(e["name"])
        by_cat[c] += e["dur"]
        launches[c] += 1
        by_name[e["name"]] += e["dur"]
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    wall = max(t1, gpu_end) - t0
    return dict(wall=wall, host=step["dur"], busy=busy, by_cat=by_cat, launches=launches, by_name=by_name,
                n=len(kernels), **host_breakdown(events, step))


def top_level(ops: list[dict]) -> list[dict]:
    """The operations of one thread that no other operation of the list encloses."""
    out, end = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def host_breakdown(events: list[dict], step: dict) -> dict:
    """Host time of the step's thread: in our custom ops, in launch API calls, and per top-level operation."""
    t0, t1, tid = step["ts"], step["ts"] + step["dur"], step.get("tid")
    inside = [e for e in events if e.get("ph") == "X" and e.get("tid") == tid and t0 <= e["ts"] < t1
              and e is not step]
    ops = [e for e in inside if e.get("cat") in ("cpu_op", "user_annotation")]
    ours = top_level([e for e in ops if str(e["name"]).startswith("titan_nvfp4::")])
    api = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in str(e["name"])]
    by_op = defaultdict(float)
    for e in top_level(ops):
        by_op[re.sub(r"#\d+$", "", str(e["name"]))] += e["dur"]
    return dict(our_ops=sum(e["dur"] for e in ours), our_ops_n=len(ours), launch_api=sum(e["dur"] for e in api),
                launch_api_n=len(api), host_ops=by_op)


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/trace_breakdown.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="chrome traces (.json or .json.gz), one per arm")
    p.add_argument("--top", type=int, default=12, help="kernels listed by GPU time per trace")
    args = p.parse_args()
    results = {t.name.split("_trace")[0]: breakdown(load(t)) for t in args.traces}
    names = list(results)
    print("| ms | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for key, label in (("wall", "step (host span to last kernel)"), ("busy", "GPU busy"),):
        print(f"| {label} | " + " | ".join(f"{r[key] / 1e3:.1f}" for r in results.values()) + " |")
    print("| GPU idle | " + " | ".join(f"{(r['wall'] - r['busy']) / 1e3:.1f}" for r in results.values()) + " |")
    cats = sorted({c for r in results.values() for c in r["by_cat"]},
                  key=lambda c: -max(r["by_cat"].get(c, 0) for r in results.values()))
    for c in cats:
        print(f"| {c} | " + " | ".join(f"{r['by_cat'].get(c, 0) / 1e3:.1f} ({r['launches'].get(c, 0)})"
                                        for r in results.values()) + " |")
    print("| kernel launches | " + " | ".join(str(r["n"]) for r in results.values()) + " |")
    print("| host: in titan_nvfp4 ops (calls) | " + " | ".join(f"{r['our_ops'] / 1e3:.1f} ({r['our_ops_n']})"
                                                          for r in results.values()) + " |")
    print("| host: launch API calls (calls) | " + " | ".join(f"{r['launch_api'] / 1e3:.1f} ({r['launch_api_n']})"
                                                        for r in results.values()) + " |")
    for name, r in results.items():
        print(f"\n{name}: top-level host operations by time (ms)")
        for k, v in sorted(r["host_ops"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {v / 1e3:8.2f}  {k[:120]}")
    for name, r in results.items():
        print(f"\n{name}: top kernels by GPU time (ms)")
        for k, v in sorted(r["by_name"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {v / 1e3:8.2f}  {category(k):22s} {k[:110]}")


if __name__ == "__main__":
    main()
