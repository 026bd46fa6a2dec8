"""NVFP4 kernels and NVFP4Linear against this GPU's ceilings, all measured in one run.

    python benchmarks/bench_kernels.py [--json out.json] [--quick]

Ceilings: device-to-device copy (bytes read + written per second) and cuBLAS BF16 matmul TFLOP/s.
Then each quantization kernel's bandwidth as a fraction of the copy ceiling, the emulated GEMM's
TFLOP/s as a fraction of cuBLAS BF16 at the same shape, and NVFP4Linear forward+backward time and
peak memory over BF16 nn.Linear's. Times (benchmarks/timing.py): medians of triton.testing.do_bench
(L2 flushed); the quantization kernels and the Linear are also timed replayed from a CUDA graph, which
leaves out the host time of an eager call (Python, launches): the kernels' own speed where the host is
the slower. ``--only`` picks sections (kernels, gemm, linear) and ``--kernels REGEX`` kernel rows, e.g.

    python benchmarks/bench_kernels.py --only kernels --kernels "MXFP8"
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.kernels import gemm as _g
from titan_nvfp4.kernels import mxfp8 as _mx
from titan_nvfp4.kernels.gemm import nvfp4_gemm_triton
from titan_nvfp4.kernels.quantize import quantize_operand, quantize_weight_2d
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.library import StagedOperand

# benchmarks/ is on sys.path when run as a script
from timing import bf16_tflops, copy_ceiling, graph_ms_or_none, header, ms, peak_gib, require_cuda, versions

LINEAR_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096),
                 (2048, 4096, 4096), (2048, 4096, 14336), (2048, 14336, 4096)]


def _fmt(t: float | None) -> str:
    return f"{t:.3f}" if t else "n/a"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    ap.add_argument("--stage-a", type=int, choices=(0, 1), default=None,
                    help="GEMM operand A staged as fp16 (1) or dequantized in registers (0) in the Linear rows")
    ap.add_argument("--only", default="kernels,gemm,linear",
                    help="comma-separated sections to run: kernels, gemm, linear (default: all)")
    ap.add_argument("--kernels", default="", help="regex: only the quantization kernel rows whose name matches")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= {"kernels", "gemm", "linear"}:
        ap.error(f"--only: unknown section(s) {sorted(only - {'kernels', 'gemm', 'linear'})}")
    require_cuda()
    args.stage_a = bool(_g.STAGE_A if args.stage_a is None else args.stage_a)
    torch.manual_seed(0)
    res = versions()
    copy_bw = copy_ceiling()
    res["copy_TBps"] = copy_bw / 1e12
    res["bf16_8192_TFLOPs"] = bf16_tflops(8192, 8192, 8192)
    print(header())
    print(f"copy ceiling {copy_bw / 1e12:.2f} TB/s | cuBLAS bf16 8192^3 {res['bf16_8192_TFLOPs']:.0f} TFLOP/s\n")

    # --- quantization kernels, bytes = what each launch sequence must read and write at minimum
    # two timings: an eager call (do_bench; host time included where it exceeds the GPU's) and the same
    # launches replayed from a CUDA graph (the kernels' own bandwidth)
    print("| kernel | input | eager ms | TB/s | of copy | graph ms | TB/s | of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    M, K = 16384, 4096  # 128 MiB of bf16
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    signs = rht_signs(0, "cuda")
    seed = torch.full((1,), 7, dtype=torch.int64, device="cuda")
    amax = x.abs().amax().float()
    n = M * K
    codes = n // 2 + n // 16  # packed codes + e4m3 scales of one operand
    cases = [
        ("amax + rowwise 1x16 (RNE)", lambda: quantize_operand(x), 2 * (2 * n) + codes),
        ("rowwise 1x16 (RNE), amax given", lambda: quantize_operand(x, amax=amax), 2 * n + codes),
        ("amax(x, RHT xT) + rowwise + RHT colwise (fwd X)", lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs), 4 * n + 2 * codes),
        ("rowwise + RHT colwise, amaxes given", lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs, amax=amax, amax_col=amax), 2 * n + 2 * codes),
        ("rowwise SR + RHT colwise SR, amaxes given (bwd dY)", lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs, stochastic_row=True, stochastic_col=True, seed=seed, amax=amax, amax_col=amax), 2 * n + 2 * codes),
        ("4/6: rowwise 1x16 (RNE), amax given", lambda: quantize_operand(x, amax=amax, four_over_six=True), 2 * n + codes),
        ("4/6: rowwise + RHT colwise, amaxes given (fwd X)", lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs, amax=amax, amax_col=amax, four_over_six=True), 2 * n + 2 * codes),
        ("4/6: rowwise SR + RHT colwise SR, amaxes given (bwd dY)", lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs, stochastic_row=True, stochastic_col=True, seed=seed, amax=amax, amax_col=amax, four_over_six=True), 2 * n + 2 * codes),
    ]
    from titan_nvfp4.kernels import quantize as _q

    def amax_only(rht: bool):
        buf = torch.zeros(4, dtype=torch.int32, device="cuda")
        _q.launch_tuned(_q._amax_kernel, _q._amax_autotuned, x, M, K, x, M, K, x.stride(0), x.stride(1), buf, signs,
                   buf, 1, ROW=True, COL=rht, RHT=rht, GROUPED=False)

    cases.insert(0, ("amax kernel alone, |x|", lambda: amax_only(False), 2 * n))
    cases.insert(1, ("amax kernel alone, |x| and |RHT xT|", lambda: amax_only(True), 2 * n))
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)  # 112 MiB
    nw = w.numel()
    w_amax = w.abs().amax().float()  # outside the timed calls, as x's amax above
    cases.append(("weight 16x16 + W^T codes, amax included", lambda: quantize_weight_2d(w), 2 * (2 * nw) + nw + nw // 256))
    cases.append(("weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=w_amax), 2 * nw + nw + nw // 256))
    cases.append(("4/6: weight 16x16 + W^T codes, amax given", lambda: quantize_weight_2d(w, amax=w_amax, four_over_six=True), 2 * nw + nw + nw // 256))
    from titan_nvfp4.kernels.mxfp8 import quantize_mxfp8_operand

    mx = n + n // 32  # e4m3 elements + e8m0 scales of one MXFP8 operand
    cases.append(("MXFP8 rowwise 1x32", lambda: quantize_mxfp8_operand(x), 2 * n + mx))
    cases.append(("MXFP8 rowwise + colwise (bwd operands)", lambda: quantize_mxfp8_operand(x, colwise=True), 2 * n + 2 * mx))
    cases.append(("MXFP8 colwise alone (fwd: saved X^T)",
                  lambda: quantize_mxfp8_operand(x, rowwise=False, colwise=True), 2 * n + mx))
    from titan_nvfp4.kernels.mxfp8 import quantize_mxfp8_tensors

    cases.append(("MXFP8 rowwise + colwise, staged bf16 (bwd dY as trained)",
                  lambda: quantize_mxfp8_tensors(x, True, True, staged=True), 2 * n + 2 * (2 * n)))
    cases.append(("MXFP8 colwise alone, staged bf16 (bwd W as trained)",
                  lambda: quantize_mxfp8_tensors(x, False, True, staged=True), 2 * n + 2 * n))
    cases = [c for c in cases if re.search(args.kernels, c[0])]
    for name, fn, nbytes in (cases if "kernels" in only else []):
        t = ms(fn)
        bw = nbytes / (t * 1e-3)
        tg = graph_ms_or_none(fn)
        bwg = nbytes / (tg * 1e-3) if tg else float("nan")
        rows.append({"kernel": name, "ms": t, "TBps": bw / 1e12, "of_copy": bw / copy_bw,
                     "graph_ms": tg, "graph_TBps": bwg / 1e12, "graph_of_copy": bwg / copy_bw})
        inp = "x bf16 16384x4096" if "weight" not in name else "W bf16 14336x4096"
        print(f"| {name} | {inp} | {t:.3f} | {bw / 1e12:.2f} | {bw / copy_bw:.0%} | "
              f"{tg if tg else float('nan'):.3f} | {bwg / 1e12:.2f} | {bwg / copy_bw:.0%} |", flush=True)
    res["quantize"] = rows

    # --- emulated GEMM
    # three ways in: operands staged by the quantization kernels (the forward GEMM's case: the kernel
    # alone), packed operands staged here in row chunks (dgrad's W, wgrad's X), A dequantized in registers
    print("\n| GEMM M×N×K | staged in ms | TFLOP/s | packed in ms | TFLOP/s | A in registers ms | TFLOP/s "
          "| cuBLAS bf16 TFLOP/s | staged / cuBLAS | packed / cuBLAS | registers / cuBLAS |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    gem = []
    shapes = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 14336, 4096), (16384, 4096, 14336)]
    if args.quick:
        shapes = shapes[:1]
    if "gemm" not in only:
        shapes = []
    for m, nn_, k in shapes:
        a, _ = quantize_operand(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        b, _ = quantize_weight_2d(torch.randn(nn_, k, device="cuda", dtype=torch.bfloat16), emit_transpose=False)
        a_st, b_st = (StagedOperand(q.scaled_codes(torch.float16), q.global_scale) for q in (a, b))
        t_s = ms(lambda: nvfp4_gemm_triton(a_st, b_st, torch.bfloat16))
        del a_st, b_st
        t = ms(lambda: nvfp4_gemm_triton(a, b, torch.bfloat16, stage_a=True))
        t_r = ms(lambda: nvfp4_gemm_triton(a, b, torch.bfloat16, stage_a=False))
        tf_s, tf, tf_r = (2 * m * nn_ * k / (x_ * 1e-3) / 1e12 for x_ in (t_s, t, t_r))
        ref = bf16_tflops(m, nn_, k)
        gem.append({"shape": [m, nn_, k], "staged_ms": t_s, "staged_TFLOPs": tf_s, "staged_ratio": tf_s / ref,
                    "ms": t, "TFLOPs": tf, "bf16_TFLOPs": ref, "ratio": tf / ref,
                    "registers_ms": t_r, "registers_TFLOPs": tf_r, "registers_ratio": tf_r / ref})
        print(f"| {m}×{nn_}×{k} | {t_s:.3f} | {tf_s:.0f} | {t:.3f} | {tf:.0f} | {t_r:.3f} | {tf_r:.0f} | {ref:.0f} "
              f"| {tf_s / ref:.0%} | {tf / ref:.0%} | {tf_r / ref:.0%} |")
    res["gemm"] = gem

    # --- NVFP4Linear vs nn.Linear, forward + backward
    print(f"\n(GEMM operand A staged: {args.stage_a})")
    _g.STAGE_A = args.stage_a
    print("\n| Linear M×K×N | BF16 ms | NVFP4 ms | NVFP4/BF16 | BF16 peak GiB | NVFP4 peak GiB "
          "| NVFP4 fwd + MXFP8 bwd ms | its /BF16 | its peak GiB | graph: BF16 ms | NVFP4 ms | NVFP4/BF16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lin_rows = []
    for m, k, nn_ in (LINEAR_SHAPES[:1] if args.quick else LINEAR_SHAPES) if "linear" in only else []:
        out = {}
        for kind in ("bf16", "nvfp4", "mxfp8_bwd"):
            torch.cuda.empty_cache()
            if kind == "bf16":
                layer = torch.nn.Linear(k, nn_, bias=False, device="cuda", dtype=torch.bfloat16)
            else:
                recipe = NVFP4Recipe(backward="mxfp8" if kind == "mxfp8_bwd" else "nvfp4")
                layer = NVFP4Linear(k, nn_, bias=False, device="cuda", dtype=torch.bfloat16, recipe=recipe)
            xx = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, nn_, device="cuda", dtype=torch.bfloat16)

            def step():
                layer(xx).backward(dy)
                xx.grad = None
                layer.weight.grad = None

            t = ms(step, rep=100)
            tg = graph_ms_or_none(step) if kind != "mxfp8_bwd" else None  # GPU work alone (no host time)
            step()
            out[kind] = (t, peak_gib(step), tg)
            del layer, xx, dy
        ratio, mx_ratio = out["nvfp4"][0] / out["bf16"][0], out["mxfp8_bwd"][0] / out["bf16"][0]
        lin_rows.append({"shape": [m, k, nn_], "bf16_ms": out["bf16"][0], "nvfp4_ms": out["nvfp4"][0], "ratio": ratio,
                         "bf16_peak_GiB": out["bf16"][1], "nvfp4_peak_GiB": out["nvfp4"][1],
                         "mxfp8_bwd_ms": out["mxfp8_bwd"][0], "mxfp8_bwd_ratio": mx_ratio,
                         "mxfp8_bwd_peak_GiB": out["mxfp8_bwd"][1],
                         "graph_bf16_ms": out["bf16"][2], "graph_nvfp4_ms": out["nvfp4"][2]})
        print(f"| {m}×{k}×{nn_} | {out['bf16'][0]:.3f} | {out['nvfp4'][0]:.3f} | {ratio:.2f}× | {out['bf16'][1]:.2f} "
              f"| {out['nvfp4'][1]:.2f} | {out['mxfp8_bwd'][0]:.3f} | {mx_ratio:.2f}× | {out['mxfp8_bwd'][1]:.2f} "
              f"| {_fmt(out['bf16'][2])} | {_fmt(out['nvfp4'][2])} | {_ratio(out['nvfp4'][2], out['bf16'][2])} |", flush=True)
    res["linear"] = lin_rows
    res["linear_stage_a"] = args.stage_a
    for name, tuner in (("gemm", _g._nvfp4_gemm_autotuned), ("gemm_persistent", _g._nvfp4_gemm_persistent_autotuned),
                        ("dequant", _g._dequant_autotuned), ("quantize", _q._quantize_autotuned),
                        ("quantize_2d", _q._quantize_2d_autotuned), ("amax", _q._amax_autotuned),
                        ("mxfp8", _mx._mxfp8_autotuned), ("mxfp8_cols", _mx._cols_autotuned)):
        picked = {str(k): str(v) for k, v in tuner.cache.items()}
        res[f"tiles_{name}"] = picked
        print(f"\nautotuned {name}: " + "; ".join(f"{k} -> {v}" for k, v in picked.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
