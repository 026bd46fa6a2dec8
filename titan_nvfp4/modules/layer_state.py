"""Per-layer NVFP4 state shared by NVFP4Linear and the NVFP4 expert modules: the stochastic-rounding
counter(s) and the RHT signs, as non-persistent buffers rebuilt from the recipe when a meta-device
module is materialized (TorchTitan's to_empty) or moved to another device, and the precision schedule
that switches the module to high precision late in training (schedule.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.tensor_parallel import local
from ..autograd.linear_function import cached_rht_signs, sr_counter
from ..numerics.rht import rht_signs
from ..recipe.nvfp4_recipe import NVFP4Recipe


#: per-layer state kept in fp32 whatever the model's dtype: amax windows (amax_history.py), OutControl's sums
_FP32_STATE = ("x_amax_history", "x_amax_pending", "outcontrol_norms", "outcontrol_step")


class NVFP4LayerState(nn.Module):
    """Mixin for modules whose GEMMs run in NVFP4. ``n_gemms=None``: one GEMM, counter [2];
    else counter [n_gemms, 2], row j the stream of layer id ``layer_id + j`` (or ``stream_ids[j]``)."""

    def _init_nvfp4(self, recipe: NVFP4Recipe, layer_id: int, device: torch.device,
                    n_gemms: int | None = None, stream_ids: tuple[int, ...] | None = None) -> None:
        """``stream_ids``: the layer id of each GEMM's SR stream (default layer_id + j)."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"{getattr(self, 'layer_name', '') or type(self).__name__}: layer_id must be a non-negative "
                             f"integer (it seeds the layer's stochastic-rounding streams), got {layer_id!r}")
        self.recipe, self.layer_id, self._n_gemms = recipe, layer_id, n_gemms
        self._stream_ids = stream_ids or tuple(layer_id + j for j in range(n_gemms or 1))
        shape = (2,) if n_gemms is None else (n_gemms, 2)
        self.register_buffer("sr_counter", torch.empty(shape, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("rht_signs", torch.empty(16, device=device) if recipe.rht else None, persistent=False)
        self._reset_nvfp4_buffers()

    def _fresh_counter(self) -> torch.Tensor:
        """The SR counter(s) at call 0 of each stream, on the CPU (distinct per rank)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self._n_gemms is None:
            return sr_counter(self.recipe, self.layer_id, rank=rank)
        return torch.stack([sr_counter(self.recipe, i, rank=rank) for i in self._stream_ids])

    def _reset_nvfp4_buffers(self) -> None:
        """Fill the SR counter(s) (call 0 of each stream, distinct per rank) and the RHT signs (the same
        on every rank; plain ones shared by all layers: _share_signs); nothing on meta. Under tensor
        parallelism the buffers are replicated DTensors: each rank fills its local copy."""
        if self.sr_counter.is_meta:
            return
        with torch.no_grad():
            local(self.sr_counter).copy_(self._fresh_counter())
            if self.rht_signs is not None and not self._share_signs():
                local(self.rht_signs).copy_(rht_signs(self.recipe.rht_seed))
            for name in ("x_amax_history", "x_amax_pending"):  # amax_history.py, when the layer keeps one
                if self._buffers.get(name) is not None:
                    local(self._buffers[name]).zero_()
            if self.amax_history is not None:  # emptied windows: X's own amax until the next step fills them
                self.amax_history.ready = False

    def _apply(self, fn, recurse: bool = True):
        # to_empty() of a meta module (TorchTitan's materialization) leaves the buffers uninitialized, and so does
        # to_empty() onto another device: refill them then. A move (.to, .cuda) copies them: the SR call counts and
        # amax windows stay, which the streams' bases, copied alike, tell apart from uninitialized memory.
        before = self.sr_counter.device
        fp32 = {n: b for n in _FP32_STATE if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, old in fp32.items():  # a dtype cast (model.to(torch.bfloat16)) keeps this state in fp32
            new = self._buffers[name]
            if new.dtype != old.dtype and new.is_meta == old.is_meta:
                self._buffers[name] = old.to(device=new.device)
        moved = self.sr_counter.device != before
        if before.type == "meta" or (moved and not self._counter_copied()):
            self._reset_nvfp4_buffers()
        else:
            self._share_signs()  # a dtype cast or a move copied the signs into this layer's own tensor
        return self

    def _counter_copied(self) -> bool:
        """Whether the SR counter holds this layer's stream bases (a copy), not uninitialized memory."""
        if self.sr_counter.is_meta:
            return False
        counter = local(self.sr_counter).cpu()
        return torch.equal(counter[..., 0], self._fresh_counter()[..., 0]) and bool((counter[..., 1] >= 0).all())

    def _share_signs(self) -> bool:
        """Point a plain (not distributed, not meta) ``rht_signs`` buffer at the one tensor of its seed and
        device that every layer holds; whether it did. Sibling layers on one X (wq, wk, wv; w1, w3) then
        pass the same tensor to the same X quantization, which torch.compile computes once (AOTAutograd's
        CSE): the siblings' X amax, quantization and saved codes, where each had its own before."""
        signs = self._buffers.get("rht_signs")
        if type(signs) is not torch.Tensor or signs.is_meta:
            return False
        self._buffers["rht_signs"] = cached_rht_signs(self.recipe.rht_seed, signs.device)
        return True

    #: shared with the converter's StepCounter (schedule.py); None: always NVFP4
    precision_schedule = None
    #: telemetry.Telemetry shared by the converter's layers (telemetry_every); None: off
    telemetry = None
    #: amax_history.AmaxHistory shared by the converter's layers (activation_amax_history); None: off
    amax_history = None
    #: osci_reset.OsciReset shared by the converter's layers (osci_reset_every); None: off
    osci_reset = None

    @property
    def high_precision(self) -> bool:
        """Whether all the GEMMs, forward and backward, run in the input's dtype instead of NVFP4 now
        (``bf16_after_fraction``, with ``bf16_after_scope`` "forward_backward")."""
        s = self.precision_schedule
        return s is not None and s.high_precision

    @property
    def high_precision_forward(self) -> bool:
        """Whether the forward GEMMs run in the input's dtype now (after the ``bf16_after_fraction`` switch, of
        either ``bf16_after_scope``); with scope "forward" dgrad and wgrad stay NVFP4."""
        s = self.precision_schedule
        return s is not None and s.high_precision_forward

    @property
    def sr_calls(self) -> int:
        """Backward calls that drew stochastic-rounding numbers so far (most of any of the GEMMs)."""
        return int(local(self.sr_counter)[..., 1].max())
