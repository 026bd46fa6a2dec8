"""The package's MXFP8 kernels over tile configs (graph-timed, best config each): the both-ways kernel
rounding on fp32 bits against the hardware E4M3 conversion (``--hw``), and the columns-only kernel
(``--cols-tiles``). A variant storing the column operand in x's own layout was timed here on
2026-11-26 and dropped (BENCHMARKS.md, twenty-fifth entry; it is in commit 9038bb8).

    python benchmarks/mxfp8_variants.py [--m 16384 --k 4096] [--both-ways] [--hw 0,1] [--cols-tiles]

Bytes counted: the bf16 input read plus every element and scale written.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench_kernels import copy_ceiling  # benchmarks/ is on sys.path when run as a script
from titan_nvfp4.kernels import mxfp8 as mx
from titan_nvfp4.kernels.nvfp4_jit import nan_to_inf_abs


CONFIGS = [(32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 8), (32, 256, 4), (64, 256, 8), (128, 128, 8),
           (32, 64, 2), (64, 128, 8), (128, 64, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--configs", help="comma-separated BMxBKxWARPS tile configs (default: CONFIGS)")
    ap.add_argument("--both-ways", action="store_true", help="time the both-ways kernel (rows, columns, both)")
    ap.add_argument("--hw", default="0", help="package kernel: 0 rounds on fp32 bits, 1 the hardware conversion")
    ap.add_argument("--cols-tiles", action="store_true",
                    help="also time the package's columns-only kernel (32 row tiles) over its tile configs")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")] if args.configs else CONFIGS
    M, K = args.m, args.k
    Mpad = M + (-M) % 32
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ceiling = copy_ceiling()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; x bf16 {M}x{K}; "
          f"copy ceiling {ceiling / 1e12:.2f} TB/s")
    print("| kernel | E4M3 rounding | operands | best BMxBKxWARPS | graph ms | of copy | all configs ms |")
    print("| --- | --- | --- | --- | ---: | ---: | --- |")
    f8, u8, bf = torch.float8_e4m3fn, torch.uint8, torch.bfloat16
    cases = [(row, col, staged, hw) for row, col, staged in ((True, False, False), (True, True, False),
                                                            (True, True, True), (False, True, False))
             for hw in (0, 1) if str(hw) in args.hw.split(",")] if args.both_ways else []
    if args.cols_tiles:
        for staged in (False, True):
            ed = bf if staged else f8
            cd = torch.empty((K, Mpad), dtype=ed, device="cuda")
            cs = torch.empty((K, Mpad // 32), dtype=u8, device="cuda")
            nbytes = 2 * M * K + M * K * (2 if staged else 1) + (0 if staged else M * K // 32)
            times = {}
            for bk, w, gg in [(bk, w, gg) for bk in (32, 64, 128, 256) for w in (1, 2, 4) for gg in (1, 2, 4)
                              if bk >= 32 * w and bk * gg <= 256 * w]:
                grid = mx._cols_grid(Mpad, K, gg, bk)
                fn = lambda: mx._mxfp8_cols_kernel[grid](x, M, K, x.stride(0), 1, cd, cs, Mpad, G=gg, BK=bk,  # noqa: E731
                                                          STAGED=staged, HW=True, num_warps=w)
                fn()
                torch.cuda.synchronize()
                times[(f"{gg}x32", bk, w)] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
            best = min(times, key=times.get)
            t = times[best]
            allc = ", ".join(f"{bm}x{bk}x{w} {v:.3f}" for (bm, bk, w), v in times.items())
            print(f"| columns kernel | hardware | cols{' staged bf16' if staged else ''} | {best[0]}x{best[1]}x{best[2]} | "
                  f"{t:.3f} | {nbytes / (t * 1e-3) / ceiling:.0%} | {allc} |", flush=True)
    for row, col, staged, hw in cases:
        ed = bf if staged else f8
        rd = torch.empty((M, K) if row else (1,), dtype=ed, device="cuda")
        rs = torch.empty((M, K // 32) if row and not staged else (1,), dtype=u8, device="cuda")
        cd = torch.empty((K, Mpad) if col else (1,), dtype=ed, device="cuda")
        cs = torch.empty((K, Mpad // 32) if col and not staged else (1,), dtype=u8, device="cuda")
        nbytes = 2 * M * K + (row + col) * M * K * (2 if staged else 1) + (0 if staged else (row + col) * M * K // 32)
        times = {}
        for bm, bk, w in configs:
            grid = (triton.cdiv(Mpad, bm), triton.cdiv(K, bk))
            fn = lambda: mx._mxfp8_kernel[grid](x, M, K, x.stride(0), 1, rd, rs, cd, cs, Mpad, ROW=row,  # noqa: E731
                                                 COL=col, BM=bm, BK=bk, STAGED=staged, HW=bool(hw), num_warps=w)
            fn()
            torch.cuda.synchronize()
            times[(bm, bk, w)] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        best = min(times, key=times.get)
        t = times[best]
        what = " + ".join(n for n, on in (("rows", row), ("cols", col)) if on) + (" staged bf16" if staged else "")
        allc = ", ".join(f"{bm}x{bk}x{w} {v:.3f}" for (bm, bk, w), v in times.items())
        print(f"| both-ways kernel | {'hardware' if hw else 'fp32 bits'} | {what} | {best[0]}x{best[1]}x{best[2]} | "
              f"{t:.3f} | {nbytes / (t * 1e-3) / ceiling:.0%} | {allc} |", flush=True)


if __name__ == "__main__":
    main()
