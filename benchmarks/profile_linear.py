"""Where an NVFP4Linear forward+backward spends its time: wall time per step (CUDA events), the GPU
time of each kernel and the host time of each op (torch.profiler), and a cProfile of the Python side.

    python benchmarks/profile_linear.py [--m 2048 --k 4096 --n 4096] [--stage-a 0|1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe

# benchmarks/ is on sys.path when run as a script
from timing import require_cuda


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--stage-a", type=int, choices=(0, 1), default=None)
    args = p.parse_args()
    require_cuda()
    if args.stage_a is not None:
        from titan_nvfp4.kernels import gemm

        gemm.STAGE_A = bool(args.stage_a)
    layer = NVFP4Linear(args.k, args.n, bias=False, device="cuda", dtype=torch.bfloat16, recipe=NVFP4Recipe())
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.m, args.n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)
        x.grad = None
        layer.weight.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"{args.m}x{args.k}x{args.n}: {start.elapsed_time(end) / 20:.3f} ms per forward+backward (wall, 20 steps)")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
