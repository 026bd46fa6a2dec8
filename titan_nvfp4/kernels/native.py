"""Native NVFP4 GEMM on Blackwell (sm_100+) FP4 tensor cores through PyTorch's scaled matmul.

UNTESTED ON HARDWARE: no Blackwell GPU has been available to this project. The data layouts are
tested on the CPU (tests/test_kernels.py): packed codes viewed as torch.float4_e2m1fn_x2 (element 2i
in the low nibble, as the reference packs them), E4M3 block scales rearranged into cuBLAS's
128×4-tile layout (SWIZZLE_32_4_4), and the two fp32 global decode scales passed as TensorWise
scales so they are applied to the fp32 accumulator, as in the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import check_bias


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[rows, cols] block scales -> flat cuBLAS block-scaling layout: the matrix zero-padded to
    (128·⌈rows/128⌉, 4·⌈cols/4⌉), cut into 128×4 tiles stored tile-row-major, and inside a tile the
    element (r, c) at offset (r mod 32)·16 + (r div 32)·4 + c."""
    rows, cols = scale.shape
    pr, pc = _ceil(rows, 128) * 128, _ceil(cols, 4) * 4
    padded = torch.zeros((pr, pc), dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    # (tile_r, r_hi 4, r_lo 32, tile_c, c 4) -> (tile_r, tile_c, r_lo, r_hi, c)
    t = padded.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return t.reshape(-1).view(scale.dtype)


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales."""
    pr, pc = _ceil(rows, 128) * 128, _ceil(cols, 4) * 4
    t = flat.view(torch.uint8).view(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return t.reshape(pr, pc)[:rows, :cols].view(flat.dtype)


def native_operands(a: NVFP4Tensor, b: NVFP4Tensor):
    """The arguments of F.scaled_mm for out = A · Bᵀ (shared by the GEMM and its CPU layout test)."""
    fp4 = torch.float4_e2m1fn_x2
    mat_a = a.data.view(fp4)  # [M, K/2], K contiguous
    mat_b = b.data.view(fp4).t()  # [K/2, N], column-major as cuBLAS wants B
    sa = swizzle_scales(a.row_scales().contiguous())
    sb = swizzle_scales(b.row_scales().contiguous())
    return mat_a, mat_b, [sa, a.global_scale.reshape(1).float()], [sb, b.global_scale.reshape(1).float()]


def nvfp4_gemm_native(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = (A · Bᵀ)·gs_A·gs_B [+ bias] on FP4 tensor cores. Untested on hardware."""
    from torch.nn.functional import ScalingType, SwizzleType

    check_bias(bias, b.storage_shape[0], a.data.device)
    mat_a, mat_b, scale_a, scale_b = native_operands(a, b)
    recipe = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
    swizzle = [SwizzleType.SWIZZLE_32_4_4, SwizzleType.NO_SWIZZLE]
    out = F.scaled_mm(mat_a, mat_b, scale_a, recipe, scale_b, recipe, swizzle_a=swizzle, swizzle_b=swizzle,
                      output_dtype=torch.float32 if bias is not None else out_dtype)
    if bias is not None:  # bias in fp32 after the global scales, one rounding, as the reference does
        out = (out + bias.float()).to(out_dtype)
    return out
