"""torch.compile of a model's blocks, as TorchTitan compiles them (one torch.compile per block, all running the
same forward code): NVFP4 layers must not make dynamo recompile that code once per block. A name read in
forward (for error messages) would install a guard on it; past the recompile limit (8), later blocks then
run eager, unseen."""

import pytest
import torch
from torch import nn

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.ops.backends import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


class Block(nn.Module):
    def __init__(self, i: int, recipe: NVFP4Recipe):
        super().__init__()
        self.up = NVFP4Linear.from_linear(nn.Linear(32, 64, bias=False, device=DEV), recipe, 2 * i, f"layers.{i}.up")
        self.down = NVFP4Linear.from_linear(nn.Linear(64, 32, bias=False, device=DEV), recipe, 2 * i + 1,
                                            f"layers.{i}.down")

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_blocks_compile_once_for_every_layer(monkeypatch):
    """Three blocks, one graph (the kernels' custom ops are opaque to dynamo: fullgraph), no recompile. Forward
    alone: dynamo guards the frames it compiles there (it traces each autograd.Function's backward while
    compiling its forward); the backward runs no new frame."""
    recipe = NVFP4Recipe(gemm_backend="emulated")
    blocks = [torch.compile(Block(i, recipe), backend="eager", fullgraph=True) for i in range(3)]
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    x = torch.randn(16, 32, device=DEV, requires_grad=True)
    y = x
    for b in blocks:
        y = b(y)
    assert y.requires_grad and torch.isfinite(y).all()
