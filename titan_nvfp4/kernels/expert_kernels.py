"""Which of this package's Triton kernel specializations only NVFP4 grouped-expert layers launch: the background
precompile (precompile.py) leaves them out for a model whose routed experts are not NVFP4. The launch sites decide:
the grouped GEMMs, the experts' SwiGLU, the block-to-expert map and the stacked experts' fused weight quantization
run only on the experts' path (ops/grouped.py), and the quantization kernels with a GROUPED flag set it only there
(per-expert amaxes). tests/test_precompile.py runs a dense and a grouped layer and checks each launch against this.
"""

from __future__ import annotations

_K = "titan_nvfp4.kernels."

#: kernels only the grouped experts launch ("module:name")
EXPERTS_ONLY = frozenset({
    _K + "expert_map:_block_experts_kernel",
    _K + "grouped_gemm:_grouped_rows_kernel",
    _K + "grouped_gemm:_grouped_rows_persistent_kernel",
    _K + "grouped_gemm:_grouped_tokens_kernel",
    _K + "quantize:_quantize_2d_fused_kernel",
    _K + "swiglu:_swiglu_fwd_kernel",
    _K + "swiglu:_swiglu_bwd_kernel",
})
#: kernels both paths launch, with GROUPED=True only for experts
GROUPED_FLAG = frozenset({
    _K + "quantize:_amax_kernel",
    _K + "quantize:_quantize_kernel",
    _K + "quantize:_quantize_2d_kernel",
})
#: kernels dense layers launch (the experts' path stages its operands with _dequant_kernel too)
DENSE = frozenset({
    _K + "gemm:_nvfp4_gemm_kernel",
    _K + "gemm:_nvfp4_gemm_persistent_kernel",
    _K + "gemm:_dequant_kernel",
    _K + "ms_eden:_amax_kernel",
    _K + "ms_eden:_quantize_kernel",
    _K + "mxfp8:_mxfp8_kernel",
    _K + "mxfp8:_mxfp8_cols_kernel",
    _K + "mxfp8_addmm:_mxfp8_addmm_kernel",
    _K + "shard_encode:_tile_amax_kernel",
    _K + "shard_encode:_tile_scales_kernel",
    _K + "shard_encode:_encode_rows_kernel",
})


def experts_only(kernel: str, constants: dict) -> bool | None:
    """Whether kernel ``kernel`` ("module:name") specialized with the constexpr values ``constants`` (by parameter
    name) is launched only by NVFP4 grouped-expert layers; None where this is not known (a kernel not listed here, a
    flagged one without its flag): such a specialization is always precompiled."""
    if kernel in EXPERTS_ONLY:
        return True
    if kernel in GROUPED_FLAG:
        flag = constants.get("GROUPED")
        return flag if isinstance(flag, bool) else None
    if kernel in DENSE:
        return False
    return None


__all__ = ["DENSE", "EXPERTS_ONLY", "GROUPED_FLAG", "experts_only"]
