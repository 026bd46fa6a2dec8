"""MXFP8 quantization layouts timed side by side (graph-timed, best tile config each): the package's
kernel (column operand stored transposed, [K, Mpad]) against a variant that stores the column operand
in x's own layout ([Mpad, K], scales [Mpad/32, K]), which a BF16 GEMM reads transposed at no cost; the
package's kernel rounding on fp32 bits against the hardware E4M3 conversion (``--hw``); and the
package's columns-only kernel over its tile configs (``--cols-tiles``).

    python benchmarks/mxfp8_variants.py [--m 16384 --k 4096] [--layouts transposed,x] [--hw 0,1] [--cols-tiles]

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


@triton.jit
def _mxfp8_same_layout_kernel(X, M, K, sxm, RD, RS, CD, CS, Mpad, ROW: tl.constexpr, COL: tl.constexpr,
                              BM: tl.constexpr, BK: tl.constexpr, STAGED: tl.constexpr):
    """As kernels/mxfp8.py, but CD [Mpad, K] and CS [Mpad/32, K]: the column operand untransposed."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    x = tl.load(X + rm[:, None].to(tl.int64) * sxm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                other=0.0).to(tl.float32)
    if ROW:
        blocks = tl.reshape(x, (BM, BK // 32, 32))
        e = mx._ceil_log2_div448(tl.max(nan_to_inf_abs(blocks), axis=2))
        q = mx._to_e4m3(blocks * mx._pow2_neg(e)[:, :, None])
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        if STAGED:
            v = (q.to(tl.float32) * mx._pow2_pos(e)[:, :, None]).to(tl.bfloat16)
            tl.store(RD + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(v, (BM, BK)), mask=mask)
        else:
            tl.store(RD + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(q, (BM, BK)), mask=mask)
            rs = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
            tl.store(RS + rm[:, None].to(tl.int64) * (K // 32) + rs[None, :], (e + 127).to(tl.uint8),
                     mask=(rm < M)[:, None] & (rs < K // 32)[None, :])
    if COL:
        blocks = tl.reshape(x, (BM // 32, 32, BK))
        e = mx._ceil_log2_div448(tl.max(nan_to_inf_abs(blocks), axis=1))  # [BM/32, BK]
        q = mx._to_e4m3(blocks * mx._pow2_neg(e)[:, None, :])
        cmask = (rm < Mpad)[:, None] & (rk < K)[None, :]
        if STAGED:
            v = tl.reshape((q.to(tl.float32) * mx._pow2_pos(e)[:, None, :]).to(tl.bfloat16), (BM, BK))
            tl.store(CD + rm[:, None].to(tl.int64) * K + rk[None, :], v, mask=cmask)
        else:
            tl.store(CD + rm[:, None].to(tl.int64) * K + rk[None, :], tl.reshape(q, (BM, BK)), mask=cmask)
            cb = tl.program_id(0) * (BM // 32) + tl.arange(0, BM // 32)
            tl.store(CS + cb[:, None].to(tl.int64) * K + rk[None, :], (e + 127).to(tl.uint8),
                     mask=(cb < Mpad // 32)[:, None] & (rk < K)[None, :])


CONFIGS = [(32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 8), (32, 256, 4), (64, 256, 8), (128, 128, 8),
           (32, 64, 2), (64, 128, 8), (128, 64, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--configs", help="comma-separated BMxBKxWARPS tile configs (default: CONFIGS)")
    ap.add_argument("--layouts", default="transposed,x", help="column-operand layouts to time")
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
    print("| layout | E4M3 rounding | operands | best BMxBKxWARPS | graph ms | of copy | all configs ms |")
    print("| --- | --- | --- | --- | ---: | ---: | --- |")
    f8, u8, bf = torch.float8_e4m3fn, torch.uint8, torch.bfloat16
    cases = [(same, row, col, staged, hw) for row, col, staged in ((True, False, False), (True, True, False),
                                                                  (True, True, True), (False, True, False))
             for same in (False, True) for hw in (0, 1)]
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
            print(f"| 32-row tiles | hardware | cols{' staged bf16' if staged else ''} | {best[0]}x{best[1]}x{best[2]} | "
                  f"{t:.3f} | {nbytes / (t * 1e-3) / ceiling:.0%} | {allc} |", flush=True)
    for same, row, col, staged, hw in cases:
        if ("x" if same else "transposed") not in args.layouts.split(","):
            continue
        if str(hw) not in args.hw.split(",") or (same and hw):
            continue
        ed = bf if staged else f8
        rd = torch.empty((M, K) if row else (1,), dtype=ed, device="cuda")
        rs = torch.empty((M, K // 32) if row and not staged else (1,), dtype=u8, device="cuda")
        cd = torch.empty(((Mpad, K) if same else (K, Mpad)) if col else (1,), dtype=ed, device="cuda")
        cs = torch.empty(((Mpad // 32, K) if same else (K, Mpad // 32)) if col and not staged else (1,), dtype=u8,
                         device="cuda")
        nbytes = 2 * M * K + (row + col) * M * K * (2 if staged else 1) + (0 if staged else (row + col) * M * K // 32)
        times = {}
        for bm, bk, w in configs:
            grid = (triton.cdiv(Mpad, bm), triton.cdiv(K, bk))
            if same:
                fn = lambda: _mxfp8_same_layout_kernel[grid](x, M, K, x.stride(0), rd, rs, cd, cs, Mpad,  # noqa: E731
                                                              ROW=row, COL=col, BM=bm, BK=bk, STAGED=staged,
                                                              num_warps=w)
            else:
                fn = lambda: mx._mxfp8_kernel[grid](x, M, K, x.stride(0), 1, rd, rs, cd, cs, Mpad,  # noqa: E731
                                                     ROW=row, COL=col, BM=bm, BK=bk, STAGED=staged, HW=bool(hw),
                                                     num_warps=w)
            fn()
            torch.cuda.synchronize()
            times[(bm, bk, w)] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        best = min(times, key=times.get)
        t = times[best]
        what = " + ".join(n for n, on in (("rows", row), ("cols", col)) if on) + (" staged bf16" if staged else "")
        allc = ", ".join(f"{bm}x{bk}x{w} {v:.3f}" for (bm, bk, w), v in times.items())
        layout, rounding = "x layout" if same else "transposed", "hardware" if hw else "fp32 bits"
        print(f"| {layout} | {rounding} | {what} | {best[0]}x{best[1]}x{best[2]} | {t:.3f} | "
              f"{nbytes / (t * 1e-3) / ceiling:.0%} | {allc} |", flush=True)


if __name__ == "__main__":
    main()
