"""Per-kernel GPU time of the quantization launchers (torch.profiler), to see where the time goes.

    python benchmarks/profile_quant.py [--m 16384 --k 4096]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from titan_nvfp4.kernels.quantize import quantize_operand, quantize_weight_2d
from titan_nvfp4.numerics.rht import rht_signs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096)
    args = p.parse_args()
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    signs = rht_signs(0, x.device)
    seed = torch.full((1,), 7, dtype=torch.int64, device="cuda")
    cases = {
        "fwd X: amax + row + RHT col": lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs),
        "bwd dY: row SR + RHT col SR": lambda: quantize_operand(x, rowwise=True, colwise=True, signs=signs,
                                                                stochastic_row=True, stochastic_col=True, seed=seed),
        "row only": lambda: quantize_operand(x),
        "weight 16x16 + T": lambda: quantize_weight_2d(x),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {name} (10 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
