"""The grouped GEMMs of one SwiGLU expert block, one by one, from staged operands (kernel time only).

    python benchmarks/bench_grouped_gemms.py [--shape deepseek_v3_16b] [--json out.json]

For each GEMM of the block (forward W1, W3, W2; dgrad; wgrad) it times the grouped kernel on staged
fp16 operands, with TFLOP/s and the ratio to a dense cuBLAS BF16 GEMM of the same FLOPs, and the
fused variants W1|W3 (one GEMM of 2·hidden outputs forward, one of 2·hidden rows in wgrad): they
show what tile waste (hidden = 1408 is 5.5 tiles of 256) and separate launches cost. Also the
staging pass (codes to fp16) of each operand the backward stages (random codes, unit scales).
Medians of triton.testing.do_bench, L2 flushed (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from titan_nvfp4.kernels import grouped_gemm
from titan_nvfp4.kernels.grouped_gemm import grouped_gemm_rows, grouped_gemm_tokens, stage
from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor

# benchmarks/ is on sys.path when run as a script
from bench_grouped import SHAPES, routed_offsets
from timing import cublas_bf16_ms, header, ms, require_cuda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek_v3_16b", choices=[k for k, v in SHAPES.items() if not v[5]])
    ap.add_argument("--json")
    args = ap.parse_args()
    require_cuda()
    E, dim, hidden, tokens, top_k, _ = SHAPES[args.shape]
    offsets, rows = routed_offsets(E, tokens, top_k, torch.Generator().manual_seed(0))
    T = int(offsets[-1])
    dev = "cuda"

    def staged(*shape):  # exact fp16 values of the kind the kernels stage (E2M1 times an E4M3 scale)
        return (torch.randint(-6, 7, shape, device=dev).half() * 0.5)

    gs = torch.ones(E + 1, device=dev)
    gs2 = torch.ones(2, E + 1, device=dev)  # W1's and W3's decode scales for the fused GEMM
    x, h, dy2 = staged(rows, dim), staged(rows, hidden), staged(rows, dim)
    dh = staged(rows, hidden)
    w13 = staged(E * 2 * hidden, dim)  # W1|W3 interleaved per expert
    w1 = staged(E * hidden, dim)
    w2 = staged(E * dim, hidden)
    w2t = staged(hidden, E * dim)  # 16x16 Wᵀ stacks: [K, E·N]
    w1t = staged(dim, E * hidden)
    xc, hc, dy2c, dhc = staged(dim, rows), staged(hidden, rows), staged(dim, rows), staged(hidden, rows)
    dh13c = staged(2 * hidden, rows)
    w1t_pe = staged(E * dim, hidden)
    dx = torch.zeros(rows, dim, device=dev, dtype=torch.bfloat16)

    def unswapped(a16, b16):
        grouped_gemm.SWAP_WGRAD = False
        try:
            return grouped_gemm_tokens(a16, b16, offsets, gs, gs, torch.bfloat16)
        finally:
            grouped_gemm.SWAP_WGRAD = True
    bf = torch.bfloat16
    cases = [
        ("fwd W1 (or W3)", T * dim * hidden, lambda: grouped_gemm_rows(x, w1, offsets, gs, gs, hidden, hidden, 0, bf)),
        ("fwd W1|W3 fused (per GEMM)", T * dim * hidden,
         lambda: grouped_gemm_rows(x, w13, offsets, gs, gs2, 2 * hidden, 2 * hidden, 0, bf, n_split=hidden)),
        ("fwd W2", T * dim * hidden, lambda: grouped_gemm_rows(h, w2, offsets, gs, gs, dim, dim, 0, bf)),
        ("dgrad W2 (dh)", T * dim * hidden, lambda: grouped_gemm_rows(dy2, w2t, offsets, gs, gs, hidden, 0, dim, bf)),
        ("dgrad W1 (dx)", T * dim * hidden, lambda: grouped_gemm_rows(dh, w1t, offsets, gs, gs, dim, 0, hidden, bf)),
        ("dgrad W1 (dx), Wᵀ stacked per expert [E·dim, hidden]", T * dim * hidden,
         lambda: grouped_gemm_rows(dh, w1t_pe, offsets, gs, gs, dim, dim, 0, bf)),
        ("dgrad W3 (dx += ..., add_to)", T * dim * hidden,
         lambda: grouped_gemm_rows(dh, w1t, offsets, gs, gs, dim, 0, hidden, bf, add_to=dx)),
        ("wgrad W2", T * dim * hidden, lambda: grouped_gemm_tokens(dy2c, hc, offsets, gs, gs, bf)),
        ("wgrad W2, operands not swapped", T * dim * hidden, lambda: unswapped(dy2c, hc)),
        ("wgrad W1 (or W3)", T * dim * hidden, lambda: grouped_gemm_tokens(dhc, xc, offsets, gs, gs, bf)),
        ("wgrad W1|W3 fused (per GEMM)", T * dim * hidden, lambda: grouped_gemm_tokens(dh13c, xc, offsets, gs, gs, bf)),
    ]
    t_ref = cublas_bf16_ms(T, hidden, dim)
    res = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "routed_rows": T, "rows": []}
    print(f"{header()}  {args.shape}: {T} routed rows")
    print(f"# cuBLAS BF16 dense [{T}x{dim}]·[{dim}x{hidden}]: {t_ref:.3f} ms, "
          f"{2 * T * dim * hidden / t_ref / 1e9:.0f} TFLOP/s")
    print("| GEMM | ms | TFLOP/s | vs dense cuBLAS |")
    print("| --- | ---: | ---: | ---: |")
    for what, mnk, fn in cases:
        fn()
        t = ms(fn)
        if "fused" in what:
            t /= 2  # two GEMMs' worth of work in one launch
        tf = 2 * mnk / t / 1e9
        res["rows"].append(dict(what=what, ms=t, tflops=tf))
        print(f"| {what} | {t:.3f} | {tf:.0f} | {t_ref / t:.0%} |", flush=True)
    # the staging passes of the codes the backward keeps (X's and h's wgrad operands, the Wᵀ stacks)
    for what, src, div in (("stage X col", xc, 1), ("stage h col", hc, 1), ("stage W1ᵀ (16x16)", w1t, 16)):
        d = torch.randint(0, 256, (src.shape[0], src.shape[1] // 2), dtype=torch.uint8, device=dev)
        s = torch.ones(src.shape[0] // div, src.shape[1] // 16, device=dev).to(torch.float8_e4m3fn)
        t = ms(lambda: stage(NVFP4Tensor(d, s, torch.ones((), device=dev), src.shape, (div, 16))))
        gb = src.numel() * 2.5625 / 1e9
        res["rows"].append(dict(what=what, ms=t, tbps=gb / t))
        print(f"| {what} | {t:.3f} | {gb / t:.2f} TB/s | |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
