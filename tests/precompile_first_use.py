"""A stand-in training process for tests/test_precompile.py: with Triton's driver presenting an sm_90 GPU (compile
only: nothing launches), specialize and compile two of the package's kernels as their launchers call them, into the
Triton cache folder of the environment; with --record PATH, write what compiled as a precompile manifest. With
--gpu (tests/test_gpu.py): on the real GPU, a training step of two NVFP4Linears (bf16 autocast, M 4096, autotuned
tiles and the shipped choices as training gets them) instead.

    python tests/precompile_first_use.py [--block 128 | --gpu] [--record MANIFEST]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


class Sm90Driver:
    """Triton's active driver as a Hopper GPU presents it, enough to specialize and compile."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def first_use(block: int) -> list:
    """A small kernel, the amax kernel with its helper functions and flags, and the dequantization kernel (an fp8
    scale pointer, a stride specialized to 1); their compiled kernels."""
    from titan_nvfp4.kernels import expert_map, gemm, quantize
    offsets, out = torch.zeros(8, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    kernels = [expert_map._block_experts_kernel.warmup(offsets, 8, out, 64, EP2=8, BLOCK=block, grid=(1,))]
    x, buf = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    kernels.append(quantize._amax_kernel.warmup(x, 64, 256, 256, 1, buf, buf, None, 1, 64, ROW=True, COL=False,
                                                RHT=True, GROUPED=False, G=4, BK=64, grid=(1,)))
    data, words = torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 128, dtype=torch.int32)
    scale = torch.zeros(64, 16, dtype=torch.float8_e4m3fn)
    kernels.append(gemm._dequant_kernel.warmup(data, scale, words, 64, 256, 128, 16, 1, 128, 64, 256, SCALE_DIV=1,
                                               BR=16, BC=256, num_warps=4, grid=(1,)))
    return kernels


def gpu_step() -> None:
    """Forward and backward of two NVFP4Linears (1024 → 2048 → 1024) over 4096 bf16 tokens, then a second step."""
    from titan_nvfp4 import NVFP4Linear
    torch.manual_seed(0)
    model = torch.nn.Sequential(NVFP4Linear(1024, 2048, layer_id=0), torch.nn.GELU(),
                                NVFP4Linear(2048, 1024, layer_id=1)).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--record", type=Path)
    args = p.parse_args()
    if not args.gpu:
        driver.set_active(Sm90Driver())
    from titan_nvfp4.kernels import precompile
    with precompile.recording() as rec:
        if args.gpu:
            gpu_step()
        else:
            first_use(args.block)
            first_use(args.block)  # met twice: recorded once
    if args.record:
        args.record.write_text(json.dumps(rec.manifest(job="tests/precompile_first_use.py")))


if __name__ == "__main__":
    main()
