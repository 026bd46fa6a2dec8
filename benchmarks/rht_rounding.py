"""What rounding the transformed wgrad operands to bf16 (the recipe's ``rht_round_to_input_dtype``, Transformer
Engine's behaviour) changes: how many codes differ from keeping them in fp32, and the error of dW = dYᵀ·X.

Runs on CPU with the reference quantizer (the kernels are bit-identical to it, tests/test_te_interchange.py):

    python benchmarks/rht_rounding.py [--tokens 4096] [--features 512] [--seeds 4]

For bf16 operands X and dY of several distributions it prints, per setting, the relative Frobenius error of
dW computed from the two quantized wgrad operands (nearest-even) against float64 dW from the same bf16
operands, and the share of codes and block scales that differ between the two settings.
"""

from __future__ import annotations

import argparse

import torch

from titan_nvfp4.numerics.rht import rht_signs, signs_for_operand
from titan_nvfp4.ops.quantize import quantize_wgrad_operand


def operand(kind: str, tokens: int, features: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [tokens, features]: gaussian, gaussian with per-feature scales over 2^±4 (activations with
    outlier channels), or student-t with 3 degrees of freedom (heavy-tailed gradients)."""
    x = torch.randn(tokens, features, generator=gen, dtype=torch.float64)
    if kind == "channel_outliers":
        x = x * torch.exp2(torch.empty(1, features, dtype=torch.float64).uniform_(-4, 4, generator=gen))
    elif kind == "student_t3":
        chi = torch.randn(3, tokens, features, generator=gen, dtype=torch.float64).pow(2).sum(0) / 3
        x = x / chi.sqrt()
    return x.bfloat16()


def wgrad(dy: torch.Tensor, x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """float64 dW from the dequantized wgrad operands (dYᵀ [N, M], Xᵀ [K, M], both RHT'd along M)."""
    a = quantize_wgrad_operand(dy, signs).dequantize(torch.float64)
    b = quantize_wgrad_operand(x, signs).dequantize(torch.float64)
    return a @ b.t()


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/rht_rounding.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens M (the wgrad contraction dim)")
    p.add_argument("--features", type=int, default=512, help="features of X and of dY")
    p.add_argument("--seeds", type=int, default=4, help="random draws per distribution")
    args = p.parse_args()
    signs = rht_signs(0)
    fp32, bf16 = (signs_for_operand(signs, torch.bfloat16, r) for r in (False, True))
    print("| operands | dW error, fp32 | dW error, bf16 | codes differing | block scales differing |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind in ("gaussian", "channel_outliers", "student_t3"):
        errs, codes, scales = {"fp32": [], "bf16": []}, [], []
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            x = operand(kind, args.tokens, args.features, gen)
            dy = operand(kind, args.tokens, args.features, gen)
            exact = dy.double().t() @ x.double()
            for name, s in (("fp32", fp32), ("bf16", bf16)):
                errs[name].append(((wgrad(dy, x, s) - exact).norm() / exact.norm()).item())
            q32, q16 = quantize_wgrad_operand(x, fp32), quantize_wgrad_operand(x, bf16)
            lo = lambda d: torch.stack((d & 15, d >> 4), -1)  # noqa: E731 (both nibbles)
            codes.append((lo(q32.data) != lo(q16.data)).double().mean().item())
            scales.append((q32.scale.view(torch.uint8) != q16.scale.view(torch.uint8)).double().mean().item())
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        print(f"| {kind} | {mean(errs['fp32']):.5f} | {mean(errs['bf16']):.5f} | {100 * mean(codes):.2f}% "
              f"| {100 * mean(scales):.2f}% |")


if __name__ == "__main__":
    main()
