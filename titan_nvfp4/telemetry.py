"""Per-layer NVFP4 numerics telemetry (`telemetry_every`, off by default): every N training steps each
converted Linear measures how its three quantized operands fare (W 16×16 or 1×16, X and dY 1×16, as the
recipe quantizes them, nearest-even; plain weights only: not under TP or the NVFP4 all-gather) and
the numbers go out with TorchTitan's next metrics log
(console, TensorBoard, W&B) as ``nvfp4/<layer>/<operand>/<stat>``:

  amax           the operand's tensor amax
  saturated_pct  share of 16-element blocks with an element clipped at ±6 (the E4M3 block scale rounded
                 down, or an amax from elsewhere)
  underflow_pct  share of nonzero blocks whose E4M3 scale flushed to 0 (the block decodes to zeros)
  snr_db         10·log10(Σx² / Σ(x − x̂)²), the quantization signal-to-noise ratio

The statistics are computed by the reference quantizer (numerics/nvfp4.py) on the high-precision
operand, outside autograd and torch.compile, so a measured step costs one extra quantization per
operand and changes no result.
"""

from __future__ import annotations

import math
import weakref

import torch

from .numerics.nvfp4 import BLOCK, block_encode_factor, global_encode_scale, quantize_nvfp4


def operand_stats(x: torch.Tensor, block_shape=(1, BLOCK)) -> dict[str, float]:
    """The four statistics of quantizing the 2D tensor x with ``block_shape`` (its own tensor amax)."""
    x = x.detach().float()
    q = quantize_nvfp4(x, block_shape)
    rows, cols = x.shape
    if tuple(block_shape) == (BLOCK, BLOCK):
        blocks = x.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(-1, BLOCK * BLOCK)
    else:
        blocks = x.view(-1, BLOCK)
    e_b = q.scale.float().reshape(-1)
    amax_b = blocks.abs().amax(dim=1)
    amax = x.abs().amax()
    factor = block_encode_factor(q.scale.reshape(-1), global_encode_scale(amax))
    saturated = (amax_b * factor > 6.0) & (e_b > 0)
    underflow = (amax_b > 0) & (e_b == 0)
    err = (x - q.dequantize()).square().sum()
    sig = x.square().sum()
    snr = 10 * math.log10(float(sig) / float(err)) if float(err) > 0 else float("inf")
    return {"amax": float(amax), "saturated_pct": 100 * float(saturated.float().mean()),
            "underflow_pct": 100 * float(underflow.float().mean()), "snr_db": snr}


class Telemetry:
    """Shared by the layers one converter made: whether this step is measured, and what was measured
    since TorchTitan's last metrics log."""

    def __init__(self, every: int, counter=None) -> None:
        """``counter``: the converter's StepCounter (schedule.py), whose count of optimizer steps done
        (restored on resume) decides which steps are measured: step 1 and every multiple of ``every``."""
        self.every, self.counter = every, counter
        self.pending: dict[str, float] = {}
        _LIVE.add(self)

    @property
    def active(self) -> bool:
        step = (self.counter.count if self.counter is not None else 0) + 1
        return self.every > 0 and (step == 1 or step % self.every == 0)

    @torch.compiler.disable
    def record(self, layer: str, operand: str, x: torch.Tensor, block_shape=(1, BLOCK)) -> None:
        with torch.no_grad():
            for stat, value in operand_stats(x.reshape(-1, x.shape[-1]), block_shape).items():
                self.pending[f"nvfp4/{layer}/{operand}/{stat}"] = value

    def drain(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out


_LIVE: "weakref.WeakSet[Telemetry]" = weakref.WeakSet()


def drain_all() -> dict[str, float]:
    """Every live Telemetry's pending measurements (emptied)."""
    out: dict[str, float] = {}
    for t in list(_LIVE):
        out.update(t.drain())
    return out


def measure_linear(module, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    """Record W and X of a converted Linear's forward and, through a hook on y, dY in backward."""
    t: Telemetry | None = getattr(module, "telemetry", None)
    if t is None or not t.active or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return  # sharded (DTensor) and FSDP-NVFP4-gathered weights are not measured
    name = getattr(module, "layer_name", "") or type(module).__name__
    t.record(name, "weight", weight, (BLOCK, BLOCK) if module.recipe.weight_2d else (1, BLOCK))
    t.record(name, "input", x)
    if y.requires_grad:
        y.register_hook(lambda dy: t.record(name, "grad_output", dy))


def install_metrics_hook() -> None:
    """Make TorchTitan's MetricsProcessor.log add the pending telemetry to its extra metrics (idempotent)."""
    from torchtitan.components.metrics import MetricsProcessor

    if getattr(MetricsProcessor.log, "_nvfp4_telemetry", False):
        return
    original = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        extra.update(drain_all())
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    log._nvfp4_telemetry = True
    MetricsProcessor.log = log


__all__ = ["Telemetry", "drain_all", "install_metrics_hook", "measure_linear", "operand_stats"]
