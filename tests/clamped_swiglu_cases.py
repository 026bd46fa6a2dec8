"""Inputs for the clamped SwiGLU tests of both TorchTitan generations (tests/test_clamped_swiglu.py,
tests/test_torchtitan03.py): random values with the adversarial ones (clamp bounds, signed zeros, infinities, NaN)."""

from __future__ import annotations

import torch

from titan_nvfp4.autograd.clamped_swiglu import LIMIT


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def case(shape, dtype, scale, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g)
    x2, dy2 = x.view(-1, shape[-1]), dy.view(-1, shape[-1] // 2)
    # the clamp bounds and either side of them, signed zeros, infinities and NaN; signed-zero gradients
    x2[0, :10] = torch.tensor([LIMIT, -LIMIT, 7.0001, -7.0001, 0.0, -0.0, float("inf"), float("-inf"),
                               float("nan"), 6.9999])
    x2[1, :6] = torch.tensor([-7.0, 7.0, float("nan"), -0.0, 7.5, float("nan")])  # NaN in both column kinds
    dy2[2, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    dy2[3] = -0.0
    return x.to(device, dtype), dy.to(device, dtype)
