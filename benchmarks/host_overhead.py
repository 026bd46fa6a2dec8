"""Host (CPU) time per call of each NVFP4 launcher, on inputs small enough that the GPU never limits:
what a Linear forward+backward pays in Python and launch overhead before any kernel runs.

    python benchmarks/host_overhead.py [--cprofile [--pstats PREFIX] | --torch-profile]

Host µs per call: the mean of 100 calls after 20 warm-up calls, with no synchronization inside (few
enough calls that the launch queue never fills). Then the same calls alternating between Triton's own
launch path and the compiled-kernel cache (``titan_nvfp4/kernels/launch.py``), best of 3 each.
Host CPUs differ between machines: compare figures within one run.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.kernels import gemm as g
from titan_nvfp4.kernels.quantize import quantize_operand, quantize_weight_2d
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops import library

# benchmarks/ is on sys.path when run as a script
from timing import require_cuda


def host_us(fn, n=100) -> float:  # few enough calls that the launch queue never fills
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def _launch_paths(x: torch.Tensor) -> dict:
    """One small Triton kernel (the amax of x) launched four ways: through the autotuner, through the
    JIT with fixed tiles, through the cached compiled kernel's launcher (what a launcher that skips
    Triton's per-call binding would cost), and that plus the stream query."""
    import triton

    from titan_nvfp4.kernels import quantize as q
    from titan_nvfp4.kernels.launch import tune_bucket

    buf = torch.zeros(2, dtype=torch.int32, device=x.device)
    M, K = x.shape
    args = (x, M, K, x.stride(0), x.stride(1), buf, buf, buf, 1)
    flags = dict(ROW=True, COL=False, RHT=True, GROUPED=False)
    grid = (triton.cdiv(M, 16 * 2), triton.cdiv(K, 128))
    tm = tune_bucket(M)
    compiled = q._amax_kernel[grid](*args, tm, **flags, G=2, BK=128, num_warps=2)
    all_args = (*args, tm, True, False, True, False, 2, 128, False)  # every parameter in order, constexprs included
    stream = torch.cuda.current_stream().cuda_stream

    def direct(stream_query: bool):
        s = torch.cuda.current_stream().cuda_stream if stream_query else stream
        compiled.run(grid[0], grid[1], 1, s, compiled.function, compiled.packed_metadata, None, None, None, *all_args)

    return {
        "amax kernel via the autotuner": lambda: q.launch_tuned(q._amax_kernel, q._amax_autotuned, x, M, K, *args, **flags),
        "amax kernel via the JIT, fixed tiles": lambda: q._amax_kernel[grid](*args, tm, **flags, G=2, BK=128, num_warps=2),
        "amax kernel via its compiled launcher": lambda: direct(False),
        "amax kernel via its compiled launcher + stream query": lambda: direct(True),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cprofile", action="store_true", help="cProfile the heaviest launchers (20 calls each)")
    ap.add_argument("--pstats", metavar="PREFIX", help="with --cprofile: also dump each whole profile to PREFIX_<name>.prof")
    ap.add_argument("--torch-profile", action="store_true", help="torch.profiler: the torch ops of 20 Linear steps")
    args = ap.parse_args()
    require_cuda()
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)  # large enough to take the autotuned paths
    signs = rht_signs(0, "cuda")
    seed = torch.full((1,), 3, dtype=torch.int64, device="cuda")
    a, _ = quantize_operand(x[:256])
    b, _ = quantize_weight_2d(x[:256], emit_transpose=False)
    layer = NVFP4Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16, recipe=NVFP4Recipe())
    xx = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def linear_step():
        layer(xx).sum().backward()

    cases = {**_launch_paths(x),
        "empty kernel-free torch op (torch.empty)": lambda: torch.empty(16, device="cuda"),
        "tiny torch kernel (x.add_(0))": lambda: x.add_(0),
        "quantize_operand row (amax + quantize)": lambda: quantize_operand(x),
        "quantize_operand row + RHT col": lambda: quantize_operand(x, colwise=True, signs=signs),
        "quantize_operand SR row + col": lambda: quantize_operand(x, colwise=True, signs=signs, stochastic_row=True,
                                                                  stochastic_col=True, seed=seed),
        "library.quantize, eager (direct, row + col)": lambda: library.quantize(x, signs, rowwise=True, colwise=True),
        "custom op titan_nvfp4::quantize (row + col)": lambda: library.quantize.op(x, signs, rowwise=True,
                                                                                  colwise=True),
        "quantize_weight_2d": lambda: quantize_weight_2d(x),
        "dequantize_fp16 (staging)": lambda: g.dequantize_fp16(b),
        "gemm, A staged, TMA": lambda: g.nvfp4_gemm_triton(a, b, torch.bfloat16, stage_a=True),
        "gemm, A in registers, TMA": lambda: g.nvfp4_gemm_triton(a, b, torch.bfloat16, stage_a=False),
        "gemm, A staged, no TMA": lambda: g.nvfp4_gemm_triton(a, b, torch.bfloat16, stage_a=True, use_tma=False),
        "gemm, autotune off": lambda: g.nvfp4_gemm_triton(a, b, torch.bfloat16, autotune=False),
        "NVFP4Linear forward+backward (2048x4096x4096)": linear_step,
    }
    if args.torch_profile:  # the torch ops of a Linear step and their host time
        from torch.profiler import ProfilerActivity, profile
        host_us(linear_step, 5)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                linear_step()
        torch.cuda.synchronize()
        print("== NVFP4Linear forward+backward (2048x4096x4096): torch ops of 20 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    if args.cprofile:  # where the host time of the heaviest launchers goes
        import cProfile
        import pstats
        for name in ("quantize_operand SR row + col", "gemm, A staged, TMA", "NVFP4Linear forward+backward (2048x4096x4096)"):
            host_us(cases[name], 5)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                cases[name]()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n== {name}: 20 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            if args.pstats:  # the whole profile, for pstats elsewhere
                prof.dump_stats(args.pstats + "_" + re.sub(r"\W+", "_", name.split()[0].lower()) + ".prof")
        return
    print("| launcher | host µs per call |")
    print("| --- | ---: |")
    for name, fn in cases.items():
        print(f"| {name} | {host_us(fn):.1f} |")
    from titan_nvfp4.kernels import launch
    print("\ncompiled-kernel cache (kernel: specializations, cached launches): "
          + "; ".join(f"{k}: {v[0]}, {v[1]}" for k, v in launch.stats().items()))
    # the same calls with every kernel launched through Triton's own path, alternating, same process
    print("\n| launcher | Triton's launch path µs | compiled-kernel cache µs |")
    print("| --- | ---: | ---: |")
    for name in ("quantize_operand row (amax + quantize)", "quantize_operand SR row + col", "quantize_weight_2d",
                 "gemm, A staged, TMA", "NVFP4Linear forward+backward (2048x4096x4096)"):
        t = {False: [], True: []}
        for _ in range(3):
            for on in (False, True):
                launch.ENABLED = on
                t[on].append(host_us(cases[name]))
        launch.ENABLED = True
        print(f"| {name} | {min(t[False]):.1f} | {min(t[True]):.1f} |")


if __name__ == "__main__":
    main()
