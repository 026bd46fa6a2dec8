"""Per-layer NVFP4 numerics telemetry (`telemetry_every`, off by default): every N training steps each
converted Linear, and each grouped GEMM of the converted experts, measures how its three quantized
operands fare (W 16×16 or 1×16, per expert for expert weights; X and dY 1×16; as the recipe quantizes
them, nearest-even; plain weights only: not under TP or the NVFP4 all-gather) and the numbers go out
with TorchTitan's next metrics log (console, TensorBoard, W&B) as ``nvfp4/<layer>/<operand>/<stat>``
(``nvfp4/<experts>/<weight name>/<operand>/<stat>`` for experts):

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

from ..numerics.nvfp4 import BLOCK, block_encode_factor, global_encode_scale, quantize_nvfp4


def _operand_sums(x: torch.Tensor, block_shape=(1, BLOCK)) -> dict[str, float]:
    """Counts and sums behind operand_stats, additive over tensors quantized separately (experts)."""
    x = x.detach().float()
    q = quantize_nvfp4(x, block_shape)
    rows, cols = x.shape
    if tuple(block_shape) == (BLOCK, BLOCK):
        blocks = x.view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(-1, BLOCK * BLOCK)
    else:
        blocks = x.view(-1, BLOCK)
    e_b = q.scale.float().reshape(-1)
    amax_b = blocks.abs().amax(dim=1)
    amax = x.abs().amax() if x.numel() else x.new_zeros(())
    factor = block_encode_factor(q.scale.reshape(-1), global_encode_scale(amax))
    saturated = (amax_b * factor > 6.0) & (e_b > 0)
    underflow = (amax_b > 0) & (e_b == 0)
    return {"amax": float(amax), "saturated": float(saturated.sum()), "underflow": float(underflow.sum()),
            "blocks": float(amax_b.numel()), "signal": float(x.square().sum()),
            "error": float((x - q.dequantize()).square().sum())}


def _stats(sums: dict[str, float]) -> dict[str, float]:
    n = max(sums["blocks"], 1.0)
    snr = 10 * math.log10(sums["signal"] / sums["error"]) if sums["error"] > 0 else float("inf")
    return {"amax": sums["amax"], "saturated_pct": 100 * sums["saturated"] / n,
            "underflow_pct": 100 * sums["underflow"] / n, "snr_db": snr}


def operand_stats(x: torch.Tensor, block_shape=(1, BLOCK)) -> dict[str, float]:
    """The four statistics of quantizing the 2D tensor x with ``block_shape`` (its own tensor amax)."""
    return _stats(_operand_sums(x, block_shape))


def expert_weight_stats(w: torch.Tensor, block_shape=(BLOCK, BLOCK)) -> dict[str, float]:
    """The statistics of a 3D expert weight [E, N, K] quantized as the grouped path does it, each expert
    with its own tensor scale: amax the largest, block shares and SNR over all experts' blocks, plus
    ``snr_db_worst_expert`` (the lowest per-expert SNR)."""
    per = [_operand_sums(w[e], block_shape) for e in range(w.shape[0])]
    total = {k: (max if k == "amax" else sum)(p[k] for p in per) for k in per[0]}
    return {**_stats(total), "snr_db_worst_expert": min(_stats(p)["snr_db"] for p in per)}


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
            if x.dim() == 3:  # routed-expert weights [E, N, K]: one tensor scale per expert
                stats = expert_weight_stats(x, block_shape)
            else:
                stats = operand_stats(x.reshape(-1, x.shape[-1]), block_shape)
            for stat, value in stats.items():
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
    if t is None or not t.active or type(weight) not in (torch.Tensor, torch.nn.Parameter) or \
            getattr(module, "local_tp", None) is not None:
        return  # sharded (DTensor or plain local TP shards) and FSDP-NVFP4-gathered weights are not measured
    name = getattr(module, "layer_name", "") or type(module).__name__
    t.record(name, "weight", weight, (BLOCK, BLOCK) if module.recipe.weight_2d else (1, BLOCK))
    t.record(name, "input", x)
    if y.requires_grad:
        y.register_hook(lambda dy: t.record(name, "grad_output", dy))


def measure_experts(module, gemm: str, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    """Record one grouped GEMM of a converted expert module (``gemm``: its weight's name): the 3D weight
    per expert, the routed tokens X and, through a hook on y, dY, under nvfp4/<experts>/<gemm>/."""
    t: Telemetry | None = getattr(module, "telemetry", None)
    if t is None or not t.active or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return  # (expert-parallel shards arrive as local tensors: each rank measures its own experts)
    name = f"{getattr(module, 'layer_name', '') or type(module).__name__}/{gemm}"
    t.record(name, "weight", weight, (BLOCK, BLOCK) if module.recipe.weight_2d else (1, BLOCK))
    t.record(name, "input", x)
    if y.requires_grad:
        y.register_hook(lambda dy: t.record(name, "grad_output", dy))


__all__ = ["Telemetry", "drain_all", "expert_weight_stats", "measure_experts", "measure_linear", "operand_stats"]
