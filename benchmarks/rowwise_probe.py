"""Where the rowwise 1×16 kernel (amax given) loses to copy: the production call, its kernel alone,
and a twin of its rowwise path with one launch or memory knob changed at a time, graph-timed.

    python benchmarks/rowwise_probe.py [--m 16384 --k 4096] [--configs 1x256x2,1x512x4,2x128x4]

Knobs of the twin (``_row_probe_kernel``): ``COLS_FIRST`` orders programs as the kernels'
``program_tile`` does (column tiles of a row strip first);
``EVICT`` loads x with ``evict_first`` (read once); ``STREAM`` stores codes and scales with the
``.cs`` (streaming) cache hint. Every twin's codes and scales are checked equal to the production
kernel's before it is timed.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from titan_nvfp4.kernels import quantize as q
from titan_nvfp4.kernels.nvfp4_jit import quantize_slices16
from titan_nvfp4.kernels.quantize import quantize_operand


@triton.jit
def _row_probe_kernel(X, M, K, sxm, AMAX, RD, RS, COLS_FIRST: tl.constexpr, EVICT: tl.constexpr,
                      STREAM: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """_quantize_kernel's ROW path (codes, nearest-even, one tensor scale) with the module's knobs."""
    pr, pc = q.program_tile(K, BK, COLS_FIRST)
    rows = pr * (16 * G) + tl.arange(0, 16 * G)
    kb = pc * (BK // 16) + tl.arange(0, BK // 16)
    R: tl.constexpr = 16 * G
    C: tl.constexpr = BK // 16
    col = kb[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    ptr = X + rows[:, None, None].to(tl.int64) * sxm + col
    mask = (rows < M)[:, None, None] & (col < K)
    if EVICT:
        lo = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
        hi = tl.load(ptr + 8, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        lo = tl.load(ptr, mask=mask, other=0.0)
        hi = tl.load(ptr + 8, mask=mask, other=0.0)
    xs = q.split8(lo, R, C) + q.split8(hi, R, C)
    s = q._encode_scale(AMAX, AMAX, rows // 16, 0, False, False)
    out, e = quantize_slices16(xs, s, False, 0, 0, STAGED=False, FOUR_SIX=False)
    rmask = (rows < M)[:, None]
    kmask = (kb < K // 16)[None, :]
    cptr = RD.to(tl.pointer_type(tl.int32)) + rows[:, None, None].to(tl.int64) * (K // 8) + kb[None, :, None] * 2 \
        + tl.arange(0, 2)[None, None, :]
    sptr = RS + rows[:, None].to(tl.int64) * (K // 16) + kb[None, :]
    if STREAM:
        tl.store(cptr, tl.join(out[0], out[1]), mask=(rmask & kmask)[:, :, None], cache_modifier=".cs")
        tl.store(sptr, e, mask=rmask & kmask, cache_modifier=".cs")
    else:
        tl.store(cptr, tl.join(out[0], out[1]), mask=(rmask & kmask)[:, :, None])
        tl.store(sptr, e, mask=rmask & kmask)


def gms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--configs", default="1x256x2,1x512x4,2x128x4,1x256x4,2x256x4,1x128x1")
    args = p.parse_args()
    M, K = args.m, args.k
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    nbytes = 2 * M * K + M * K // 2 + M * K // 16
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (gms(lambda: dst.copy_(src)) * 1e-3)
    print(f"copy ceiling (graph-timed, 256 MiB): {copy_bw / 1e12:.3f} TB/s; rowwise bytes {nbytes / 1e6:.1f} MB")

    def row(name, t):
        print(f"| {name} | {t * 1e3:.1f} | {nbytes / (t * 1e-3) / copy_bw:.1%} |", flush=True)

    print("| case | graph µs | of copy |")
    print("| --- | ---: | ---: |")
    ref = quantize_operand(x, amax=amax)[0]
    row("quantize_operand(x, amax=amax)", gms(lambda: quantize_operand(x, amax=amax)))
    buf = q._amax_buffer(x, amax, 2)
    row("host amax -> buffer (nan_to_num) alone", gms(lambda: q._amax_buffer(x, amax, 2)))
    rd = torch.empty(M, K // 2, dtype=torch.uint8, device="cuda")
    rs = torch.empty(M, K // 16, dtype=torch.float8_e4m3fn, device="cuda")
    gs = torch.empty(2, device="cuda")

    def prod():
        q._launch(q._quantize_kernel, q._quantize_autotuned, x, M, K, x, M, K, x.stride(0), x.stride(1), buf, gs,
                  rd, rs, buf, buf, buf, buf, M, buf, 1, ROW=True, COL=False, RHT=False, SR_ROW=False,
                  SR_COL=False, ROW_F16=False, COL_F16=False, NSP2=2, FOUR_SIX=False, GROUPED=False)
    prod()
    torch.cuda.synchronize()
    assert torch.equal(rd, ref.data) and torch.equal(rs.view(torch.uint8), ref.scale.view(torch.uint8))
    best = q._quantize_autotuned.best_config
    row(f"_quantize_kernel alone (autotuned: {best})", gms(prod))
    want_d, want_s = rd.clone(), rs.view(torch.uint8).clone()
    for cfg in args.configs.split(","):
        g, bk, w = (int(v) for v in cfg.split("x"))
        for cols_first in (False, True):
            for evict in (False, True):
                for stream in (False, True):
                    rd.zero_()
                    rs.view(torch.uint8).zero_()
                    grid = q.launch_grid(M, K, g, bk, cols_first)

                    def twin():
                        _row_probe_kernel[grid](x, M, K, x.stride(0), buf, rd, rs, COLS_FIRST=cols_first,
                                                EVICT=evict, STREAM=stream, G=g, BK=bk, num_warps=w)
                    twin()
                    torch.cuda.synchronize()
                    ok = torch.equal(rd, want_d) and torch.equal(rs.view(torch.uint8), want_s)
                    name = (f"twin G{g} BK{bk} w{w}" + (" cols-first" if cols_first else "")
                            + (" evict_first" if evict else "") + (" .cs stores" if stream else "")
                            + ("" if ok else " **MISMATCH**"))
                    row(name, gms(twin))


if __name__ == "__main__":
    main()
