"""A trained NVFP4 weight in compressed-tensors' ``nvfp4-pack-quantized`` layout, the one vLLM and SGLang read.

Per quantized Linear the layout holds (compressed-tensors 0.20: compressors/nvfp4, quantization/lifecycle):

    weight_packed        uint8 [N, K/2]   E2M1 codes (sign in bit 3), element 2i in the low nibble, 2i+1 in the high
    weight_scale         float8_e4m3fn [N, K/16]   one scale per 1×16 block along K
    weight_global_scale  float32 [1]      the ENCODE scale S = 6·448/amax (its generate_gparam's formula); a weight
                                          decodes as q · weight_scale / weight_global_scale

Our codes, block scales and S are those the forward computes with from this checkpoint on: ops.quantize_weight
(the reference backend, bit-identical to the GPU ones) on the weight in the forward's dtype, with the layer's
recipe (weight_2d: one E4M3 scale per 16×16 tile; block_scale_rule). Our layout is already theirs (same code
table, nibble order and row-major [N, K] storage); a 16×16 tile's scale is repeated for each of its 16 rows,
which is exact: every 1×16 block of the tile decodes with the same scale. Our forward decodes with the fp32
reciprocal 1/S, compressed-tensors divides by S: the products q·e_b are exact in both, the last step rounds
apart in fp32 (at most two ulps), and in BF16, the dtype its decompressor returns, they agree but for rare S
(docs/export.md).
"""

from __future__ import annotations

import torch

from ..numerics.nvfp4 import BLOCK, NVFP4Tensor, global_encode_scale
from ..ops.quantize import quantize_weight
from ..recipe.nvfp4_recipe import NVFP4Recipe

#: compressed-tensors' format name (config.json quantization_config.format)
FORMAT = "nvfp4-pack-quantized"
#: the suffixes of a quantized Linear's entries, after its module name
PARTS = ("weight_packed", "weight_scale", "weight_global_scale")


def forward_nvfp4_weight(weight: torch.Tensor, recipe: NVFP4Recipe) -> NVFP4Tensor:
    """The NVFP4 weight a layer with ``recipe`` multiplies in its forward GEMM, quantized from ``weight`` (already in
    the forward's dtype): blocks along K, 16×16 tiles under weight_2d."""
    with torch.no_grad():
        wq, _ = quantize_weight(weight.detach(), recipe.weight_2d, "reference", None,
                                four_over_six=recipe.four_over_six)
    return wq


def encode_scale(weight: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """S, the fp32 tensor encode scale the quantizer derived from max|weight| (a 0-d tensor)."""
    return global_encode_scale(weight.detach().float().abs().amax(), recipe.four_over_six)


def compressed_parts(weight: torch.Tensor, recipe: NVFP4Recipe, name: str = "weight") -> dict[str, torch.Tensor]:
    """{weight_packed, weight_scale, weight_global_scale} of ``weight`` [N, K] (in the forward's dtype) as the
    forward quantizes it; ``name`` (the layer) for errors."""
    if weight.dim() != 2 or weight.shape[0] % BLOCK or weight.shape[1] % BLOCK:
        raise ValueError(f"{name}: NVFP4 export needs a 2-D weight with both dims multiples of 16, got "
                         f"{tuple(weight.shape)}")
    wq = forward_nvfp4_weight(weight, recipe)
    if wq.transposed or tuple(wq.storage_shape) != tuple(weight.shape):
        raise ValueError(f"{name}: the forward's NVFP4 weight is not stored as [N, K] rows (block shape "
                         f"{wq.block_shape})")
    s = encode_scale(weight, recipe)
    if not bool(torch.isfinite(s)):
        raise ValueError(f"{name}: weight holds NaN or Inf: not exported")
    if not torch.equal(torch.reciprocal(s), wq.global_scale):  # the quantizer's own 1/S: S must be the one it used
        raise ValueError(f"{name}: the tensor scale {float(s)!r} does not give the forward's decode scale "
                         f"{float(wq.global_scale)!r}")
    return {
        "weight_packed": wq.data.contiguous(),
        "weight_scale": wq.row_scales().contiguous(),
        "weight_global_scale": s.reshape(1).to(torch.float32),
    }


def decoded_weight(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight [N, K] ``compressed_parts``' entries hold, decoded as our forward decodes it: q · e_b · (1/S),
    the weight its GEMM multiplies (compressed-tensors divides by S instead: the module docstring)."""
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    wq = NVFP4Tensor(data=packed, scale=scale, global_scale=torch.reciprocal(parts["weight_global_scale"].reshape(())),
                     shape=torch.Size((packed.shape[0], packed.shape[1] * 2)), block_shape=(1, BLOCK))
    return wq.dequantize(torch.float32)


def weight_args() -> dict:
    """The ``weights`` quantization args of compressed-tensors' NVFP4A16 scheme, as its config.json spells them."""
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "observer": None, "observer_kwargs": {},
            "actorder": None, "block_structure": None}


def input_args() -> dict:
    """The ``input_activations`` quantization args of compressed-tensors' NVFP4 scheme (w4a4): 1×16 E4M3 block
    scales computed per input on the fly (dynamic "local"), under the static tensor scale ``input_global_scale``."""
    return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn", "observer": "static_minmax",
            "observer_kwargs": {}, "actorder": None, "block_structure": None}


def input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``input_global_scale`` fp32 [1] for an input amax: S = 6·448/amax, the encode scale our forward quantizes X
    with under that amax (numerics.nvfp4.global_encode_scale; the same convention as weight_global_scale)."""
    return global_encode_scale(amax.float()).reshape(1).to(torch.float32)


def quantization_config(ignore: list[str], activations: bool = False) -> dict:
    """config.json's ``quantization_config``: one group of NVFP4 weights, with 16-bit activations (w4a16) or, with
    ``activations``, NVFP4 input activations (w4a4), on every Linear but those in ``ignore`` (Hugging Face module
    names of the layers kept in BF16)."""
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args(),
                                      "input_activations": input_args() if activations else None,
                                      "output_activations": None, "format": FORMAT}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


__all__ = ["FORMAT", "PARTS", "compressed_parts", "decoded_weight", "encode_scale", "forward_nvfp4_weight",
           "input_args", "input_global_scale", "quantization_config", "weight_args"]
