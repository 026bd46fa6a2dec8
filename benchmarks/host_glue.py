"""Host time of the Python around the kernels: one NVFP4Linear forward+backward on the emulated path with
every kernel launch stubbed out, so that it runs on a CPU without a GPU.

    python benchmarks/host_glue.py [--shape 64 64 64] [--siblings S | --experts E] [--reps 200] [--repeats 15]
                                   [--profile tottime]

Small models are host-bound in eager mode (docs/performance.md, "The README's debug model"): what one
NVFP4Linear spends outside its launches (argument checks, allocations, operand wrappers, the autograd
function) adds to every layer's step. On a GPU the same code pays more per torch call (CUDA allocations,
stream queries), so read the figure as relative: before and after a change, on one machine. The outputs
are garbage (no kernel runs); the launches per call are counted. ``--siblings S`` runs S Linears on one X
(wq, wk, wv: S = 3), the case where eager siblings share X's quantization. ``--experts E`` times the routed experts'
grouped GEMM (nvfp4_grouped_mm) instead. ``--profile SORT`` prints cProfile's
top 40 entries (sorted by tottime or cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # the emulated backend's Python path on the CPU (kernels stubbed below)

import torch  # noqa: E402

import titan_nvfp4.kernels.expert_map as kernel_expert_map  # noqa: E402
import titan_nvfp4.kernels.gemm as kernel_gemm  # noqa: E402
import titan_nvfp4.kernels.grouped_gemm as kernel_grouped_gemm  # noqa: E402
import titan_nvfp4.kernels.quantize as kernel_quantize  # noqa: E402
from titan_nvfp4 import NVFP4Linear  # noqa: E402
from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm  # noqa: E402
from titan_nvfp4.autograd.linear_function import sr_counter  # noqa: E402
from titan_nvfp4.recipe.nvfp4_recipe import NVFP4Recipe  # noqa: E402

LAUNCHES = [0]


def _no_launch(fn, grid, *args, **kwargs) -> None:
    LAUNCHES[0] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=(64, 64, 64), metavar=("M", "K", "N"),
                    help="tokens, in_features, out_features (multiples of 16; small, so that the CPU work of autograd's "
                         "own ops (gradient fills and accumulation) stays out of the figure)")
    ap.add_argument("--reps", type=int, default=200, help="forward+backward calls per timing")
    ap.add_argument("--repeats", type=int, default=15, help="timings; the best is printed (the least disturbed)")
    ap.add_argument("--siblings", type=int, default=1, metavar="S",
                    help="S Linears reading the same X (their outputs summed), as wq, wk and wv do")
    ap.add_argument("--experts", type=int, default=0, metavar="E",
                    help="time nvfp4_grouped_mm over E experts instead (M tokens split evenly, weights [E, N, K])")
    ap.add_argument("--profile", choices=("tottime", "cumulative"), help="print cProfile's top 40 entries")
    args = ap.parse_args()
    for module in (kernel_quantize, kernel_gemm, kernel_grouped_gemm, kernel_expert_map):
        module.launch = _no_launch
    m, k, n = args.shape
    torch.manual_seed(0)
    recipe = NVFP4Recipe(gemm_backend="emulated")
    x = torch.randn(m, k, requires_grad=True)
    if args.experts:
        e = args.experts
        weight = torch.randn(e, n, k, requires_grad=True)
        offsets = torch.arange(1, e + 1, dtype=torch.int32) * (m // e // 16 * 16)
        counter = sr_counter(recipe, 0)

        def forward() -> torch.Tensor:
            return nvfp4_grouped_mm(x.bfloat16(), weight, offsets, None, recipe, counter, aligned=True)
        what = f"nvfp4_grouped_mm forward+backward, {e} experts, {m}x{k}x{n}"
    else:
        layers = [NVFP4Linear(k, n, bias=False, recipe=recipe) for _ in range(args.siblings)]

        def forward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return sum(layer(x) for layer in layers)
        what = f"NVFP4Linear forward+backward {m}x{k}x{n}" + (f", {args.siblings} siblings" if args.siblings > 1 else "")

    def step() -> None:
        y = forward()
        y.backward(torch.ones_like(y))

    for _ in range(10):
        step()
    LAUNCHES[0] = 0
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(args.reps):
            step()
        times.append((time.perf_counter() - t) / args.reps * 1e6)
    launches = LAUNCHES[0] / (args.reps * args.repeats)
    print(f"{what}, kernels stubbed: host {min(times):.0f} µs "
          f"(best of {args.repeats}; median {statistics.median(times):.0f}), {launches:.1f} launches")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.reps):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats(args.profile).print_stats(40)


if __name__ == "__main__":
    main()
