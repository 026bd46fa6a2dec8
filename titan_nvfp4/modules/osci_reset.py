"""TetraJet-v2's OsciReset (arXiv 2510.27527; code thu-ml/TetraJet-v2-NVFP4Training): master weights that oscillate
between two FP4 grid points are set to their current FP4 value (the ``osci_reset_*`` knobs of the dense section).

A weight element whose master value sits near a rounding boundary flips between two FP4 values under tiny updates:
its quantized value travels far while the master barely moves. With period P, window W and threshold τ, after
optimizer step s (k ≥ 1, and kP at or after the first step the knobs allow):

* s = kP (open): W_prev ← W, the margin M ← 0;
* s = kP + 1 … kP + W (track): M += |Q(W) − Q(W_prev)| − τ·|W − W_prev| elementwise, then W_prev ← W;
* s = kP + W + 1 (reset): every element with M > 0 (its quantized movement over the window exceeded τ times its
  master movement) gets W ← Q(W); the window closes.

Q is the forward's weight quantization (ops/quantize.py quantize_weight with the layer's recipe: 16×16 or 1×16
blocks, the block-scale rule, the whole weight's tensor scale) dequantized in fp32, so a reset element lands on
the grid point the next forward quantizes it to. The reference quantizer computes it; the kernels equal it bit for
bit. With 1×16 weight blocks (weight_2d = false) that is the forward's grid (blocks along K; dgrad quantizes Wᵀ on
its own). A reset that raises a block's largest magnitude (an element between 4 and 6 reset to 6) can move the
block's scale, as in the authors' code.

The authors keep two sums (A_Q = Σ|ΔQ|, A_W = Σ|ΔW|) and test A_Q / A_W ≥ τ, ratio 0 where A_W = 0; one margin
M = A_Q − τ·A_W holds the same test (M > 0) in half the memory, except where the master did not move at all in the
window and its grid point did (only through the scales): the authors skip such an element, M resets it.

Memory: M, fp32 and shaped like the weight (its local shard), exists from the first window or checkpoint on;
W_prev, in the weight's dtype, only during a window: 8 bytes per fp32 weight element at the peak, where the
authors' three buffers take 12. Q(W_prev) is recomputed at each tracking step rather than stored.

Checkpoints: M rides in the train_state (training/train_state.py); W_prev need not, because after every step of an
open window it equals the weight itself, so a resumed run rebuilds it from the restored weights: bit for bit.

Sharded weights (FSDP2, TP DTensors): Q comes from the whole weight (all-gathered, one layer at a time, at the
window's steps), so a shard sees the whole weight's tensor scale and the 16×16 tiles that straddle shards; M is a
DTensor placed like the weight. Plain local TP shards (TorchTitan 0.3's spmd_types) are refused by name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..distributed.tensor_parallel import local
from ..ops.quantize import quantize_weight

OPEN, TRACK, RESET = "open", "track", "reset"


class OsciReset:
    """The schedule and threshold a section's layers share: a window opens every ``every`` optimizer steps (from
    step ``start_step`` on), sums movements over ``window`` steps and resets the step after."""

    def __init__(self, every: int, window: int, threshold: float, start_step: int = 0) -> None:
        for name, v, low in (("every", every, 1), ("window", window, 1), ("start_step", start_step, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"OsciReset: {name} must be an integer >= {low}, got {v!r}")
        if every < window + 2:
            raise ValueError(f"OsciReset: every = {every} leaves no step for the reset after a window of {window} "
                             f"steps (needs every >= window + 2)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
            raise ValueError(f"OsciReset: threshold must be a positive finite number, got {threshold!r}")
        self.every, self.window, self.threshold, self.start_step = every, window, float(threshold), start_step

    def phase(self, step: int) -> str | None:
        """What follows optimizer step ``step``: OPEN, TRACK, RESET, or None (no window)."""
        if step <= 0:
            return None
        opened = step - step % self.every
        if opened < max(self.every, self.start_step):
            return None
        r = step - opened
        return OPEN if r == 0 else TRACK if r <= self.window else RESET if r == self.window + 1 else None

    def open_after(self, step: int) -> bool:
        """Whether a window is open after ``step`` optimizer steps (its W_prev then equals the weight)."""
        return self.phase(step) in (OPEN, TRACK)

    def __repr__(self) -> str:
        return (f"OsciReset(every={self.every}, window={self.window}, threshold={self.threshold}, "
                f"start_step={self.start_step})")


class Reset(NamedTuple):
    """What a reset step did, on this rank: layers reset, elements set to their FP4 value, elements looked at."""
    layers: int
    elements: int
    total: int


def layers_with_osci_reset(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    parts = model if isinstance(model, list) else [model]
    return [m for part in parts for m in part.modules() if getattr(m, "osci_reset", None) is not None]


def _label(m: nn.Module) -> str:
    return getattr(m, "layer_name", "") or type(m).__name__


def _dequantized(w: torch.Tensor, recipe, split: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Q(w) in fp32. ``split``: OutControl's (selected, rest) input channels: the rest quantized on their own, as the
    forward quantizes W[:, rest] (its own tensor scale and blocks); the selected channels keep w itself, so their
    margin never rises (|ΔQ| = |ΔW| ≤ τ·|ΔW|) and the reset leaves them alone, as the authors' FP4-only reset does."""
    if split is not None:
        sel, rest = split
        q = w.to(torch.float32, copy=True)
        q[:, rest] = _dequantized(w[:, rest], recipe)
        return q
    wq, _ = quantize_weight(w, recipe.weight_2d, "reference", None, four_over_six=recipe.four_over_six)
    return wq.dequantize(torch.float32)


def _outcontrol_split(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """OutControl's (selected, rest) channel indices once selected (nvfp4_linear.py), else None."""
    if not getattr(module, "_outcontrol_on", False):
        return None
    return local(module.outcontrol_index), local(module.outcontrol_rest)


def check_supported(module: nn.Module) -> None:
    """Refuse, by the layer's name, a layer whose weight the reset cannot handle: plain local TP shards."""
    if getattr(module, "local_tp", None) is not None:
        raise NotImplementedError(f"NVFP4 Linear {_label(module)!r}: osci_reset_every is not supported on plain local "
                                  "tensor-parallel shards (TorchTitan 0.3's spmd_types backend); set it to 0")


def forward_grid(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """Q(weight): fp32, this rank's part (the local shard of a DTensor), each element the value the forward
    quantizes it to. A DTensor is all-gathered here: every rank of its mesh must call this for it."""
    check_supported(module)
    split = _outcontrol_split(module)
    if not isinstance(weight, DTensor):
        return _dequantized(weight.detach(), module.recipe, split)
    q = _dequantized(weight.detach().full_tensor(), module.recipe, split)
    return distribute_tensor(q, weight.device_mesh, weight.placements, src_data_rank=None).to_local()


def _like(weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor shaped like weight's) placed as ``weight`` is."""
    if not isinstance(weight, DTensor):
        return value
    return DTensor.from_local(value, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


def margin_of(module: nn.Module) -> torch.Tensor:
    """The layer's margin M (fp32, placed like its weight), created as zeros on first use (or when the weight was
    moved or sharded since, outside a window: M is zeroed whenever a window opens)."""
    w = module.weight
    m = module.__dict__.get("osci_margin")
    wl = local(w)
    if (m is None or isinstance(m, DTensor) != isinstance(w, DTensor) or local(m).shape != wl.shape
            or local(m).device != wl.device or (isinstance(w, DTensor) and m.placements != w.placements)):
        if module.__dict__.get("osci_prev") is not None:
            raise RuntimeError(f"NVFP4 Linear {_label(module)!r}: its weight was moved or resharded during an "
                               "OsciReset window")
        m = _like(w, torch.zeros(wl.shape, dtype=torch.float32, device=wl.device))
        module.osci_margin = m
    return m


def _close(module: nn.Module) -> None:
    """End the layer's window (M is zeroed when the next one opens)."""
    module.osci_prev = None


def _open(module: nn.Module) -> None:
    local(margin_of(module)).zero_()
    module.osci_prev = local(module.weight).detach().clone()


def _track(module: nn.Module, threshold: float) -> None:
    w, prev = module.weight, module.__dict__["osci_prev"]
    wl = local(w).detach()
    moved_q = (forward_grid(module, w) - forward_grid(module, _like(w, prev))).abs_()
    moved_w = (wl.float() - prev.float()).abs_()
    local(margin_of(module)).add_(moved_q.sub_(moved_w.mul_(threshold)))
    prev.copy_(wl)


def _reset(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    q = forward_grid(module, w)
    wl = local(w)
    oscillating = local(margin_of(module)) > 0
    wl.detach().copy_(torch.where(oscillating, q.to(wl.dtype), wl.detach()))
    local(margin_of(module)).zero_()  # a checkpoint outside a window then holds zeros
    _close(module)
    return int(oscillating.sum()), oscillating.numel()


@torch.no_grad()
def osci_reset_step(layers: list[nn.Module], step: int) -> Reset | None:
    """After optimizer step ``step``: open, track or reset the windows of ``layers`` (which share one OsciReset);
    a layer in high precision (bf16_after_fraction) has no window. Returns what a reset step did, else None."""
    if not layers:
        return None
    phase = layers[0].osci_reset.phase(step)
    done = Reset(0, 0, 0)
    for m in layers:
        if m.weight.is_meta:
            continue
        if m.high_precision or phase is None:
            _close(m)
        elif phase == OPEN:
            _open(m)
        elif m.__dict__.get("osci_prev") is None:  # no window (it opened in high precision, or before a resume)
            continue
        elif phase == TRACK:
            _track(m, m.osci_reset.threshold)
        else:
            n, total = _reset(m)
            done = Reset(done.layers + 1, done.elements + n, done.total + total)
    return done if phase == RESET else None


@torch.no_grad()
def resume_windows(layers: dict[str, nn.Module], margins: dict[str, torch.Tensor], step: int) -> list[str]:
    """A resumed run after ``step`` optimizer steps: put the saved margins back and rebuild W_prev (the restored
    weight) of each open window. Returns the layers whose window is open but whose margin the state lacks (their
    window restarts: it sums only the steps from here on)."""
    lost = []
    for fqn, m in layers.items():
        schedule = m.osci_reset
        if m.weight.is_meta or m.high_precision or not schedule.open_after(step):
            _close(m)
            continue
        mine = margin_of(m)
        if fqn in margins:
            saved = margins[fqn]
            if tuple(saved.shape) != tuple(mine.shape):
                raise ValueError(f"checkpoint's OsciReset margin of {fqn!r} has shape {tuple(saved.shape)}, the "
                                 f"layer's weight {tuple(mine.shape)}")
            if saved is not mine:
                mine.copy_(saved)
        else:
            local(mine).zero_()
            if schedule.phase(step) != OPEN:
                lost.append(fqn)
        m.osci_prev = local(m.weight).detach().clone()
    return lost


__all__ = ["OPEN", "RESET", "TRACK", "OsciReset", "Reset", "check_supported", "forward_grid", "layers_with_osci_reset",
           "margin_of",
           "osci_reset_step", "resume_windows"]
