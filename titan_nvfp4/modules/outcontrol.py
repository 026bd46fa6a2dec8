"""TetraJet-v2's OutControl (arXiv 2510.27527; code thu-ml/TetraJet-v2-NVFP4Training, linear_mix.py): the input
channels of a dense Linear that carry the largest activations run in MXFP8, the others in NVFP4 (outcontrol_* keys).

Which channels: during a window of optimizer steps every training forward adds ‖X[:, k]‖₂ over its tokens to a
per-channel fp32 sum. The window holds the forwards taken while the optimizer steps done so far are in
[outcontrol_start, outcontrol_start + outcontrol_steps), TorchTitan's 1-based steps start + 1 … start + steps (the
authors' iterations 501 … 550 with their released 501 / 50). After each of the window's optimizer steps its sums are
added over all ranks (one all_reduce of every layer's sums, when torch.distributed is initialized: every rank must hold
the same layers, so pipeline and tensor parallelism are refused); after the last, the k channels with the largest
sums are selected once and for all: descending sum, a tie going to the lower channel index; stored ascending.
k = round(K · fraction) rounded up to a multiple of 32 (MXFP8's block), at most K (the authors round up to 128 for
their kernels).

Then forward is Y = NVFP4(X[:, rest] W[:, rest]ᵀ) + b + MXFP8(X[:, sel] W[:, sel]ᵀ), the NVFP4 part with the layer's
recipe, SR stream, RHT signs and amax history (its operands' tensor scales are those of the rest columns); the MXFP8
part's fp32 sums are added to the NVFP4 part's rounded output and rounded once (the authors add the FP8 GEMM into the
FP4 GEMM's fp32 accumulator: one rounding fewer). The backward is the authors': dgrad one NVFP4 GEMM over every column on the
forward's quantized weight rebuilt from both parts, wgrad NVFP4 for the rest and MXFP8 for the selected columns
(autograd/outcontrol_linear.py).

State: ``outcontrol_index`` (int64 [k], the selected channels) and ``outcontrol_done`` (bool) are persistent buffers,
so the selection rides in the model's state dict (checkpoints, DCP); a state dict without them (BF16, HF, a run
without the knob) leaves the layer unselected. The sums are non-persistent buffers: each forward adds to this step's
(``outcontrol_step``), which after the optimizer step is summed over the ranks into the window's (``outcontrol_norms``,
alike on every rank); those travel in the trainer's state beside the SR counts (training/train_state.py), so a run
resumed inside the window selects what the uninterrupted one does. ``_outcontrol_on`` is the Python twin of
``outcontrol_done`` read in forward (no device sync, one recompile when it flips).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed.tensor_parallel import local
from ..numerics.mxfp8 import MX_BLOCK


def outcontrol_channels(in_features: int, fraction: float) -> int:
    """How many of ``in_features`` input channels OutControl runs in MXFP8: round(K · fraction) rounded up to a
    multiple of 32, at most K (0: none)."""
    return min(in_features, math.ceil(round(in_features * fraction) / MX_BLOCK) * MX_BLOCK)


class OutControlWindow:
    """The window a section's layers share: ``recording`` while the optimizer steps done are in [start, start +
    steps); the selection follows optimizer step ``end``."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps, self.end = start, steps, start + steps
        self.recording = False
        self.at_step(0)

    def at_step(self, done: int) -> None:
        """Set the state after ``done`` optimizer steps."""
        self.recording = self.start <= done < self.end

    def __repr__(self) -> str:
        return f"OutControlWindow(start={self.start}, steps={self.steps})"


def layer_label(m: nn.Module) -> str:
    """The layer's name for messages."""
    return getattr(m, "layer_name", "") or type(m).__name__


def register_outcontrol(module: nn.Module, device) -> None:
    """Give ``module`` (an NVFP4Linear whose recipe has outcontrol_fraction > 0 and k > 0 channels) its buffers,
    unselected."""
    k = outcontrol_channels(module.in_features, module.recipe.outcontrol_fraction)
    if not k:
        return
    module.register_buffer("outcontrol_index", torch.zeros(k, dtype=torch.int64, device=device))
    module.register_buffer("outcontrol_done", torch.zeros((), dtype=torch.bool, device=device))
    for name in ("outcontrol_norms", "outcontrol_step"):
        module.register_buffer(name, torch.zeros(module.in_features, dtype=torch.float32, device=device),
                               persistent=False)
    module.register_buffer("outcontrol_rest", torch.zeros(module.in_features - k, dtype=torch.int64, device=device),
                           persistent=False)
    module._outcontrol_on = False
    reset_outcontrol(module)


def has_outcontrol(module: nn.Module) -> bool:
    return module._buffers.get("outcontrol_done") is not None


@torch.no_grad()
def reset_outcontrol(module: nn.Module) -> None:
    """Unselected, sums zero (a freshly materialized meta module: its buffers hold garbage)."""
    if module.outcontrol_done.is_meta:
        return
    local(module.outcontrol_done).fill_(False)
    local(module.outcontrol_index).copy_(torch.arange(module.outcontrol_index.shape[0]))
    local(module.outcontrol_norms).zero_()
    local(module.outcontrol_step).zero_()
    module._outcontrol_on = False


def check_supported(module: nn.Module, weight: torch.Tensor | None = None) -> None:
    """Refuse, by the layer's name, tensor-parallel shards (a DTensor weight in forward, or plain local shards)."""
    if getattr(module, "local_tp", None) is not None or isinstance(weight, DTensor):
        raise NotImplementedError(f"NVFP4 Linear {layer_label(module)!r}: outcontrol_fraction is not supported "
                                  "with tensor parallelism yet (the channel split of a sharded weight); set it to 0")


@torch.no_grad()
def record(module: nn.Module, x: torch.Tensor) -> None:
    """Add ‖X[:, k]‖₂ over this forward's tokens to the layer's per-channel sums of this optimizer step."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    module.outcontrol_step.add_(torch.linalg.vector_norm(x2d, dim=0, dtype=torch.float32))


@torch.no_grad()
def adopt_selection(module: nn.Module) -> bool:
    """Read the layer's ``outcontrol_done`` (a load put it there) into its Python twin and derive the rest channels;
    a selection that is not k distinct channels in [0, K) is refused by name. Returns whether it is selected."""
    done = bool(local(module.outcontrol_done))
    if done:
        idx = local(module.outcontrol_index)
        k, n = idx.shape[0], module.in_features
        taken = torch.zeros(n, dtype=torch.bool, device=idx.device)
        if bool((idx < 0).any()) or bool((idx >= n).any()):
            raise ValueError(f"NVFP4 Linear {layer_label(module)!r}: outcontrol_index holds channels outside [0, {n})")
        taken[idx] = True
        if int(taken.sum()) != k:
            raise ValueError(f"NVFP4 Linear {layer_label(module)!r}: outcontrol_index holds a channel twice")
        local(module.outcontrol_rest).copy_((~taken).nonzero().reshape(-1))
    module._outcontrol_on = done
    return done


@torch.no_grad()
def end_window_step(layers: list[nn.Module]) -> None:
    """After an optimizer step of the window: add this step's sums, summed over all ranks (one all_reduce of every
    layer's, when torch.distributed runs several: every rank calls this with the same layers), into the window's sums,
    which every rank then holds alike (a checkpoint carries one copy: training/train_state.py)."""
    pending = [m for m in layers if has_outcontrol(m) and not m._outcontrol_on and not m.outcontrol_done.is_meta]
    if not pending:
        return
    steps = [local(m.outcontrol_step) for m in pending]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat(steps)
        dist.all_reduce(flat)
        for m, s in zip(pending, flat.split([s.numel() for s in steps])):
            local(m.outcontrol_norms).add_(s)
    else:
        for m, s in zip(pending, steps):
            local(m.outcontrol_norms).add_(s)
    for s in steps:
        s.zero_()


@torch.no_grad()
def select_channels(layers: list[nn.Module]) -> list[tuple[str, int, int]]:
    """Select the channels of every unselected layer of ``layers`` from the window's sums (end_window_step: summed
    over the ranks already); returns (layer name, k, K) of each layer selected."""
    pending = [m for m in layers if has_outcontrol(m) and not m._outcontrol_on and not m.outcontrol_done.is_meta]
    done = []
    for m in pending:
        k, s = m.outcontrol_index.shape[0], local(m.outcontrol_norms)
        order = torch.sort(s, descending=True, stable=True).indices  # ties: the lower channel first
        local(m.outcontrol_index).copy_(order[:k].sort().values)
        local(m.outcontrol_done).fill_(True)
        s.zero_()
        adopt_selection(m)
        done.append((layer_label(m), k, m.in_features))
    return done


def layers_with_outcontrol(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    parts = model if isinstance(model, list) else [model]
    return [m for part in parts for m in part.modules() if getattr(m, "outcontrol", None) is not None]


def sync_outcontrol(model: nn.Module | list[nn.Module]) -> None:
    """After a checkpoint load: every layer's Python twin from its (loaded) ``outcontrol_done``."""
    parts = model if isinstance(model, list) else [model]
    for m in (m for part in parts for m in part.modules()):
        if has_outcontrol(m) and not m.outcontrol_done.is_meta:
            adopt_selection(m)


__all__ = ["OutControlWindow", "adopt_selection", "check_supported", "end_window_step", "has_outcontrol",
           "layer_label", "layers_with_outcontrol", "outcontrol_channels", "record", "register_outcontrol",
           "reset_outcontrol", "select_channels", "sync_outcontrol"]
