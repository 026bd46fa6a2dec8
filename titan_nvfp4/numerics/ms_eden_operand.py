"""A backward GEMM operand quantized by MS-EDEN with Philox streams: the reference twin of the kernels in
kernels/ms_eden.py, which draw the same signs and uniforms from the same seeds (numerics/philox.py).

For ``values`` [R, C] (blocks of 16 along C, the GEMM's contraction dim): x = values·pre_scale in fp32
(pre_scale given: the operand is a forward quantization's q·e_b times its decode scale), C zero-padded to a
multiple of ``size``, the RHT of ``size`` with signs philox_signs(sign_seed, size), then quantize_ms_eden
with correction groups of ``size`` and the draw of block (r, j) = uniform24(philox_bits(draw_seed,
r·(Cpad/16) + j)). Two operands rotated with the same sign_seed multiply to the product of the originals.
``values`` may be an NVFP4Tensor: the operand is then its storage's q·e_b (scaled_codes, exact in fp32), or
with ``transposed`` its transpose, bit for bit what the same values give staged (a forward's X̂ saved as codes).
"""

from __future__ import annotations

import torch

from .ms_eden import quantize_ms_eden
from .nvfp4 import BLOCK, NVFP4Tensor
from .philox import philox_bits, philox_signs, uniform24
from .rht import rht

#: the Hadamard sizes (and correction groups) the operand quantizer and its kernels take
MS_EDEN_SIZES = (16, 32, 64, 128)


def check_operand_args(values, size: int, pre_scale: torch.Tensor | None, where: str, *,
                       block_scales: torch.Tensor | None = None, tiles: bool = False) -> None:
    """One-line errors for what the operand quantizer cannot take: ``values`` a 2D float tensor, an NVFP4Tensor,
    or (with ``block_scales``) the packed uint8 codes [rows, cols/2] of an NVFP4 storage whose E4M3 scales are
    ``block_scales`` [rows, cols/16] (``tiles``: [rows/16, cols/16], 16×16 tiles)."""
    if isinstance(values, NVFP4Tensor):
        values, block_scales, tiles = values.data, values.scale, tuple(values.block_shape) == (BLOCK, BLOCK)
    if block_scales is not None:
        _check_codes(values, block_scales, tiles, where)
    elif not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.dim() != 2:
        got = f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"{where}: values must be a 2D floating-point tensor or an NVFP4Tensor, got {got}")
    if isinstance(size, bool) or size not in MS_EDEN_SIZES:
        raise ValueError(f"{where}: size must be one of {MS_EDEN_SIZES}, got {size!r}")
    if pre_scale is not None and (not isinstance(pre_scale, torch.Tensor) or pre_scale.dtype != torch.float32
                                  or pre_scale.numel() != 1):
        got = f"{pre_scale.dtype} {tuple(pre_scale.shape)}" if isinstance(pre_scale, torch.Tensor) else pre_scale
        raise ValueError(f"{where}: pre_scale must be an fp32 tensor of one element, got {got}")


def _check_codes(data, scale, tiles: bool, where: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        got = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{where}: NVFP4 codes must be a 2D uint8 tensor [rows, cols/2], got {got}")
    rows, cols = data.shape[0], data.shape[1] * 2
    want = (rows // BLOCK if tiles else rows, cols // BLOCK)
    if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != want
            or cols % BLOCK or (tiles and rows % BLOCK)):
        got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{where}: the block scales of NVFP4 codes {tuple(data.shape)} must be float8_e4m3fn "
                         f"{want} ({'16x16 tiles' if tiles else '1x16 blocks'}; rows and cols multiples of 16 "
                         f"where blocks span them), got {got}")


def operand_matrix(values: torch.Tensor | NVFP4Tensor, transposed: bool = False) -> torch.Tensor:
    """The operand [R, C] of ``values``: itself, or an NVFP4Tensor's storage q·e_b in fp32 (exact); its transpose
    with ``transposed``."""
    v = values.scaled_codes(torch.float32) if isinstance(values, NVFP4Tensor) else values
    return v.t() if transposed else v


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


def ms_eden_operand_amax(values: torch.Tensor | NVFP4Tensor, *, size: int, sign_seed: torch.Tensor | int,
                         pre_scale: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """fp32 0-d max|rotated operand| (0 when empty; non-finite values give +inf): the amax ms_eden_operand
    would use, for a caller that all-reduces it across ranks first."""
    check_operand_args(values, size, pre_scale, "ms_eden_operand_amax")
    v = rotated_operand(operand_matrix(values, transposed), size, sign_seed, pre_scale)
    a = v.abs().amax() if v.numel() else torch.zeros((), device=v.device)
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))


def ms_eden_operand(values: torch.Tensor | NVFP4Tensor, *, size: int, sign_seed: torch.Tensor | int,
                    draw_seed: torch.Tensor | int, pre_scale: torch.Tensor | None = None,
                    amax: torch.Tensor | None = None, transposed: bool = False) -> NVFP4Tensor:
    """NVFP4Tensor [R, Cpad] (1×16 blocks, global_scale = s) of the rotated, padded operand (module docstring;
    ``transposed``: of the transpose of ``values``). ``amax``: the rotated operand's amax to use (e.g.
    all-reduced), else its own."""
    check_operand_args(values, size, pre_scale, "ms_eden_operand")
    v = rotated_operand(operand_matrix(values, transposed), size, sign_seed, pre_scale)
    rows, cols = v.shape
    u = block_uniforms(draw_seed, rows, cols // BLOCK, v.device)
    a = None if amax is None else amax.to(v.device, torch.float32).reshape(())
    return quantize_ms_eden(v, None, group=size, amax=a, uniforms=u)


__all__ = ["MS_EDEN_SIZES", "block_uniforms", "check_operand_args", "ms_eden_operand", "ms_eden_operand_amax",
           "operand_matrix", "padded_cols", "rotated_operand"]
