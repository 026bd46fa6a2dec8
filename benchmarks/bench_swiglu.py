"""The MoE SwiGLU kernels alone (kernels/swiglu.py): forward h = silu(h1) ⊙ h3 with h's per-expert
amaxes, backward dh1, dh3 with theirs, against the eager ops and the copy ceiling, in one run.

    python benchmarks/bench_swiglu.py [--shapes deepseek_v3_16b] [--json out.json]
                                      [--sweep 2x64x2,1x128x2 --maxnreg 0,64]

``--sweep``: the two kernels launched directly at each GxBKxWARPS tile config and register cap
(0: none) instead of the autotuned call, with registers and spills.

Routed rows as bench_grouped.py makes them (uniform top-k, groups padded to 16). Bytes counted: the
tensors read and written once (forward 3, backward 5 of T×H in the dtype). Times: medians of
triton.testing.do_bench, L2 flushed (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from titan_nvfp4.kernels import swiglu as sw
from titan_nvfp4.kernels.launch import tune_bucket
from titan_nvfp4.kernels.swiglu import swiglu_amax_tensors, swiglu_backward_amax_tensors
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.grouped import block_experts

# benchmarks/ is on sys.path when run as a script
from bench_grouped import SHAPES, routed_offsets
from timing import copy_ceiling, ms, require_cuda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["deepseek_v3_16b"])
    ap.add_argument("--json")
    ap.add_argument("--sweep", help="comma-separated GxBKxWARPS configs to time the kernels at")
    ap.add_argument("--maxnreg", default="0")
    args = ap.parse_args()
    require_cuda()
    if args.sweep:
        return sweep(args)
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling / 1e12:.2f} TB/s (read + write)")
    print("| shape T×H | kernel | ms | TB/s | of copy | eager ops ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    rows = []
    for name in args.shapes:
        E, _dim, hidden, tokens, top_k, _ = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        offsets, T = routed_offsets(E, tokens, top_k, gen)
        h1, h3, dh = (torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        signs = rht_signs(0, "cuda")
        fwd = ms(lambda: swiglu_amax_tensors(h1, h3, offsets, True, signs))
        bwd = ms(lambda: swiglu_backward_amax_tensors(dh, h1, h3, offsets, True, signs))
        a, b = h1.clone().requires_grad_(), h3.clone().requires_grad_()
        eager_fwd = ms(lambda: F.silu(h1) * h3)

        def eager_step():
            a.grad = b.grad = None
            (F.silu(a) * b).backward(dh)
        eager_bwd = ms(eager_step) - eager_fwd
        for kernel, t, tensors, eager in (("forward + amaxes", fwd, 3, eager_fwd),
                                          ("backward + amaxes", bwd, 5, eager_bwd)):
            moved = tensors * h1.numel() * h1.element_size()
            bw = moved / (t * 1e-3)
            print(f"| {name} {T}×{hidden} | {kernel} | {t:.3f} | {bw / 1e12:.2f} | {bw / ceiling:.0%} | {eager:.3f} |")
            rows.append(dict(shape=name, T=T, hidden=hidden, kernel=kernel, ms=t, tbps=bw / 1e12,
                             of_copy=bw / ceiling, eager_ms=eager))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbps=ceiling / 1e12, rows=rows), f, indent=1)


def sweep(args) -> None:
    """Each kernel at each tile config and register cap, launched directly (no autotuner)."""
    from titan_nvfp4.kernels.quantize import launch_grid

    configs = [tuple(int(v) for v in c.split("x")) for c in args.sweep.split(",")]
    caps = [int(c) for c in args.maxnreg.split(",")]
    print("| shape | kernel | G | BK | warps | tiles first | maxnreg | ms | regs | spills |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name in args.shapes:
        E, _dim, N, tokens, top_k, _ = SHAPES[name]
        offsets, M = routed_offsets(E, tokens, top_k, torch.Generator().manual_seed(0))
        h1, h3, dh, out, d1, d3 = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(6))
        signs = rht_signs(0, "cuda").float()
        bexp, ns = block_experts(offsets, M), E + 1
        tm = tune_bucket(M)
        a1, a3 = (torch.zeros(2 * ns, dtype=torch.int32, device="cuda") for _ in range(2))
        for (g, bk, w), cap, cf in ((c, r, o) for c in configs for r in caps for o in (False, True)):
            opts = dict(num_warps=w, **(dict(maxnreg=cap) if cap else {}))
            grid = launch_grid(M, N, g, bk, cf)
            flags = dict(COL=True, RHT=True, PRECISE=True, WIDE=False, G=g, BK=bk, COLS_FIRST=cf, **opts)
            runs = {"forward + amaxes": lambda: sw._swiglu_fwd_kernel[grid](h1, h3, out, M, N, N, a1, signs, bexp, ns,
                                                                           tm, **flags),
                    "backward + amaxes": lambda: sw._swiglu_bwd_kernel[grid](dh, h1, h3, d1, d3, M, N, N, a1, a3, signs,
                                                                            bexp, ns, tm, **flags)}
            for kernel, run in runs.items():
                k = run()
                t = ms(run)
                order = "columns" if cf else "rows"
                print(f"| {name} | {kernel} | {g} | {bk} | {w} | {order} | {cap or '-'} | {t:.3f} | {k.n_regs} "
                      f"| {k.n_spills} |", flush=True)


if __name__ == "__main__":
    main()
