"""Expert-parallel token churn on one GPU: an NVFP4 expert block whose routed-token count changes
every step, as an EP rank receives it, against the same block at a fixed count.

    python benchmarks/token_churn.py [--shape deepseek_v3_16b] [--ep 2] [--steps 30] [--bf16] [--json out.json]

Under TorchTitan's expert parallelism each rank gets the tokens routed to its experts by all ranks, a
different number every step (padded to tokens·k/ep + 16·local experts, then to 16). A kernel whose
autotuning key holds that count re-tunes every step (benchmarks every config). The script times each
step (wall clock, synchronized) and prints the first steps, the median of the rest against the
fixed-count block, and how many entries each autotuner's cache and the launch cache hold. Run it
from a checkout, or with PYTHONPATH pointing at another titan_nvfp4 to compare versions. --bf16 adds
the same churn on BF16 grouped GEMMs (torch._grouped_mm): what a changing count costs without any
NVFP4 kernel (new allocation sizes, cuBLAS heuristics), to tell it from ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.kernels import launch as L
from titan_nvfp4.autograd.linear_function import sr_counter

# benchmarks/ is on sys.path when run as a script
from bench_grouped import SHAPES, bf16_mm, fwd_bwd, nvfp4_mm_factory
from timing import header, require_cuda


def received_rows(E_local: int, tokens: int, top_k: int, ep: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(cumulative group ends, multiples of 16; rows) of one EP rank's local experts for one step:
    top-k of E_local·ep experts with a router bias that drifts from step to step, and the row count
    TorchTitan's _permute allocates for what the rank received (+16 per local expert, to 16)."""
    E = E_local * ep
    bias = torch.randn(E, generator=gen) * 0.1
    choice = (torch.rand(tokens * ep, E, generator=gen) + bias).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(choice, minlength=E)[:E_local]  # rank 0's experts, from every rank's tokens
    rows = triton.cdiv(int(counts.sum()) + 16 * E_local, 16) * 16
    return torch.cumsum((counts + 15) // 16 * 16, 0).to(torch.int32), rows


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek_v3_16b", choices=[k for k, v in SHAPES.items() if not v[5]])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bf16", action="store_true", help="also run the churn on BF16 grouped GEMMs (a control)")
    ap.add_argument("--json")
    args = ap.parse_args()
    require_cuda()
    E, dim, hidden, tokens, top_k, _ = SHAPES[args.shape]
    E_local = E // args.ep
    recipe = NVFP4Recipe(gemm_backend="emulated")
    counters = [sr_counter(recipe, 1 << 20 | i, "cuda") for i in range(3)]
    nv = nvfp4_mm_factory(recipe, counters)
    ws = [(torch.randn(E_local, hidden, dim, device="cuda", dtype=torch.bfloat16) * dim ** -0.5).requires_grad_(),
          (torch.randn(E_local, dim, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5).requires_grad_(),
          (torch.randn(E_local, hidden, dim, device="cuda", dtype=torch.bfloat16) * dim ** -0.5).requires_grad_()]
    cap = tokens * top_k + 16 * E_local  # the rows of a perfectly balanced split

    def step_inputs(routed):
        offsets, rows = routed
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        return x, ws, offsets.cuda(), dy

    def churn(mm, progress: bool) -> tuple[float, list[float], list[int]]:
        """(fixed-count ms, ms of each changing-count step, its row counts) of the block with grouped mm:
        the counts come from the same seeds for every mm, so the arms see the same sequence."""
        step_at = lambda routed: fwd_bwd(mm, *step_inputs(routed), False)  # noqa: E731
        fixed = step_at(received_rows(E_local, tokens, top_k, args.ep, torch.Generator().manual_seed(1)))
        for _ in range(3):
            timed(fixed)  # tunes and compiles for its count
        fixed_ms = statistics.median(timed(fixed) for _ in range(10))
        gen, times, counts = torch.Generator().manual_seed(0), [], []
        if progress:
            print(f"fixed count {fixed_ms:.2f} ms; changing count, step by step (rows: ms):", flush=True)
        for i in range(args.steps):
            routed = received_rows(E_local, tokens, top_k, args.ep, gen)
            counts.append(routed[1])
            times.append(timed(step_at(routed)))
            if progress:  # shown even if a slow version is cut off
                print(f"  {i + 1}: {counts[-1]}: {times[-1]:.1f}", flush=True)
        return fixed_ms, times, counts

    fixed_ms, times, counts = churn(nv, progress=True)
    tuners = {}
    for mod in ("quantize", "swiglu", "gemm", "grouped_gemm"):
        m = __import__(f"titan_nvfp4.kernels.{mod}", fromlist=["_"])
        for name, obj in vars(m).items():
            if isinstance(obj, triton.runtime.autotuner.Autotuner) and obj.cache:
                tuners[f"{mod}.{name}"] = len(obj.cache)
    later = statistics.median(times[5:]) if len(times) > 5 else float("nan")
    print(f"{header()}  {args.shape}, {E_local} local experts of {E} (EP {args.ep}), {args.steps} steps")
    print(f"routed rows per step: min {min(counts)}, max {max(counts)}, distinct {len(set(counts))} "
          f"(balanced: {cap})")
    print("step ms, first 5: " + ", ".join(f"{t:.1f}" for t in times[:5]))
    print(f"| block fwd+bwd | ms |\n| --- | ---: |\n| fixed count (median of 10) | {fixed_ms:.2f} |\n"
          f"| changing count, median of steps 6-{args.steps} | {later:.2f} |\n"
          f"| changing count, mean of all steps | {statistics.mean(times):.2f} |")
    print("autotuner cache entries: " + ", ".join(f"{k} {v}" for k, v in sorted(tuners.items())))
    print("launch cache (specializations, cached launches): " +
          ", ".join(f"{k} {v}" for k, v in sorted(L.stats().items())))
    bf16 = None
    if args.bf16:  # the same counts, in the same order, on BF16 grouped GEMMs
        b_fixed, b_times, _ = churn(bf16_mm, progress=False)
        bf16 = dict(fixed_ms=b_fixed, step_ms=b_times)
        b_later = statistics.median(b_times[5:]) if args.steps > 5 else float("nan")
        print(f"BF16 control: fixed count {b_fixed:.2f} ms, changing count median of steps 6-{args.steps} "
              f"{b_later:.2f} ms ({b_later / b_fixed:.2f}x; NVFP4: {later / fixed_ms:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), shape=args.shape, ep=args.ep, counts=counts,
                           step_ms=times, fixed_ms=fixed_ms, tuners=tuners, launch=L.stats(), bf16=bf16), f, indent=1)


if __name__ == "__main__":
    main()
