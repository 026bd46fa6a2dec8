"""A backward GEMM operand quantized by MS-EDEN with Philox streams: the reference twin of the kernels in
kernels/ms_eden.py, which draw the same signs and uniforms from the same seeds (numerics/philox.py).

For ``values`` [R, C] (blocks of 16 along C, the GEMM's contraction dim): x = values·pre_scale in fp32
(pre_scale given: the operand is a forward quantization's q·e_b times its decode scale), C zero-padded to a
multiple of ``size``, the RHT of ``size`` with signs philox_signs(sign_seed, size), then quantize_ms_eden
with correction groups of ``size`` and the draw of block (r, j) = uniform24(philox_bits(draw_seed,
r·(Cpad/16) + j)). Two operands rotated with the same sign_seed multiply to the product of the originals.
"""

from __future__ import annotations

import torch

from .ms_eden import quantize_ms_eden
from .nvfp4 import BLOCK, NVFP4Tensor
from .philox import philox_bits, philox_signs, uniform24
from .rht import rht

#: the Hadamard sizes (and correction groups) the operand quantizer and its kernels take
MS_EDEN_SIZES = (16, 32, 64, 128)


def check_operand_args(values: torch.Tensor, size: int, pre_scale: torch.Tensor | None, where: str) -> None:
    """One-line errors for what the operand quantizer cannot take."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.dim() != 2:
        got = f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"{where}: values must be a 2D floating-point tensor, got {got}")
    if isinstance(size, bool) or size not in MS_EDEN_SIZES:
        raise ValueError(f"{where}: size must be one of {MS_EDEN_SIZES}, got {size!r}")
    if pre_scale is not None and (not isinstance(pre_scale, torch.Tensor) or pre_scale.dtype != torch.float32
                                  or pre_scale.numel() != 1):
        got = f"{pre_scale.dtype} {tuple(pre_scale.shape)}" if isinstance(pre_scale, torch.Tensor) else pre_scale
        raise ValueError(f"{where}: pre_scale must be an fp32 tensor of one element, got {got}")


def padded_cols(cols: int, size: int) -> int:
    """C rounded up to a multiple of ``size``."""
    return cols + (-cols) % size


def rotated_operand(values: torch.Tensor, size: int, sign_seed: torch.Tensor | int,
                    pre_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [R, Cpad]: rht(pad(values·pre_scale), philox_signs(sign_seed, size))."""
    x = values.float()
    if pre_scale is not None:
        x = x * pre_scale.to(x.device).reshape(())
    pad = (-x.shape[1]) % size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return rht(x, philox_signs(sign_seed, size, device=x.device))


def block_uniforms(draw_seed: torch.Tensor | int, rows: int, blocks: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, blocks]: the scale draw of block (r, j), uniform24(philox_bits(draw_seed, r·blocks + j))."""
    idx = torch.arange(rows * blocks, dtype=torch.int64, device=device).view(rows, blocks)
    return uniform24(philox_bits(draw_seed, idx))


def ms_eden_operand_amax(values: torch.Tensor, *, size: int, sign_seed: torch.Tensor | int,
                         pre_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 0-d max|rotated operand| (0 when empty; non-finite values give +inf): the amax ms_eden_operand
    would use, for a caller that all-reduces it across ranks first."""
    check_operand_args(values, size, pre_scale, "ms_eden_operand_amax")
    v = rotated_operand(values, size, sign_seed, pre_scale)
    a = v.abs().amax() if v.numel() else torch.zeros((), device=v.device)
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))


def ms_eden_operand(values: torch.Tensor, *, size: int, sign_seed: torch.Tensor | int,
                    draw_seed: torch.Tensor | int, pre_scale: torch.Tensor | None = None,
                    amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """NVFP4Tensor [R, Cpad] (1×16 blocks, global_scale = s) of the rotated, padded operand (module docstring).
    ``amax``: the rotated operand's amax to use (e.g. all-reduced), else its own."""
    check_operand_args(values, size, pre_scale, "ms_eden_operand")
    v = rotated_operand(values, size, sign_seed, pre_scale)
    rows, cols = v.shape
    u = block_uniforms(draw_seed, rows, cols // BLOCK, v.device)
    a = None if amax is None else amax.to(v.device, torch.float32).reshape(())
    return quantize_ms_eden(v, None, group=size, amax=a, uniforms=u)


__all__ = ["MS_EDEN_SIZES", "block_uniforms", "check_operand_args", "ms_eden_operand", "ms_eden_operand_amax",
           "padded_cols", "rotated_operand"]
