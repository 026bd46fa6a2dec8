"""Backports of TorchTitan fixes that this project's comparisons depend on, for torchtitan 0.2.x.

Applied once when the integration is imported; every job file here loads it (BF16 twins included,
through `custom_config_module`), so both arms of a comparison run the same model code.

  * Router gate bias (TorchTitan PR #2450, after 0.2.2): gpt-oss's router gate has a bias that
    ``TokenChoiceTopKRouter.init_weights`` never initializes, so a meta-device model starts from
    whatever to_empty() left in memory (NaN under deterministic mode). It is zeroed after the
    weight's initialization, as upstream now does; a version that already zeroes it is unaffected.

And one extension: the Trainer's checkpointed ``train_state`` also carries the NVFP4 layers'
stochastic-rounding call counts, so a resumed run draws the same random numbers (train_state.py).
"""

from __future__ import annotations

import torch
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

_original_router_init = TokenChoiceTopKRouter.init_weights


def _router_init_weights(self, *args, **kwargs):
    out = _original_router_init(self, *args, **kwargs)
    bias = getattr(self.gate, "bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.zero_()
    return out


def apply() -> None:
    """Install the backports (idempotent)."""
    if TokenChoiceTopKRouter.init_weights is _original_router_init:
        TokenChoiceTopKRouter.init_weights = _router_init_weights
    from .train_state import install_on_running_trainers

    install_on_running_trainers()
