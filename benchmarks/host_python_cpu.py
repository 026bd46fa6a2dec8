"""The Python share of an NVFP4Linear's host time, measured without a GPU: the emulated backend's code
path on CPU tensors (Triton's interpreter mode selects it) with every kernel launch replaced by a
no-op, so what remains is our Python, the autograd and custom-op layers and torch's allocations.

    TRITON_INTERPRET=1 python benchmarks/host_python_cpu.py [--shape 256 256 256] [--cprofile N]

The CPU path differs from the GPU one in details (fixed tiles instead of autotuned, no TMA
descriptors), and a CPU torch op costs less host time than a CUDA one; use it to compare versions of
the Python on one machine, and benchmarks/host_overhead.py on a GPU for the real figure.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe  # noqa: E402
from titan_nvfp4.kernels import gemm, grouped_gemm, mxfp8, quantize  # noqa: E402


def no_launches() -> list:
    """Replace ``launch`` in every kernel module by a recorder that runs nothing; returns the record."""
    calls = []
    for mod in (gemm, grouped_gemm, mxfp8, quantize):
        mod.launch = lambda fn, grid, *a, **k: calls.append(getattr(fn, "__name__", type(fn).__name__))
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs=3, type=int, default=(256, 256, 256), metavar=("M", "K", "N"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cprofile", type=int, default=0, help="print the N functions of most own time")
    args = ap.parse_args()
    M, K, N = args.shape
    calls = no_launches()
    layer = NVFP4Linear(K, N, bias=False, dtype=torch.bfloat16, recipe=NVFP4Recipe(gemm_backend="emulated"))
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).sum().backward()

    for _ in range(10):
        step()
    calls.clear()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        best = min(best, (time.perf_counter() - t) / args.steps * 1e6)
    print(f"NVFP4Linear forward+backward {M}x{K}x{N}, emulated backend, launches skipped: {best:.0f} µs host "
          f"per step (best of 3 x {args.steps}); {len(calls) // (3 * args.steps)} launches per step")
    if args.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        st = pstats.Stats(prof)
        print(f"{st.total_calls / args.steps:.0f} Python function calls per step")
        st.sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
