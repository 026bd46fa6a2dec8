"""Three sibling NVFP4 Linears on one X (wq, wk, wv), built on meta and materialized as TorchTitan does: the model
of the sibling tests (test_sibling_cse.py, test_sibling_x.py)."""

import torch
from torch import nn

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class QKV(nn.Module):
    """Three layers on one X, built on meta and materialized as TorchTitan does."""

    def __init__(self, recipe: NVFP4Recipe):
        super().__init__()
        self.q, self.k, self.v = (NVFP4Linear(64, n, bias=False, recipe=recipe, layer_id=i, name=f"w{i}")
                                  for i, n in enumerate((64, 32, 32)))

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def qkv_layers(recipe: NVFP4Recipe) -> QKV:
    with torch.device("meta"):
        m = QKV(recipe)
    m.to_empty(device=DEV)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in (m.q, m.k, m.v):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    return m
