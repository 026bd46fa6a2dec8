"""A loaded TorchTitan model's weights under Hugging Face names: dense (BF16) or with compressed-tensors NVFP4
Linears.

Names (and the q/k row permutation of Llama's RoPE layout) come from TorchTitan's own state-dict adapter. A
low-rank layer's ``weight`` entry is already W = R + U·diag(σ)·V (DecomposedLinear's state dict, computed in fp32
and stored in R's dtype); its factors and residual are dropped (export_dense.fold_decomposed). An NVFP4 layer's
codes and scales are permuted with the rows the adapter gives its weight: the permutation is read off the
adapter by converting a tensor of row indices, so any adapter that only reorders rows is followed exactly, and
one that does more is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modules.decomposed_linear import DecomposedLinear, LowRankState
from ..modules.nvfp4_linear import NVFP4Linear
from .compressed_nvfp4 import compressed_parts, decoded_weight, input_global_scale
from .export_dense import fold_decomposed, non_finite


@dataclass
class Layers:
    """The model's Linears by kind (TorchTitan names): ``nvfp4`` (NVFP4Linear, recipe kept), ``lowrank`` (their
    DecomposedLinear subset), ``plain`` (left in BF16 by the recipe: filter_fqns, BF16 blocks, the LM head), and
    ``other``: modules with low-rank state that are not Linears (MoE experts); ``split``: the NVFP4 Linears whose
    forward runs its OutControl-selected input channels in MXFP8 (outcontrol_fraction), not one NVFP4 weight."""

    nvfp4: dict[str, NVFP4Linear] = field(default_factory=dict)
    lowrank: list[str] = field(default_factory=list)
    split: list[str] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


def classify(model: nn.Module) -> Layers:
    out = Layers()
    for name, m in model.named_modules():
        if isinstance(m, NVFP4Linear):
            out.nvfp4[name] = m
            if isinstance(m, DecomposedLinear) and "lora_decomposed" in m._buffers:
                out.lowrank.append(name)
            if getattr(m, "_outcontrol_on", False):
                out.split.append(name)
        elif isinstance(m, nn.Linear):
            out.plain.append(name)
        elif isinstance(m, LowRankState) or type(m).__name__.startswith("NVFP4"):
            out.other.append(name)
    return out


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with low-rank layers folded to W; a ValueError naming weights with NaN or Inf."""
    state = fold_decomposed({k: v.detach() for k, v in model.state_dict().items()})
    bad = non_finite(state)
    if bad:
        raise ValueError(f"weights hold NaN or Inf, not exported: {', '.join(bad[:5])}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return state


def to_hf(adapter, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``adapter.to_hf(state)``; a ValueError naming a key it has no Hugging Face name for."""
    try:
        return adapter.to_hf(state)
    except KeyError as e:  # the adapter's lookup of a name pattern (layer number as {})
        key = e.args[0] if e.args else "?"
        raise ValueError(f"TorchTitan's {type(adapter).__name__} has no Hugging Face name for {key!r}") from None


def hf_row_order(adapter, key: str, shape: torch.Size) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, row permutation) the adapter gives the weight ``key`` of ``shape``: the HF weight is
    ``weight[perm]``. A ValueError when the adapter does more than reorder rows."""
    n, k = shape
    rows = torch.arange(n, dtype=torch.int32)[:, None].expand(n, k).contiguous()
    ((hf_key, out),) = to_hf(adapter, {key: rows}).items()
    perm = out[:, 0].long() if out.dim() == 2 else None
    if (perm is None or tuple(out.shape) != (n, k) or not torch.equal(out, out[:, :1].expand(n, k))
            or not torch.equal(perm.sort().values, torch.arange(n))):
        raise ValueError(f"TorchTitan's {type(adapter).__name__} does more to {key!r} than reorder its rows: its "
                         "NVFP4 blocks cannot follow")
    return hf_key, perm


def hf_name(adapter, key: str, value: torch.Tensor) -> str:
    """The Hugging Face name of the entry ``key``."""
    return next(iter(to_hf(adapter, {key: value})))


def module_name(hf_weight_key: str) -> str:
    return hf_weight_key.removesuffix(".weight")


def hf_dense(adapter, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every entry of ``state`` under its Hugging Face name, in ``dtype``."""
    return sorted_state({k: v.to(dtype).contiguous() for k, v in to_hf(adapter, state).items()})


def forward_weight_dtype(layers: Layers, fsdp: bool, mixed_precision_param: str,
                         stored: dict[str, torch.dtype]) -> tuple[torch.dtype, list[str]]:
    """(the dtype the run's forward quantized its NVFP4 weights in, the NVFP4 layers whose weight the checkpoint
    stores narrower than that): ``mixed_precision_param`` when the checkpoint was written under FSDP2 (``fsdp``: its
    forward multiplied those), else float32 (the master weights, under one GPU's autocast). ``stored``: the dtype of
    each checkpoint key. A narrower layer's forward codes cannot be rebuilt from the checkpoint."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    forward = dtypes.get(mixed_precision_param, torch.float32) if fsdp else torch.float32
    narrower = [n for n in layers.nvfp4 if stored.get(f"{n}.weight", forward).itemsize < forward.itemsize]
    return forward, narrower


@dataclass
class NVFP4Export:
    """The Hugging Face state dict of an NVFP4 export, the ignored (BF16) Linears' module names, and each
    quantized module's weight global scale (S)."""

    state: dict[str, torch.Tensor]
    ignore: list[str]
    global_scales: dict[str, float]


def state_rows(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """{state-dict key: the rows of Linear ``name``'s weight that entry holds, in its order}: the weight as the
    model's state dict hands it out, its own ``weight`` entry or split by a parent's state-dict hook (TorchTitan
    0.3's fused QKV Linear saves wq, wk and wv). Traced by putting the negated row numbers in the weight for one
    call of the parent's state_dict."""
    module = model.get_submodule(name)
    n, k = module.weight.shape
    marker = -(torch.arange(n, dtype=torch.float32) + 1)[:, None].expand(n, k).contiguous()
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    weight = module._parameters["weight"]
    module._parameters["weight"] = nn.Parameter(marker, requires_grad=False)
    try:
        entries = parent.state_dict(prefix=f"{parent_name}." if parent_name else "")
    finally:
        module._parameters["weight"] = weight
    out = {}
    for key, v in entries.items():
        if (v.dim() == 2 and v.shape[1] == k and v.dtype == torch.float32 and bool((v < 0).all())
                and torch.equal(v, v[:, :1].expand_as(v)) and torch.equal(v, v.round())):
            out[key] = (-v[:, 0] - 1).long()
    rows = torch.cat(list(out.values())) if out else torch.empty(0, dtype=torch.long)
    if not torch.equal(rows.sort().values, torch.arange(n)):
        raise ValueError(f"{name}: its weight's rows do not come out of the state dict whole (entries "
                         f"{', '.join(out) or 'none'}): its NVFP4 blocks cannot follow")
    return out


def layer_parts(name: str, module: NVFP4Linear, weight_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The compressed-tensors entries (codes, block scales, S) of NVFP4 layer ``name``: its weight quantized in
    ``weight_dtype`` as its forward quantizes it."""
    return compressed_parts(module.weight.detach().to(weight_dtype), module.recipe, name)


def forward_weights(layers: Layers, weight_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{NVFP4 layer: the fp32 weight its forward multiplies}, decoded from the entries an NVFP4 export writes
    (``layer_parts``) as the forward decodes them: a model holding these in plain Linears computes the run's forward
    with unquantized activations (w4a16)."""
    return {name: decoded_weight(layer_parts(name, m, weight_dtype)) for name, m in layers.nvfp4.items()}


def hf_nvfp4(adapter, model: nn.Module, state: dict[str, torch.Tensor], layers: Layers, weight_dtype: torch.dtype,
             dense_dtype: torch.dtype = torch.bfloat16,
             input_amax: dict[str, torch.Tensor] | None = None) -> NVFP4Export:
    """The NVFP4 layers of ``layers`` as compressed-tensors entries (their weights quantized in ``weight_dtype``, as
    the forward quantizes them; with ``input_amax`` {layer: amax}, each one's ``input_global_scale`` too: w4a4),
    everything else dense in ``dense_dtype``. A layer whose weight the state dict splits (0.3's fused QKV) becomes
    one Hugging Face module per entry, each with its rows of the codes and scales and the layer's tensor scales."""
    quantized = {}
    scales = {}
    used = set()
    for name, m in layers.nvfp4.items():
        parts = layer_parts(name, m, weight_dtype)
        for key, rows in state_rows(model, name).items():
            hf_key, perm = hf_row_order(adapter, key, torch.Size((len(rows), m.weight.shape[1])))
            r = rows[perm]
            prefix = module_name(hf_key)
            quantized[f"{prefix}.weight_packed"] = parts["weight_packed"][r].contiguous()
            quantized[f"{prefix}.weight_scale"] = parts["weight_scale"][r].contiguous()
            quantized[f"{prefix}.weight_global_scale"] = parts["weight_global_scale"].clone()  # own storage each
            if input_amax is not None:
                quantized[f"{prefix}.input_global_scale"] = input_global_scale(input_amax[name])
            scales[prefix] = float(parts["weight_global_scale"])
            used.add(key)
    rest = {k: v for k, v in state.items() if k not in used}
    dense = hf_dense(adapter, rest, dense_dtype)
    ignore = [module_name(hf_name(adapter, key, state[key])) for n in layers.plain for key in state_rows(model, n)]
    return NVFP4Export(sorted_state({**dense, **quantized}), ignore, scales)


def _natural(key: str) -> tuple:
    """Sort key putting model.layers.10 after model.layers.9."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


def sorted_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(sorted(state.items(), key=lambda kv: _natural(kv[0])))


def fused_mismatches(global_scales: dict[str, float], ignore: list[str], fused: tuple[tuple[str, ...], ...]) -> list[str]:
    """Messages for the fused groups (e.g. q/k/v_proj of one layer) vLLM and SGLang load as one GEMM whose
    members differ in weight global scale, or in being quantized at all."""
    out = []
    names = set(global_scales) | set(ignore)
    for group in fused:
        first = group[0]
        for base in sorted({n[: -len(first)] for n in names if n.endswith(first)}, key=_natural):
            members = [base + g for g in group]
            quantized = [m for m in members if m in global_scales]
            if quantized and len(quantized) < len(members):
                out.append(f"{', '.join(members)}: only {', '.join(quantized)} in NVFP4 (vLLM needs all or none)")
            elif quantized and len({global_scales[m] for m in members}) > 1:
                out.append(f"{', '.join(members)}: weight global scales "
                           f"{', '.join(f'{global_scales[m]:.6g}' for m in members)} differ")
    return out


__all__ = ["Layers", "NVFP4Export", "classify", "dense_state", "forward_weight_dtype", "forward_weights",
           "fused_mismatches", "hf_dense", "hf_name", "hf_nvfp4", "hf_row_order", "layer_parts", "module_name",
           "sorted_state", "state_rows", "to_hf"]
