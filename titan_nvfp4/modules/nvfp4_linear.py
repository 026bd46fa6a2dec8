"""NVFP4Linear: a drop-in nn.Linear whose three GEMMs run in NVFP4.

It subclasses nn.Linear and keeps its parameters (`weight`, `bias`), so state_dict keys, init_weights
code that touches `.weight`, and BF16 checkpoints all carry over unchanged. Its two extra buffers,
the stochastic-rounding counter and the RHT signs, come from NVFP4LayerState (layer_state.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .amax_history import activation_amax
from ..autograd.body_graphs import BodyGraphs, graphs_for
from ..distributed.tensor_parallel import local, local_tp_nvfp4_linear, tp_nvfp4_linear
from .layer_state import NVFP4LayerState
from ..autograd.linear_function import autocast_out_dtype, meta_linear, nvfp4_linear, x_amaxes
from ..autograd.mxfp8_linear import mxfp8_linear
from ..autograd.outcontrol_linear import outcontrol_linear
from . import outcontrol as oc
from ..ops import resolve_backend
from ..recipe.nvfp4_recipe import NVFP4Recipe
from .telemetry import measure_linear


def check_linear_dims(name: str, in_features: int, out_features: int) -> None:
    """NVFP4 blocks are 16 wide along both weight dims: reject other sizes with the layer's name."""
    for d, v in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"cannot convert Linear {name!r} to NVFP4: {d} must be a positive integer, got {v!r}")
    bad = [f"{d}={v}" for d, v in (("in_features", in_features), ("out_features", out_features)) if v % 16]
    if bad:
        raise ValueError(
            f"cannot convert Linear {name!r} to NVFP4: {', '.join(bad)} not a multiple of 16 "
            "(exclude it with filter_fqns)"
        )


def check_recipe(name: str, recipe) -> None:
    """A module's recipe must be an NVFP4Recipe (build one from a dict with NVFP4Recipe(**d), from a preset with build_recipe)."""
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"{name}: recipe must be an NVFP4Recipe (NVFP4Recipe(...) or titan_nvfp4.build_recipe(preset, "
                        f"overrides)), got {type(recipe).__name__}")


class NVFP4Linear(NVFP4LayerState, nn.Linear):
    """nn.Linear computing Y = X Wᵀ + b with the NVFP4 recipe in forward and backward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: NVFP4Recipe | None = None, layer_id: int = 0, name: str = "",
                 device=None, dtype=None) -> None:
        check_linear_dims(name or "NVFP4Linear", in_features, out_features)
        recipe = NVFP4Recipe() if recipe is None else recipe
        check_recipe(name or type(self).__name__, recipe)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"{name or type(self).__name__}: dtype must be a floating-point torch.dtype, got {dtype!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.layer_name = name
        self._init_nvfp4(recipe, layer_id, self.weight.device)
        if recipe.outcontrol_fraction:
            oc.register_outcontrol(self, self.weight.device)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: NVFP4Recipe, layer_id: int = 0, name: str = "") -> "NVFP4Linear":
        """Swap in for ``mod`` reusing its Parameter objects (no allocation, works on meta)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear({name!r}): needs an nn.Linear, got {type(mod).__name__}")
        check_linear_dims(name, mod.in_features, mod.out_features)
        check_recipe(name or cls.__name__, recipe)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight = mod.weight
        new.bias = mod.bias
        new.layer_name = name
        new._init_nvfp4(recipe, layer_id, mod.weight.device)
        if recipe.outcontrol_fraction:
            oc.register_outcontrol(new, mod.weight.device)
        return new

    def label(self) -> str:
        """The layer's name for messages. Read only where one is raised: under torch.compile, reading the
        name in forward would guard on it and recompile the block once per layer."""
        return getattr(self, "layer_name", "") or type(self).__name__

    #: (sharded weight dim, process group) when a framework hands this layer plain local shards of a
    #: tensor-parallel weight and its input (TorchTitan 0.3's spmd_types backend sets it at parallelize);
    #: None: the weight is whole, or a DTensor that says so itself
    local_tp: tuple[int, object] | None = None

    #: outcontrol.OutControlWindow shared by the converter's layers (outcontrol_fraction); None: never records
    outcontrol = None
    #: whether OutControl's channels are selected (the Python twin of the ``outcontrol_done`` buffer)
    _outcontrol_on = False

    def _check_input(self, x) -> None:
        """x must be a tensor of at least 1 dim whose last dim is in_features (its local shard's under
        ``local_tp``): else name the layer."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.label()}: input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{self.label()}: input must be a floating-point tensor, got {x.dtype}")
        if self.weight.is_meta and not x.is_meta:
            raise RuntimeError(f"{self.label()}: the layer is on the meta device (not materialized: to_empty() and "
                               f"initialize it first), its input on {x.device}")
        features = self.in_features if self.local_tp is None else self.weight.shape[-1]
        if x.dim() == 0 or x.shape[-1] != features:
            raise RuntimeError(f"{self.label()}: input of shape {tuple(x.shape)} has "
                               f"{x.shape[-1] if x.dim() else 0} features, the layer takes {features}"
                               f"{' (local shard)' if features != self.in_features else ''} of in_features="
                               f"{self.in_features}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.is_meta:  # shape inference
            return meta_linear(x, self.weight, self.bias)
        if self.high_precision:
            return F.linear(x, self.weight, self.bias)
        if self._outcontrol_on:
            y = self._outcontrol_linear(x)
        else:
            if self.outcontrol is not None and self.outcontrol.recording and self.training and torch.is_grad_enabled():
                oc.check_supported(self, self.weight)
                oc.record(self, x)
            y = self._nvfp4_linear(x, self.weight, self.bias)
        if self.telemetry is not None:
            measure_linear(self, x, self.weight, y)
        return y

    def _nvfp4_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      gemm: int | None = None) -> torch.Tensor:
        """x·weightᵀ + bias in NVFP4 with this layer's recipe, RHT signs and SR stream (row ``gemm`` of
        the counter when the layer has several). A DTensor weight (tensor parallelism) runs on the
        local shards with cross-rank amaxes: distributed/tensor_parallel.py; so do plain local shards under
        ``local_tp``."""
        counter, signs = local(self.sr_counter), local(self.rht_signs)
        if gemm is not None:
            counter = counter[gemm]
        history = self.amax_history is not None and gemm in (None, 0)  # the main GEMM's X only
        if not isinstance(weight, DTensor) and self.local_tp is None:
            x_amax = self._history_amax(x, weight) if history else None
            return nvfp4_linear(x, weight, bias, self.recipe, counter, signs, x_amax=x_amax,
                                graphs=self._body_graphs(x, weight, gemm),
                                high_precision_forward=self.high_precision_forward)

        def on_shards(x_local, w_local, b_local, groups):
            x_amax = self._history_amax(x_local, w_local) if history else None
            return nvfp4_linear(x_local, w_local, b_local, self.recipe, counter, signs, groups, x_amax,
                                high_precision_forward=self.high_precision_forward)

        if not isinstance(weight, DTensor):
            return local_tp_nvfp4_linear(on_shards, x, weight, bias, *self.local_tp, self.label)
        return tp_nvfp4_linear(on_shards, x, weight, bias, self.label)

    def _outcontrol_linear(self, x: torch.Tensor) -> torch.Tensor:
        """OutControl after its selection (modules/outcontrol.py, autograd/outcontrol_linear.py): the selected input
        channels in MXFP8, the rest in NVFP4 with the layer's recipe, SR stream, RHT signs, amax history and bias;
        dgrad over every channel."""
        oc.check_supported(self, self.weight)
        sel, rest = local(self.outcontrol_index), local(self.outcontrol_rest)
        if not rest.numel():  # every channel selected: the MXFP8 linear alone
            y = mxfp8_linear(x, self.weight, self.recipe.gemm_backend, high_precision_forward=self.high_precision_forward)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        x_amax = None
        if self.amax_history is not None:  # the history of the rest columns' amaxes, which quantize with them
            x_amax = self._history_amax(x.index_select(-1, rest), self.weight.index_select(-1, rest))
        return outcontrol_linear(x, self.weight, self.bias, self.recipe, local(self.sr_counter), local(self.rht_signs),
                                 sel, rest, x_amax=x_amax, high_precision_forward=self.high_precision_forward)

    def _apply(self, fn, recurse: bool = True):
        # to_empty() of a meta module leaves OutControl's buffers uninitialized: the layer starts unselected
        flag = self._buffers.get("outcontrol_done")
        was_meta = flag is not None and flag.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.outcontrol_done.is_meta:
            oc.reset_outcontrol(self)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state dict without OutControl's selection (BF16 or HF weights, a run without the knob) leaves the layer
        as it is (unselected unless it selected since); one with it sets the selection."""
        if not oc.has_outcontrol(self):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        own = [prefix + n for n in ("outcontrol_index", "outcontrol_done")]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not any(k in state_dict for k in own):
            missing_keys[:] = [k for k in missing_keys if k not in own]
        elif not self.outcontrol_done.is_meta and not error_msgs:
            oc.adopt_selection(self)

    def _body_graphs(self, x: torch.Tensor, weight: torch.Tensor, gemm: int | None) -> BodyGraphs | None:
        """The BodyGraphs of GEMM ``gemm`` of this layer when ``eager_graphs`` graphs this call (body_graphs.py)."""
        return graphs_for(self, gemm, x, weight.shape[1], weight.shape[0], self.recipe.eager_graphs)

    def _history_amax(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """X's amaxes from the layer's amax history (amax_history.py), recording this forward's."""
        need_wgrad = torch.is_grad_enabled() and weight.requires_grad  # as nvfp4_linear decides it
        backend = resolve_backend(self.recipe.gemm_backend, x.device)
        current = x_amaxes(x, autocast_out_dtype(x), local(self.rht_signs), self.recipe, backend, need_wgrad)
        return activation_amax(self, current)

    def extra_repr(self) -> str:
        r = self.recipe
        if self.high_precision:
            return f"{super().extra_repr()}, high precision (bf16_after_fraction)"
        forward = ", forward in high precision (bf16_after_scope)" if self.high_precision_forward else ""
        history = f", amax_history={self.amax_history.length}" if self.amax_history is not None else ""
        if oc.has_outcontrol(self):
            k = self.outcontrol_index.shape[0]
            history += f", outcontrol={k} channels in MXFP8{'' if self._outcontrol_on else ' (not selected yet)'}"
        return (f"{super().extra_repr()}, nvfp4(weight_2d={r.weight_2d}, sr={r.stochastic_rounding}, "
                f"rht={r.rht}, backend={r.gemm_backend}{history}){forward}")
