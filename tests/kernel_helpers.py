"""What the kernel tests share: the device they run on, their inputs (random, heavy-tailed, adversarial) and the
bit-for-bit comparisons of NVFP4 tensors and of values (NaN matching NaN)."""

import torch

from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def same_bits(a: NVFP4Tensor, b: NVFP4Tensor, what: str) -> None:
    assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape, what
    assert torch.equal(a.scale.view(torch.uint8).cpu(), b.scale.view(torch.uint8).cpu()), f"{what}: scales differ"
    assert torch.equal(a.data.cpu(), b.data.cpu()), f"{what}: codes differ"
    ga, gb = a.global_scale.cpu(), b.global_scale.cpu()
    assert torch.equal(ga, gb) or bool(ga.isnan().all() and gb.isnan().all()), f"{what}: global scale differs"


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element on the CPU, NaN matching NaN."""
    a, b = a.cpu(), b.cpu()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def inputs(m: int, k: int, kind: str, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 7919 + k)
    x = torch.randn(m, k, generator=g)
    if kind == "heavy":  # per-row magnitudes over ~12 binades, plus a few outliers
        x = x * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).float())
        x.view(-1)[:: max(1, x.numel() // 7)] *= 300
    elif kind == "adversarial":
        x = torch.randn(m, k, generator=g)
        x[:, :16] = 0.0  # zero blocks
        if m > 1:
            x[1, 16:32] = 1e-30  # scale underflow next to normal blocks
        x.view(-1)[3::17] = 0.25 * torch.sign(x.view(-1)[3::17])  # would-be ties after scaling
        x.view(-1)[5] = -0.0
        x.view(-1)[-1] = 1e4  # huge
    return x.to(dtype).to(DEV)
