"""Can the MoE block's non-GEMM kernels run under its grouped GEMMs? One GEMM and one side job, timed
alone, one after the other on one stream, and on two streams at once (CUDA graphs, L2 not flushed).

    python benchmarks/overlap_study.py [--configs default 128x128x4x4 ...] [--programs 132 120 ...]

The grouped GEMMs are tensor-core bound and leave most issue slots free, while the quantization
kernels are issue bound (BENCHMARKS.md, seventeenth entry); if a side job's programs fit on an SM
next to a GEMM program (registers, shared memory), its work could hide under the GEMM. ``hidden`` is
(sequential - concurrent) / side: 1 if the side job cost nothing, 0 if nothing overlapped.
GEMM configs are BMxBNxWARPSxSTAGES of the persistent rows kernel (BK 64), or "default" (autotuned);
``--programs`` sets its grid (one program per SM by default), leaving SMs to the side job.
"""

from __future__ import annotations

import argparse

import torch
import triton

from bench_grouped import SHAPES, routed_offsets  # benchmarks/ is on sys.path when run as a script
from titan_nvfp4.kernels import gemm as dense_gemm
from titan_nvfp4.kernels import grouped_gemm
from titan_nvfp4.kernels import launch as launch_cache
from titan_nvfp4.linear_function import _signs
from titan_nvfp4.ops import grouped as G
from titan_nvfp4.ops import library


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def set_gemm(config: str, programs: int | None) -> None:
    """Pin the persistent rows kernel's config (or restore autotuning) and its program count."""
    tuner = grouped_gemm._rows_persistent_autotuned
    if not hasattr(tuner, "_all_configs"):
        tuner._all_configs = list(tuner.configs)
    if config == "default":
        tuner.configs = tuner._all_configs
    else:
        bm, bn, w, st = (int(v) for v in config.split("x"))
        tuner.configs = [triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8}, num_warps=w, num_stages=st)]
    tuner.cache.clear()
    launch_cache._LAUNCHERS.clear()  # the launch cache holds the config each specialization ran with
    if programs:
        grouped_gemm._programs = lambda t, n=programs: n
    else:
        grouped_gemm._programs = dense_gemm._programs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek_v3_16b", choices=list(SHAPES))
    ap.add_argument("--configs", nargs="*", default=["default", "128x128x4x4", "128x128x4x3", "128x256x8x3"])
    ap.add_argument("--programs", nargs="*", type=int, default=[0])
    args = ap.parse_args()
    E, dim, hidden, tokens, top_k, _ = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    offsets, T = routed_offsets(E, tokens, top_k, gen)
    dev = "cuda"
    x = torch.randn(T, dim, device=dev, dtype=torch.bfloat16)
    h = torch.randn(T, hidden, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(E, hidden, dim, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, dim, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    signs = _signs(0, dev)
    seed = torch.tensor([7], device=dev, dtype=torch.int64)
    xq, _ = G.quantize_tokens(x, offsets, True, False, None, None)
    gw1 = G.quantize_experts(w1, True)
    gw2 = G.quantize_experts(w2, True)

    def gemm():
        G.gemm_rows(xq, gw1.w, offsets, hidden, hidden, 0, torch.bfloat16)

    sides = {
        "16x16 weight W2 (amax + quantize)": lambda: G.quantize_experts(w2, True),
        "W2ᵀ dequantize": lambda: grouped_gemm.stage(library._operand(gw2.t.data, gw2.t.scale, gw2.t.gs[:1], True)),
        "h rows + RHT cols (fwd operand)": lambda: G.quantize_tokens(h, offsets, True, True, signs, None),
        "h rows SR + RHT cols SR, staged (bwd operand)": lambda: G.quantize_tokens(h, offsets, True, True, signs, seed,
                                                                                   col_staged=True),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"shape {args.shape}: T={T}, E={E}, GEMM [T, {dim}] x [{hidden}, {dim}] per expert")
    print("| GEMM config | programs | side job | GEMM ms | side ms | one stream ms | two streams ms | hidden |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for config in args.configs:
        for programs in args.programs:
            set_gemm(config, programs or None)
            gemm()
            torch.cuda.synchronize()
            t_gemm = graph_ms(gemm)
            for name, side in sides.items():
                side()
                torch.cuda.synchronize()
                t_side = graph_ms(side)

                def seq():
                    gemm()
                    side()

                def both():
                    cur = torch.cuda.current_stream()
                    s1.wait_stream(cur)
                    s2.wait_stream(cur)
                    with torch.cuda.stream(s1):
                        gemm()
                    with torch.cuda.stream(s2):
                        side()
                    cur.wait_stream(s1)
                    cur.wait_stream(s2)

                t_seq, t_both = graph_ms(seq), graph_ms(both)
                hidden_frac = (t_seq - t_both) / t_side
                print(f"| {config} | {programs or 'SMs'} | {name} | {t_gemm:.3f} | {t_side:.3f} | {t_seq:.3f} | "
                      f"{t_both:.3f} | {hidden_frac:.2f} |", flush=True)


if __name__ == "__main__":
    main()
