"""16×16 weight quantization alone, replayed from a CUDA graph, against a device copy in the same run.

    python benchmarks/weight_quant_bench.py [--n 14336 --k 4096]

Bytes counted as in bench_kernels.py: the bf16 weight read, W and Wᵀ codes written, the scales (and the
amax pass's read when the amax is not given).
"""

from __future__ import annotations

import argparse

import torch
import triton

from titan_nvfp4.kernels.quantize import quantize_weight_2d


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    args = p.parse_args()
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    amax = w.abs().amax().float()
    nw = w.numel()
    dst = torch.empty_like(w)
    copy_ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(w), rep=50)
    copy_bw = 2 * 2 * nw / (copy_ms * 1e-3)
    print(f"copy ceiling {copy_bw / 1e12:.2f} TB/s ({copy_ms:.3f} ms for {2 * nw / 2**20:.0f} MiB)")
    print("| kernel | graph ms | TB/s | of copy |")
    print("| --- | ---: | ---: | ---: |")
    for name, fn, nbytes in (
            ("weight 16x16 + W^T codes, amax included", lambda: quantize_weight_2d(w), 2 * (2 * nw) + nw + nw // 256),
            ("weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=amax), 2 * nw + nw + nw // 256),
            ("4/6: weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=amax, four_six=True),
             2 * nw + nw + nw // 256)):
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(fn, rep=50)
        bw = nbytes / (ms * 1e-3)
        print(f"| {name} | {ms:.3f} | {bw / 1e12:.2f} | {bw / copy_bw:.0%} |", flush=True)


if __name__ == "__main__":
    main()
