"""16×16 weight quantization alone, replayed from a CUDA graph, against a device copy in the same run.

    python benchmarks/weight_quant_bench.py [--n 14336 --k 4096] [--configs 2x64x1,1x256x2]
    python benchmarks/weight_quant_bench.py --experts 64 --n 1408 --k 2048 [--configs 2x128x4,...]

``--configs``: also time ``_quantize_2d_kernel`` itself, as a training step runs it (W staged in fp16
plus Wᵀ codes, amax given), at each GxBKxWARPS tile config, with its registers.

``--experts E``: E stacked expert weights [E·n, k] as MoE training quantizes them (staged W, Wᵀ codes, one
tensor scale per expert): the amax pass followed by the quantization, against the fused kernel that
reduces each expert's amax in the same launch (checked bit for bit against the first); ``--configs``
then sweeps the fused kernel's tiles, GxBKxWARPS[xLEAD[xSPAN]] (LEAD and SPAN: see _quantize_2d_fused_kernel).

Bytes counted as in bench_kernels.py: the bf16 weight read, W and Wᵀ codes written, the scales (and the
amax pass's read when the amax is not given). Every figure is graph-timed (benchmarks/timing.py), the copy
ceiling on a buffer of the weight's size.
"""

from __future__ import annotations

import argparse

import torch

from titan_nvfp4.kernels import quantize as q
from titan_nvfp4.kernels.launch import launcher, tune_bucket
from titan_nvfp4.kernels.quantize import quantize_weight_2d

# benchmarks/ is on sys.path when run as a script
from timing import copy_ceiling, graph_ms, require_cuda


def _copy(nbytes: int) -> tuple[float, str]:
    """The graph-timed copy ceiling of a buffer of the weight's size (bytes read + written per second),
    and its line for the output."""
    bw = copy_ceiling(nbytes, graph=True)
    return bw, f"copy ceiling {bw / 1e12:.2f} TB/s ({2 * nbytes / bw * 1e3:.3f} ms for {nbytes / 2**20:.0f} MiB)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--configs", help="comma-separated GxBKxWARPS tiles of the kernel to time (module docstring)")
    p.add_argument("--experts", type=int, default=0, help="E stacked expert weights of --n x --k (module docstring)")
    args = p.parse_args()
    require_cuda()
    if args.experts:
        return _experts(args)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    amax = w.abs().amax().float()
    nw = w.numel()
    copy_bw, line = _copy(2 * nw)
    print(line)
    print("| kernel | graph ms | TB/s | of copy |")
    print("| --- | ---: | ---: | ---: |")
    for name, fn, nbytes in (
            ("weight 16x16 + W^T codes, amax included", lambda: quantize_weight_2d(w), 2 * (2 * nw) + nw + nw // 256),
            ("weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=amax), 2 * nw + nw + nw // 256),
            ("4/6: weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=amax, four_over_six=True),
             2 * nw + nw + nw // 256)):
        fn()
        torch.cuda.synchronize()
        ms = graph_ms(fn)
        bw = nbytes / (ms * 1e-3)
        print(f"| {name} | {ms:.3f} | {bw / 1e12:.2f} | {bw / copy_bw:.0%} |", flush=True)
    if args.configs:
        _sweep(w, amax, [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")], copy_bw)


def _sweep(w: torch.Tensor, amax: torch.Tensor, configs, copy_bw: float) -> None:
    """The kernel as trained (staged W, Wᵀ codes, amax given) at each tile config."""
    N, K = w.shape
    buf = amax.reshape(1).view(torch.int32).clone()
    gs = torch.empty(1, device=w.device)
    d = torch.empty(N, K, dtype=torch.float16, device=w.device)
    dt = torch.empty(K, N // 2, dtype=torch.uint8, device=w.device)
    st = torch.empty(K // 16, N // 16, dtype=torch.float8_e4m3fn, device=w.device)
    nbytes = 2 * w.numel() + 2 * w.numel() + w.numel() // 2 + w.numel() // 256
    print("\n| _quantize_2d_kernel (W staged + Wᵀ codes, amax given) G | BK | warps | tiles first | graph ms | of copy "
          "| regs | spills |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for (g, bk, wp), cf in ((c, cf) for c in configs for cf in (False, True)):
        def run():
            return q._quantize_2d_kernel[q.launch_grid(N, K, g, bk, cf)](
                w, N, K, w.stride(0), w.stride(1), buf, gs, d, st, dt, st, buf, 1, N, N * K, tune_bucket(N),
                EMIT_T=True, GROUPED=False, EMIT_STAGED=True, NSP2=1, FOUR_OVER_SIX=False, G=g, BK=bk, COLS_FIRST=cf,
                num_warps=wp)
        k = run()
        ms = graph_ms(run)
        print(f"| {g} | {bk} | {wp} | {'columns' if cf else 'rows'} | {ms:.4f} | {nbytes / (ms * 1e-3) / copy_bw:.0%} "
              f"| {k.n_regs} | {k.n_spills} |", flush=True)


def _experts(args) -> None:
    """--experts: the two-pass and the fused per-expert quantization (module docstring)."""
    E, n, k = args.experts, args.n, args.k
    w = (torch.randn(E, n, k, device="cuda") * torch.rand(E, 1, 1, device="cuda")).reshape(E * n, k).to(torch.bfloat16)
    nw = w.numel()
    copy_bw, line = _copy(2 * nw)
    print(f"{line}; {E} experts of {n}x{k}")

    def two_pass():
        return q.quantize_weight_2d_tensors(w, q.expert_amax_tensors(w, E), experts=E, staged=True)

    def fused():
        return q.quantize_weight_2d_tensors(w, experts=E, staged=True)

    a, b = two_pass(), fused()
    same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn
               else torch.equal(x, y) for x, y in zip(a, b))
    print(f"fused == two passes, bit for bit: {same}")
    nbytes = 2 * nw + 2 * nw + nw // 2 + nw // 256  # W read once, staged fp16 + Wᵀ codes + scales written
    print("| per-expert weights (W staged + Wᵀ codes) | graph ms | of copy (one read of W) |")
    print("| --- | ---: | ---: |")
    for name, fn in (("amax pass + quantization", two_pass), ("fused amax + quantization", fused),
                     ("quantization alone, amax given", lambda: q.quantize_weight_2d_tensors(
                         w, a[4], experts=E, staged=True))):
        ms = graph_ms(fn)
        print(f"| {name} | {ms:.4f} | {nbytes / (ms * 1e-3) / copy_bw:.0%} |", flush=True)
    if args.configs:
        print("\n| fused G | BK | warps | lead | span | graph ms | of copy | same bits | regs |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        saved = dict(q._FUSED_2D)
        for c in args.configs.split(","):
            g, bk, wp, *rest = (int(v) for v in c.split("x"))
            lead = rest[0] if rest else saved["LEAD"]
            span = rest[1] if len(rest) > 1 else saved["SPAN"]
            q._FUSED_2D.update(G=g, BK=bk, num_warps=wp, LEAD=lead, SPAN=span)
            out = fused()
            ok = torch.equal(out[0], a[0]) and torch.equal(out[2], a[2])
            ms = graph_ms(fused)
            kern = list(launcher(q._quantize_2d_fused_kernel).cache.values())[-1].kernel
            print(f"| {g} | {bk} | {wp} | {lead} | {span} | {ms:.4f} | {nbytes / (ms * 1e-3) / copy_bw:.0%} | {ok} | "
                  f"{kern.n_regs} |", flush=True)
        q._FUSED_2D.update(saved)


if __name__ == "__main__":
    main()
