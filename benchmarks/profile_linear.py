"""Where an NVFP4Linear forward+backward spends its time: wall time per step (CUDA events), the GPU
time of each kernel and the host time of each op (torch.profiler), and a cProfile of the Python side.

    python benchmarks/profile_linear.py [--m 2048 --k 4096 --n 4096] [--stage-a 0|1] [--recipe PRESET]
    python benchmarks/profile_linear.py --m 32768 --k 2048 --n 5632 --recipe tetrajet2 --outcontrol

``--recipe``: a shipped preset (configs/); ``--outcontrol``: time the layer before and after OutControl selects its
channels (the preset's outcontrol_fraction, tetrajet2's 0.1; selected from this X's channel norms) in the same run,
then profile the selected layer: what TetraJet-v2's MXFP8 channels cost from the step after the selection window.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from titan_nvfp4 import NVFP4Linear, build_recipe
from titan_nvfp4.modules import outcontrol as oc

# benchmarks/ is on sys.path when run as a script
from timing import require_cuda


def _wall_ms(step, steps: int = 20) -> float:
    """Mean wall time of ``step`` over ``steps`` calls after 5 warm-up calls (CUDA events)."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--stage-a", type=int, choices=(0, 1), default=None)
    p.add_argument("--recipe", default="nvidia_paper", help="a shipped recipe preset (configs/)")
    p.add_argument("--outcontrol", action="store_true",
                   help="time the layer before and after OutControl selects its channels (module docstring)")
    args = p.parse_args()
    require_cuda()
    if args.stage_a is not None:
        from titan_nvfp4.kernels import gemm

        gemm.STAGE_A = bool(args.stage_a)
    recipe = build_recipe(args.recipe, {})
    if args.outcontrol and not recipe.outcontrol_fraction:
        raise SystemExit(f"profile_linear: --outcontrol needs a recipe with outcontrol_fraction > 0 ({args.recipe!r} "
                         "has none; tetrajet2 does)")
    layer = NVFP4Linear(args.k, args.n, bias=False, device="cuda", dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.m, args.n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)
        x.grad = None
        layer.weight.grad = None

    shape = f"{args.m}x{args.k}x{args.n}, {args.recipe}"
    plain = _wall_ms(step)
    print(f"{shape}: {plain:.3f} ms per forward+backward (wall, 20 steps)")
    if args.outcontrol:
        oc.record(layer, x)
        (name, k, kk), = oc.select_channels([layer])
        selected = _wall_ms(step)
        print(f"{shape}, OutControl selected ({k} of {kk} input channels in MXFP8): {selected:.3f} ms per "
              f"forward+backward ({selected / plain:.3f}x the unselected layer, same run)")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
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
