"""The reference path on a CUDA/ROCm GPU: same bits as on CPU, GEMM exact up to fp32 accumulation.
Skipped without a GPU."""

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, quantize_nvfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 1), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_on_gpu_is_bit_identical_to_cpu(block_shape, dtype):
    x = (torch.randn(256, 512) * torch.exp(torch.randn(256, 1) * 2)).to(dtype)
    cpu = quantize_nvfp4(x, block_shape=block_shape)
    gpu = quantize_nvfp4(x.cuda(), block_shape=block_shape)
    assert torch.equal(cpu.data, gpu.data.cpu())
    assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.view(torch.uint8).cpu())
    assert torch.equal(cpu.global_scale, gpu.global_scale.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_forward_on_gpu_matches_float64(dtype):
    lin = NVFP4Linear(512, 256, bias=False, recipe=NVFP4Recipe()).cuda()
    x = torch.randn(4, 128, 512, device="cuda", dtype=dtype)
    y = lin(x)
    xq = quantize_nvfp4(x.reshape(-1, 512))
    wq = quantize_nvfp4(lin.weight, block_shape=(16, 16))
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
    rel = (y.reshape(-1, 256).double() - ref).norm() / ref.norm()
    assert y.dtype == dtype
    assert rel < (1e-5 if dtype == torch.float32 else 8e-3)  # bf16 output: one bf16 rounding


def test_linear_backward_on_gpu_runs_under_autocast():
    lin = NVFP4Linear(256, 256, bias=True).cuda()
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()
    assert lin.weight.grad.abs().sum() > 0
