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


def test_inductor_compiled_nvfp4_mlp_matches_eager_and_has_no_graph_break():
    """The emulated kernels as custom ops under inductor (fullgraph=True): same bits as eager."""
    import copy

    torch.manual_seed(0)
    recipe = NVFP4Recipe(gemm_backend="emulated")
    eager = torch.nn.Sequential(NVFP4Linear(1024, 2048, recipe=recipe, layer_id=0), torch.nn.GELU(),
                                NVFP4Linear(2048, 1024, bias=False, recipe=recipe, layer_id=1)).cuda()
    comp = copy.deepcopy(eager)
    torch._dynamo.reset()
    run = torch.compile(comp, fullgraph=True)
    x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    for step in range(2):
        outs = []
        for model in (eager, run):
            xi = x.clone().requires_grad_(True)
            y = model(xi)
            y.backward(dy)
            outs.append((y, xi.grad, [p.grad.clone() for p in eager.parameters()] if model is eager
                         else [p.grad.clone() for p in comp.parameters()]))
        (ye, dxe, ge), (yc, dxc, gc) = outs
        # GELU is fused by inductor and may differ in the last bit; the NVFP4 GEMMs must not amplify it
        assert (ye.float() - yc.float()).abs().max() <= 1e-2 * ye.float().abs().max()
        assert (dxe.float() - dxc.float()).norm() <= 1e-2 * dxe.float().norm()
        for a, b in zip(ge, gc):
            assert (a.float() - b.float()).norm() <= 2e-2 * a.float().norm()
        eager.zero_grad(set_to_none=True)
        comp.zero_grad(set_to_none=True)
    assert [m.sr_calls for m in comp if isinstance(m, NVFP4Linear)] == [2, 2]
