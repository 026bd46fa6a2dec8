"""MS-EDEN operand quantizer (kernels/ms_eden.py): amax + quantize of a dY-like operand against a copy of the
same tensor, both measured in this run.

    python benchmarks/bench_ms_eden.py [--rows 8192] [--cols 2048] [--json out.json]

For dY [rows, cols] bf16 and its transpose (a strided view, as wgrad reads it), at Hadamard sizes 16..128:
the two kernel passes (amax, then codes + scales; and the staged fp16 form) as GB/s of the bytes they must
move (two reads of the input, the outputs written once), and that as a fraction of a torch copy's GB/s of
the same view into a contiguous tensor (the bandwidth ceiling). Times: medians of triton.testing.do_bench
(timing.ms, L2 flushed) and, replayed from a CUDA graph, without host time (timing.graph_ms_or_none).
"""

from __future__ import annotations

import argparse
import json

import torch

from titan_nvfp4.kernels.ms_eden import ms_eden_quantize_tensors

# benchmarks/ is on sys.path when run as a script
from timing import graph_ms_or_none, header, ms, require_cuda, versions

SIZES = (16, 32, 64, 128)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    require_cuda()
    torch.manual_seed(0)
    res = versions()
    res["rows"] = []
    dy = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    sign_seed = torch.tensor([3], dtype=torch.int64, device="cuda")
    draw_seed = torch.tensor([5], dtype=torch.int64, device="cuda")
    print(header())
    print("| operand | size | form | ms | GB/s | graph ms | GB/s | copy GB/s | of copy |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, x in (("dY", dy), ("dYᵀ (view)", dy.t())):
        out = torch.empty(x.shape, dtype=x.dtype, device="cuda")
        copy_ms = ms(lambda: out.copy_(x))
        copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        for size in SIZES:
            for staged in (False, True):
                fn = lambda: ms_eden_quantize_tensors(x, None, sign_seed, draw_seed, None, size=size,  # noqa: E731
                                                      staged=staged)
                fn()
                cpad = x.shape[1] + (-x.shape[1]) % size
                written = x.shape[0] * cpad * (2 if staged else (0.5 + 1 / 16))
                moved = 2 * x.numel() * x.element_size() + written
                t, g = ms(fn), graph_ms_or_none(fn)
                gbs, ggbs = moved / t / 1e6, (moved / g / 1e6 if g else None)
                best = max(gbs, ggbs or 0.0)
                form = "staged fp16" if staged else "codes+scales"
                print(f"| {name} | {size} | {form} | {t:.3f} | {gbs:.0f} | {g or float('nan'):.3f} | "
                      f"{ggbs or float('nan'):.0f} | {copy_gbs:.0f} | {best / copy_gbs:.2f} |")
                res["rows"].append(dict(operand=name, size=size, staged=staged, ms=t, graph_ms=g, gbps=gbs,
                                        graph_gbps=ggbs, copy_gbps=copy_gbs, of_copy=best / copy_gbs))
    if args.json:
        from titan_nvfp4.tools.atomic import write_text

        write_text(args.json, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
