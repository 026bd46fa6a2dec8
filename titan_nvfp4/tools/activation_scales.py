"""The activation amax each NVFP4 Linear's input is quantized with, for compressed-tensors' NVFP4 (w4a4) scheme.

compressed-tensors (and vLLM, SGLang) quantize a Linear's input with one static tensor encode scale per layer,
``input_global_scale`` = S = 6·448/amax, and block scales computed on the fly. Two sources of that amax:

* the run's amax history (``activation_amax_history = N``): the windows TorchTitan's train_state carries
  (``train_state.nvfp4_amax_history.<layer>``, fp32 [N, 2], column 0 the forward operand's row amax); the
  amax is the window's max, the one the forward quantizes X with from this checkpoint on;
* a calibration pass: the job's model (loaded with the checkpoint) runs its NVFP4 forward, without grad, over
  the first N batches of the job's own dataloader; each layer's amax is the largest |X| it saw (X in the dtype
  the forward quantizes it in).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..autograd.linear_function import autocast_out_dtype
from ..training.train_state import HISTORY_KEY

#: TorchTitan's CheckpointManager saves the Trainer's state under this key
TRAIN_STATE = "train_state"


def history_keys(layers: Iterable[str]) -> dict[str, str]:
    """{layer: the DCP key of its activation amax window}."""
    return {name: f"{TRAIN_STATE}.{HISTORY_KEY}.{name}" for name in layers}


def history_amaxes(folder: Path, layers: list[str]) -> dict[str, torch.Tensor] | None:
    """{layer: fp32 0-d amax} from the amax windows of the DCP checkpoint ``folder``; None when it has none. A
    ValueError when it has windows for some of ``layers`` only, or an empty window (no step recorded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    keys = history_keys(layers)
    present = {n: k for n, k in keys.items() if k in saved}
    if not present:
        return None
    missing = [n for n in layers if n not in present]
    if missing:
        raise ValueError(f"checkpoint {folder} has activation amax windows for {len(present)} of the "
                         f"{len(layers)} NVFP4 layers (none for {missing[0]!r}): was it written by another job file?")
    state = {k: torch.empty(tuple(saved[k].size), dtype=torch.float32) for k in present.values()}
    dcp.load(state, checkpoint_id=str(folder))
    out = {}
    for name, key in present.items():
        amax = state[key][:, 0].amax()
        if not bool(amax > 0) or not bool(torch.isfinite(amax)):
            raise ValueError(f"checkpoint {folder}: the activation amax window of {name!r} holds no step ({key}): "
                             "calibrate instead (--calibration-batches N)")
        out[name] = amax
    return out


def calibrated_amaxes(model: nn.Module, layers: dict[str, nn.Module], batches: Iterable[torch.Tensor]) -> \
        dict[str, torch.Tensor]:
    """{layer: fp32 0-d amax}: the largest |X| each of ``layers`` saw in the forward of ``model`` over ``batches``
    (token ids), without grad, X in the dtype the layer's forward quantizes it in."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach()
            a = x.to(autocast_out_dtype(x)).abs().amax().float()
            seen[name] = torch.maximum(seen[name], a) if name in seen else a
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    count = 0
    try:
        with torch.no_grad():
            for tokens in batches:
                model(tokens)
                count += 1
    finally:
        for h in handles:
            h.remove()
    unseen = [n for n in layers if n not in seen]
    if count and unseen:
        raise ValueError(f"calibration: layer {unseen[0]!r} saw no input in {count} batches")
    bad = [n for n, a in seen.items() if not bool(torch.isfinite(a)) or not bool(a > 0)]
    if bad:
        raise ValueError(f"calibration: the input of {bad[0]!r} has amax {float(seen[bad[0]])}: no tensor scale")
    return seen


__all__ = ["TRAIN_STATE", "calibrated_amaxes", "history_amaxes", "history_keys"]
