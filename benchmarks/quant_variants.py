"""Where the quantization kernel's time goes: ``_quantize_kernel`` timed with one feature at a time
(rowwise, columnwise, RHT, stochastic rounding) and over tile configs, with registers and spills.

    python benchmarks/quant_variants.py [--m 16384 --k 4096] [--ncu] [--variants "row,col RHT"]
                                        [--configs 2x64x2,4x128x4] [--maxnreg 0,64] [--orders rows,columns]
                                        [--amax [--spread SxSTRIDE[xrelaxed] ...]]

The sweep behind the quantization autotuners' tile lists (each config in both program orders): every
row graph-timed (benchmarks/timing.py) against a graph-timed copy of half of x's bytes (a 32 MiB copy at
the default shape, which reads faster than the 512 MiB copy of bench_kernels.py: compare the ms).
``--ncu`` launches each variant once (no timing) for ``ncu --kernel-name regex:_quantize``.
``--amax`` times the amax pass (``_amax_kernel``) instead: |x|, |x| with |RHT xᵀ|, |RHT xᵀ| alone,
and each also with per-program partial maxima stored instead of atomics (a prototype kernel here),
to tell the atomics' share of its time from the loads' and the RHT's.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from titan_nvfp4.kernels import quantize as q
from titan_nvfp4.kernels.launch import tune_bucket
from titan_nvfp4.kernels.nvfp4_jit import amax16, rht16_slices
from titan_nvfp4.numerics.rht import rht_signs

# benchmarks/ is on sys.path when run as a script
from timing import copy_ceiling, graph_ms, require_cuda

VARIANTS = {  # name: (ROW, COL, RHT, STOCHASTIC_ROW, STOCHASTIC_COL, ROW_STAGED, COL_STAGED)
    "row": (True, False, False, False, False, False, False),
    "row SR": (True, False, False, True, False, False, False),
    "col RHT": (False, True, True, False, False, False, False),
    "col RHT SR": (False, True, True, False, True, False, False),
    "row + col RHT (fwd X, codes)": (True, True, True, False, False, False, False),
    "row f16 + col RHT (fwd X as trained)": (True, True, True, False, False, True, False),
    "row SR + col RHT SR (bwd dY, codes)": (True, True, True, True, True, False, False),
    "row SR f16 + col RHT SR f16 (bwd dY as trained)": (True, True, True, True, True, True, True),
}
AMAX_VARIANTS = {"amax |x|": (True, False), "amax |x| + |RHT x^T|": (True, True), "amax |RHT x^T|": (False, True)}
CONFIGS = [(2, 64, 1), (1, 128, 2), (2, 64, 2), (2, 128, 4), (1, 256, 4), (4, 128, 8), (1, 256, 2), (4, 128, 4), (1, 512, 4)]


def _copy(nbytes: int) -> float:
    """Graph-timed copy ceiling (TB/s, read + write) of an ``nbytes`` buffer, printed; the rows are
    graph-timed too."""
    tbs = copy_ceiling(nbytes, graph=True) / 1e12
    print(f"copy of {nbytes / 2**20:.0f} MiB: {2 * nbytes / tbs / 1e9:.3f} ms ({tbs:.2f} TB/s), graph-timed like the rows")
    return tbs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--variants", help="comma-separated names from VARIANTS (default: all; with --amax, "
                   "semicolon-separated names from AMAX_VARIANTS)")
    p.add_argument("--configs", help="comma-separated GxBKxWARPS tile configs (default: CONFIGS)")
    p.add_argument("--dump", help="folder for the TTGIR of each variant at the second config")
    p.add_argument("--maxnreg", default="0", help="comma-separated register caps per thread to try (0: none); "
                   "fewer registers, more warps resident")
    p.add_argument("--orders", default="rows,columns", help="program orders to time (program_tile): rows "
                   "(row tiles first, a 2D grid) and/or columns (COLS_FIRST)")
    p.add_argument("--amax", action="store_true", help="time the amax pass instead (module docstring)")
    p.add_argument("--spread", nargs="*", default=[], help="with --amax: also atomics spread over SxSTRIDE copies")
    args = p.parse_args()
    require_cuda()
    if args.amax:
        return amax_main(args)
    M, K = args.m, args.k
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    signs = rht_signs(0, x.device).float()
    seed = torch.full((1,), 7, dtype=torch.int64, device="cuda")
    amax = torch.full((2,), 5.0, device="cuda").view(torch.int32)
    gs = torch.empty(2, device="cuda")
    rd = torch.empty(M, K // 2, dtype=torch.uint8, device="cuda")
    rs = torch.empty(M, K // 16, dtype=torch.float8_e4m3fn, device="cuda")
    cd = torch.empty(K, M // 2, dtype=torch.uint8, device="cuda")
    cs = torch.empty(K, M // 16, dtype=torch.float8_e4m3fn, device="cuda")
    rd16 = torch.empty(M, K, dtype=torch.float16, device="cuda")  # staged outputs
    cd16 = torch.empty(K, M, dtype=torch.float16, device="cuda")
    copy_tbs = _copy(M * K // 2)
    print("| variant | G | BK | warps | tiles first | maxnreg | ms | TB/s (read+write) | of copy | regs | spills "
          "| layout converts | smem B |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    caps = [int(c) for c in args.maxnreg.split(",")]
    orders = [o == "columns" for o in args.orders.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")] if args.configs else CONFIGS
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    for name in names:
        row, col, rht, srr, src, rf16, cf16 = VARIANTS[name]
        out_bytes = lambda on, f16: (M * K * 2 if f16 else M * K * 9 // 16) if on else 0  # noqa: E731
        nbytes = M * K * 2 + out_bytes(row, rf16) + out_bytes(col, cf16)
        for (g, bk, w), cap, cf in ((c, r, o) for c in configs for r in caps for o in orders):
            opts = dict(maxnreg=cap) if cap else {}

            def run():
                return q._quantize_kernel[q.launch_grid(M, K, g, bk, cf)](
                    x, M, K, x.stride(0), x.stride(1), amax, gs, rd16 if rf16 else rd, rs, cd16 if cf16 else cd, cs,
                    signs, seed, M, amax, 1, tune_bucket(M), ROW=row, COL=col, RHT=rht, STOCHASTIC_ROW=srr,
                    STOCHASTIC_COL=src, GROUPED=False, ROW_STAGED=rf16, COL_STAGED=cf16, NSP2=2, G=g, BK=bk, COLS_FIRST=cf, num_warps=w,
                    **opts)
            k = run()
            if args.ncu:
                continue
            ms = graph_ms(run)
            cvt = k.asm["ttgir"].count("convert_layout")
            tbs = nbytes / ms / 1e9
            print(f"| {name} | {g} | {bk} | {w} | {'columns' if cf else 'rows'} | {cap or '-'} | {ms:.3f} | {tbs:.2f} "
                  f"| {tbs / copy_tbs:.0%} | {k.n_regs} | {k.n_spills} | {cvt} | {k.metadata.shared} |", flush=True)
            if args.dump and (g, bk, w) == CONFIGS[2] and name in ("row", "col RHT", "row SR + col RHT SR (bwd dY)"):
                with open(f"{args.dump}/{name.split(' (')[0].replace(' ', '_').replace('+', 'p')}.ttgir", "w") as f:
                    f.write(k.asm["ttgir"])


@triton.jit
def _program_maxima(X, M, K, sxm, SIGNS, COL: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """A program's max|x| and (with COL) max|RHT xᵀ| as _amax_kernel reduces them, fp32."""
    blk = tl.program_id(0) * G + tl.arange(0, G)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    xs = q._load16(X, blk, rk, M, K, sxm, 1)
    row = tl.max(tl.max(amax16(xs), axis=1), axis=0)
    col = row
    if COL:
        col = tl.max(tl.max(amax16(rht16_slices(xs, SIGNS)), axis=1), axis=0)
    return row, col


@triton.jit
def _amax_partials_kernel(X, M, K, sxm, PART, SIGNS, ROW: tl.constexpr, COL: tl.constexpr, G: tl.constexpr,
                          BK: tl.constexpr):
    """Prototype: _amax_kernel's reductions, each program's two maxima stored to PART (no atomics)."""
    row, col = _program_maxima(X, M, K, sxm, SIGNS, COL, G, BK)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if ROW:
        tl.store(PART + 2 * pid, row)
    if COL:
        tl.store(PART + 2 * pid + 1, col)


@triton.jit
def _amax_spread_kernel(X, M, K, sxm, AMAX, SIGNS, ROW: tl.constexpr, COL: tl.constexpr, SPREAD: tl.constexpr,
                        STRIDE: tl.constexpr, SEM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """Prototype: _amax_kernel with each program's atomics on copy pid % SPREAD of the two amaxes, the
    copies STRIDE int32 apart (a reader then takes the max over the copies), with memory order SEM
    ("relaxed": no fence; "acq_rel": Triton's default)."""
    row, col = _program_maxima(X, M, K, sxm, SIGNS, COL, G, BK)
    c = ((tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) % SPREAD) * STRIDE
    if ROW:
        tl.atomic_max(AMAX + c, row.to(tl.int32, bitcast=True), sem=SEM)
    if COL:
        tl.atomic_max(AMAX + c + 1, col.to(tl.int32, bitcast=True), sem=SEM)


def amax_main(args) -> None:
    M, K = args.m, args.k
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    signs = rht_signs(0, x.device).float()
    buf = torch.zeros(2, dtype=torch.int32, device="cuda")
    spread_buf = torch.zeros(64 * 32, dtype=torch.int32, device="cuda")
    part = torch.empty(2 * M * K // 16, dtype=torch.float32, device="cuda")
    copy_tbs = _copy(M * K // 2)
    print("| variant | G | BK | warps | tiles first | atomics | ms | read TB/s | of copy | regs |")
    print("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    orders = [o == "columns" for o in args.orders.split(",")]
    configs = ([tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")] if args.configs
               else [(2, 64, 1), (2, 128, 2), (1, 128, 2), (2, 64, 4), (1, 256, 1), (2, 128, 1), (4, 64, 1),
                     (4, 128, 2), (1, 256, 2), (4, 64, 2), (8, 64, 4)])
    for name in (args.variants.split(";") if args.variants else list(AMAX_VARIANTS)):
        row, col = AMAX_VARIANTS[name]
        for (g, bk, w), cf in ((c, o) for c in configs for o in orders):
            grid = q.launch_grid(M, K, g, bk, cf)
            for atomics in (True, False) + tuple(args.spread):
                if cf and atomics is not True:
                    continue  # the prototypes keep the 2D grid
                if isinstance(atomics, str):
                    sp, st, *rel = atomics.split("x")  # SPREADxSTRIDE[xrelaxed]

                    def run():
                        return _amax_spread_kernel[grid](x, M, K, x.stride(0), spread_buf, signs, ROW=row, COL=col,
                                                         SPREAD=int(sp), STRIDE=int(st),
                                                         SEM="relaxed" if rel else "acq_rel", G=g, BK=bk,
                                                         num_warps=w)
                elif atomics:
                    def run():
                        return q._amax_kernel[grid](x, M, K, x.stride(0), x.stride(1), buf, signs, buf, 1, tune_bucket(M),
                                                    ROW=row, COL=col, RHT=True, GROUPED=False, G=g, BK=bk,
                                                    COLS_FIRST=cf, num_warps=w)
                else:
                    def run():
                        return _amax_partials_kernel[grid](x, M, K, x.stride(0), part, signs, ROW=row, COL=col, G=g,
                                                           BK=bk, num_warps=w)
                k = run()
                ms = graph_ms(run)
                tbs = M * K * 2 / ms / 1e9
                how = atomics if isinstance(atomics, str) else "yes" if atomics else "no (partials)"
                print(f"| {name} | {g} | {bk} | {w} | {'columns' if cf else 'rows'} | {how} | {ms:.4f} | {tbs:.2f} | "
                      f"{100 * tbs / copy_tbs:.0f}% | {k.n_regs} |", flush=True)


if __name__ == "__main__":
    main()
