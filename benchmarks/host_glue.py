"""Host time of the Python around the kernels: one NVFP4Linear forward+backward on the emulated path with
every kernel launch stubbed out, so that it runs on a CPU without a GPU.

    python benchmarks/host_glue.py [--shape 256 256 256] [--reps 200] [--repeats 5] [--profile tottime]

Small models are host-bound in eager mode (docs/performance.md, "The README's debug model"): what one
NVFP4Linear spends outside its launches (argument checks, allocations, operand wrappers, the autograd
function) adds to every layer's step. On a GPU the same code pays more per torch call (CUDA allocations,
stream queries), so read the figure as relative: before and after a change, on one machine. The outputs
are garbage (no kernel runs); the launches per call are counted. ``--profile SORT`` prints cProfile's
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

import titan_nvfp4.kernels.gemm as kernel_gemm  # noqa: E402
import titan_nvfp4.kernels.quantize as kernel_quantize  # noqa: E402
from titan_nvfp4 import NVFP4Linear  # noqa: E402
from titan_nvfp4.recipe import NVFP4Recipe  # noqa: E402

LAUNCHES = [0]


def _no_launch(fn, grid, *args, **kwargs) -> None:
    LAUNCHES[0] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=(256, 256, 256), metavar=("M", "K", "N"),
                    help="tokens, in_features, out_features (multiples of 16)")
    ap.add_argument("--reps", type=int, default=200, help="forward+backward calls per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings; the median is printed")
    ap.add_argument("--profile", choices=("tottime", "cumulative"), help="print cProfile's top 40 entries")
    args = ap.parse_args()
    for module in (kernel_quantize, kernel_gemm):
        module.launch = _no_launch
    m, k, n = args.shape
    torch.manual_seed(0)
    layer = NVFP4Linear(k, n, bias=False, recipe=NVFP4Recipe(gemm_backend="emulated"))
    x = torch.randn(m, k, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
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
    print(f"NVFP4Linear forward+backward {m}x{k}x{n}, kernels stubbed: host {statistics.median(times):.0f} µs "
          f"(median of {args.repeats}; range {min(times):.0f}-{max(times):.0f}), {launches:.1f} launches")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.reps):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats(args.profile).print_stats(40)


if __name__ == "__main__":
    main()
