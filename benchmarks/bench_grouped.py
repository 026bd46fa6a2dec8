"""NVFP4 grouped experts against BF16 torch._grouped_mm, forward + backward, in one run.

    python benchmarks/bench_grouped.py [--json out.json] [--shapes deepseek_v3_16b gpt_oss_20b]
                                       [--rows-kernels persistent persistent_nested tiles]
                                       [--profile] [--bf16-compiled-swiglu] [--graph] [--repeats N]
                                       [--codes-saved] [--requantize]

Each shape is a whole routed-expert block as TorchTitan runs it: DeepSeek-V3-style SwiGLU experts
(h = silu(x W1ᵀ) ⊙ x W3ᵀ, out = h W2ᵀ) or gpt-oss's (mlp1 with bias to 2·hidden, clamped SwiGLU,
mlp2 with bias). Tokens are routed uniformly at random (top-k of E), every group padded to 16 as
TorchTitan's alignment does. NVFP4 runs the SwiGLU experts as NVFP4GroupedExperts does (SwiGLU fused
with the amaxes of what it produces); a second row runs them with the eager SwiGLU, and
``--bf16-compiled-swiglu`` adds a BF16 baseline whose SwiGLU torch.compile fuses. Also one grouped
GEMM alone (forward, and forward + backward), and the copy ceiling for reference. Times: medians of
triton.testing.do_bench, L2 flushed (benchmarks/timing.py).
``--graph`` also replays each expert block from a CUDA graph and times the host's enqueueing alone: eager
minus graph time is what launches and Python cost on top of the kernels. ``--repeats N`` times each
(BF16, NVFP4) pair N times, interleaved, and reports the medians and the median of the N ratios (the
BF16 block alone moves by ±3% between calls on one H100). ``--codes-saved`` adds the block with
``staged_expert_activations = false`` (X's and h's wgrad operands saved as codes); ``--requantize`` the block
with ``requantize_expert_weights = true`` (no Wᵀ kept from forward: backward quantizes the weights again), and
with both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F

from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm, nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from titan_nvfp4.kernels import grouped_gemm
from titan_nvfp4.autograd.linear_function import sr_counter

# benchmarks/ is on sys.path when run as a script
from timing import copy_ceiling, header, ms, peak_gib, replay_ms, require_cuda, versions

SHAPES = {
    # name: (experts, dim, hidden, tokens, top_k, gpt-oss style)
    "deepseek_v3_16b": (64, 2048, 1408, 16384, 6, False),
    "gpt_oss_20b": (32, 2880, 2880, 16384, 4, True),
}


def routed_offsets(E: int, tokens: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Cumulative group ends of uniformly random top-k routing, each group padded to 16, and the
    padded row count TorchTitan allocates (tokens·k + 16·E)."""
    choice = torch.rand(tokens, E, generator=gen).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(choice, minlength=E)
    counts = (counts + 15) // 16 * 16
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), tokens * top_k + 16 * E


def expert_block(mm, x, ws, offsets, gpt_oss: bool):
    if gpt_oss:
        w1, b1, w2, b2 = ws
        h = mm(x, w1, offsets, b1, 0)
        gate, up = h[:, ::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
        h = gate * torch.sigmoid(1.702 * gate) * (up + 1)
        return mm(h, w2, offsets, b2, 1)
    w1, w2, w3 = ws
    if getattr(mm, "swiglu", None):  # NVFP4 as NVFP4GroupedExperts runs it: SwiGLU fused with h's amaxes
        h, h_amax = mm.swiglu(x, w1, w3, offsets)
        return mm(h, w2, offsets, None, 1, x_amax=h_amax)
    if getattr(mm, "pair", None):  # NVFP4: W1 and W3 on one quantization of x, as NVFP4GroupedExperts does
        h1, h3 = mm.pair(x, w1, w3, offsets)
    else:
        h1, h3 = mm(x, w1, offsets, None, 0), mm(x, w3, offsets, None, 2)
    act = getattr(mm, "act", None) or (lambda a, b: F.silu(a) * b)
    return mm(act(h1, h3), w2, offsets, None, 1)


def bf16_mm(x, w, offsets, b, _i):
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    if b is not None:  # per-expert bias on each expert's rows, as gpt-oss adds it
        idx = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype), right=True)
        y = y + torch.cat([b, b.new_zeros(1, b.shape[1])])[idx]
    return y


def bf16_compiled_swiglu():
    """BF16 with the SwiGLU compiled into one kernel, as torch.compile gives a BF16 model (a fairer
    baseline for the fused NVFP4 SwiGLU)."""
    act = torch.compile(lambda a, b: F.silu(a) * b)

    def run(x, w, offsets, b, i):
        return bf16_mm(x, w, offsets, b, i)

    run.pair = lambda x, w1, w3, offsets: (bf16_mm(x, w1, offsets, None, 0), bf16_mm(x, w3, offsets, None, 2))
    run.act = act
    return run


def nvfp4_mm_factory(recipe, counters, fused_swiglu: bool = True):
    def run(x, w, offsets, b, i, x_amax=None):
        if x_amax is not None:
            return nvfp4_grouped_mm_shared(x, (w,), offsets, (b,), recipe, (counters[i],), aligned=True,
                                           x_amax=x_amax)[0]
        return nvfp4_grouped_mm(x, w, offsets, b, recipe, counters[i], None, aligned=True)

    def pair(x, w1, w3, offsets):
        return nvfp4_grouped_mm_shared(x, (w1, w3), offsets, (None, None), recipe, (counters[0], counters[2]),
                                       aligned=True)

    def swiglu(x, w1, w3, offsets):
        return nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe, (counters[0], counters[2]), aligned=True,
                                    h_colwise=torch.is_grad_enabled())
    run.pair = pair
    if fused_swiglu:
        run.swiglu = swiglu
    return run


def fwd_bwd(mm, x, ws, offsets, dy, gpt_oss):
    def step():
        for t in (x, *ws):
            t.grad = None
        expert_block(mm, x, ws, offsets, gpt_oss).backward(dy)
    return step


def host_ms(step, reps: int = 20) -> float:
    """Median host time to enqueue ``step`` (the GPU idle at the start, no sync inside)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--profile", action="store_true", help="print the NVFP4 expert block's kernel times")
    ap.add_argument("--bf16-compiled-swiglu", action="store_true",
                    help="also time the block against BF16 with a torch.compile'd SwiGLU")
    ap.add_argument("--graph", action="store_true",
                    help="also time each expert block replayed from a CUDA graph, and its host enqueue time")
    ap.add_argument("--rows-kernels", nargs="*", default=[grouped_gemm.ROWS_KERNEL],
                    choices=["persistent", "persistent_nested", "tiles"],
                    help="row-grouped GEMM kernels to time NVFP4 with (kernels/grouped_gemm.py ROWS_KERNEL)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved (BF16, NVFP4) timings per row (medians)")
    ap.add_argument("--codes-saved", action="store_true",
                    help="also time the block with staged_expert_activations = false")
    ap.add_argument("--requantize", action="store_true",
                    help="also time the block with requantize_expert_weights = true, alone and with codes saved")
    args = ap.parse_args()
    require_cuda()
    gen = torch.Generator().manual_seed(0)
    res = {**versions(), "rows": []}
    copy_tbps = copy_ceiling() / 1e12
    print(f"{header()}  copy {copy_tbps:.2f} TB/s")
    print("| shape | what | BF16 ms | NVFP4 ms | NVFP4/BF16 | BF16 peak GiB | NVFP4 peak GiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    recipe = NVFP4Recipe(gemm_backend="emulated")
    for name in args.shapes:
        E, dim, hidden, tokens, top_k, gpt_oss = SHAPES[name]
        offsets, rows = routed_offsets(E, tokens, top_k, gen)
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if gpt_oss:
            ws = [torch.randn(E, 2 * hidden, dim, device="cuda", dtype=torch.bfloat16) * dim ** -0.5,
                  torch.randn(E, 2 * hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
                  torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5,
                  torch.randn(E, dim, device="cuda", dtype=torch.bfloat16) * 0.02]
        else:
            ws = [torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) * dim ** -0.5,
                  torch.randn(E, dim, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5,
                  torch.randn(E, hidden, dim, device="cuda", dtype=torch.bfloat16) * dim ** -0.5]
        ws = [w.requires_grad_() for w in ws]
        dy = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        counters = [sr_counter(recipe, 1 << 20 | i, "cuda") for i in range(3)]
        nv = nvfp4_mm_factory(recipe, counters)
        cases = []
        w_first, b_first = ws[0], (ws[1] if gpt_oss else None)
        dy_first = torch.randn(rows, w_first.shape[1], device="cuda", dtype=torch.bfloat16)
        one = lambda mm: (lambda: mm(x, w_first, offsets, b_first, 0))  # noqa: E731

        def one_bwd(mm):
            def step():
                x.grad = w_first.grad = None
                mm(x, w_first, offsets, b_first, 0).backward(dy_first)
            return step

        with torch.no_grad():
            cases.append(("first GEMM forward (no grad)", one(bf16_mm), one(nv)))
        cases.append(("first GEMM forward+backward", one_bwd(bf16_mm), one_bwd(nv)))
        cases.append(("expert block forward+backward", fwd_bwd(bf16_mm, x, ws, offsets, dy, gpt_oss),
                      fwd_bwd(nv, x, ws, offsets, dy, gpt_oss)))
        if args.codes_saved:
            codes = dataclasses.replace(recipe, staged_expert_activations=False)
            cases.append(("expert block forward+backward, X and h saved as codes",
                          fwd_bwd(bf16_mm, x, ws, offsets, dy, gpt_oss),
                          fwd_bwd(nvfp4_mm_factory(codes, counters), x, ws, offsets, dy, gpt_oss)))
        if args.requantize:
            for what, variant in (("Wᵀ quantized again in backward", dict(requantize_expert_weights=True)),
                                  ("Wᵀ quantized again, X and h saved as codes",
                                   dict(requantize_expert_weights=True, staged_expert_activations=False))):
                cases.append((f"expert block forward+backward, {what}", fwd_bwd(bf16_mm, x, ws, offsets, dy, gpt_oss),
                              fwd_bwd(nvfp4_mm_factory(dataclasses.replace(recipe, **variant), counters), x, ws,
                                      offsets, dy, gpt_oss)))
        if not gpt_oss:  # the fused SwiGLU's share, and BF16 with a fused SwiGLU of its own
            cases.append(("expert block forward+backward, NVFP4 SwiGLU unfused",
                          fwd_bwd(bf16_mm, x, ws, offsets, dy, gpt_oss),
                          fwd_bwd(nvfp4_mm_factory(recipe, counters, fused_swiglu=False), x, ws, offsets, dy,
                                  gpt_oss)))
            if args.bf16_compiled_swiglu:
                cases.append(("expert block forward+backward, BF16 SwiGLU compiled",
                              fwd_bwd(bf16_compiled_swiglu(), x, ws, offsets, dy, gpt_oss),
                              fwd_bwd(nv, x, ws, offsets, dy, gpt_oss)))
        for what, f_bf16, f_nv in cases:
            no_grad = "no grad" in what
            with torch.set_grad_enabled(not no_grad):
                f_bf16()  # the first call allocates what later calls reuse (the weights' gradients)
                m_b = peak_gib(f_bf16)
                for kernel in args.rows_kernels:
                    grouped_gemm.ROWS_KERNEL = kernel
                    f_nv()  # autotune outside the timing
                    m_n = peak_gib(f_nv)
                    pairs = [(ms(f_bf16), ms(f_nv)) for _ in range(args.repeats)]
                    t_b, t_n = (statistics.median(p[i] for p in pairs) for i in (0, 1))
                    ratio = statistics.median(n / b for b, n in pairs)
                    label = what if len(args.rows_kernels) == 1 else f"{what} [{kernel}]"
                    if args.repeats > 1:
                        label += (f" (median of {args.repeats}; BF16 {min(p[0] for p in pairs):.3f}-"
                                  f"{max(p[0] for p in pairs):.3f}, NVFP4 {min(p[1] for p in pairs):.3f}-"
                                  f"{max(p[1] for p in pairs):.3f})")
                    row = dict(shape=name, what=what, rows_kernel=kernel, bf16_ms=t_b, nvfp4_ms=t_n, ratio=ratio,
                               pairs=pairs, bf16_peak_gib=m_b, nvfp4_peak_gib=m_n, routed_rows=int(offsets[-1]),
                               rows=rows)
                    res["rows"].append(row)
                    print(f"| {name} | {label} | {t_b:.3f} | {t_n:.3f} | {ratio:.2f} | {m_b:.2f} | {m_n:.2f} |",
                          flush=True)
            grouped_gemm.ROWS_KERNEL = args.rows_kernels[0]
        if args.graph:
            print(f"\n| shape | block | eager ms | CUDA graph ms | host enqueue ms |\n| --- | --- | ---: | ---: | ---: |")
            for label, mm in (("BF16", bf16_mm), ("NVFP4", nv)):
                step = fwd_bwd(mm, x, ws, offsets, dy, gpt_oss)
                step()
                t_e, t_g, t_h = ms(step), replay_ms(step), host_ms(step)
                res["rows"].append(dict(shape=name, what=f"{label} block eager/graph/host", eager_ms=t_e,
                                        graph_ms=t_g, host_ms=t_h))
                print(f"| {name} | {label} | {t_e:.3f} | {t_g:.3f} | {t_h:.3f} |", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            block = fwd_bwd(nv, x, ws, offsets, dy, gpt_oss)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                block()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                             key=lambda ev: ev.time_range.start)
            print("\nkernels of 5 µs or more in launch order (µs): " + ", ".join(
                f"{ev.name.split('(')[0][:40]} {ev.time_range.elapsed_us():.0f}" for ev in kernels
                if ev.time_range.elapsed_us() >= 5))
    res["tiles_rows_persistent"] = {str(k): str(v) for k, v in grouped_gemm._rows_persistent_autotuned.cache.items()}
    print("\nautotuned persistent rows GEMM: " + "; ".join(f"{k} -> {v}" for k, v in res["tiles_rows_persistent"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
