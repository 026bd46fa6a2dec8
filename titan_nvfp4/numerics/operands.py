"""The operands the kernels hand back, as the GEMM dispatch reads them: NVFP4Tensors rebuilt from a quantization's
plain tensors (codes, scales, global scales), or StagedOperands, the fp16 values an emulated GEMM reads directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .nvfp4 import NVFP4Tensor


@dataclass
class StagedOperand:
    """A GEMM operand already in the emulated GEMM's staged form: fp16 values q·e_b [rows, K] (exact,
    see kernels/gemm.py), emitted by the quantization kernel for an operand that feeds one GEMM and
    is not kept, plus its global decode scale (applied in the GEMM's epilogue)."""

    values: torch.Tensor
    global_scale: torch.Tensor

    @property
    def storage_shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)


def check_bias(bias: torch.Tensor | None, n: int, device: torch.device, where: str = "NVFP4 GEMM") -> None:
    """A GEMM's bias is None or a floating-point [N] tensor on the output's device: refused by name otherwise
    (a kernel reading N values from a shorter bias reads past its end; a [1] bias would broadcast)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{where}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"{where}: bias of shape {tuple(bias.shape)}, expected ({n},): one value per output column")
    if not bias.is_floating_point():
        raise TypeError(f"{where}: bias must be a floating-point tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"{where}: bias is on {bias.device}, the operands on {device}")


def operand_pair(out, shape: torch.Size, rowwise: bool,
                 colwise: bool) -> tuple[NVFP4Tensor | StagedOperand | None, NVFP4Tensor | None]:
    """NVFP4Tensors from the outputs of ``quantize`` for a 2D operand of ``shape`` [M, K]: the
    rowwise operand and the column operand of xᵀ [K, M padded to 16], each a StagedOperand when
    quantized with ``row_staged`` / ``col_staged``."""
    rd, rs, cd, cs, gs = out
    m, k = shape
    if rowwise and rd.dtype == torch.float16:
        row = StagedOperand(rd, gs[0])
    else:
        row = NVFP4Tensor(rd, rs, gs[0], torch.Size(shape), (1, 16)) if rowwise else None
    if colwise and cd.dtype == torch.float16:
        col = StagedOperand(cd, gs[1])
    else:
        col = NVFP4Tensor(cd, cs, gs[1], torch.Size((k, m + (-m) % 16)), (1, 16)) if colwise else None
    return row, col


def weight_pair(out, shape: torch.Size) -> tuple[NVFP4Tensor | StagedOperand, NVFP4Tensor]:
    """NVFP4Tensors of W [N, K] (a StagedOperand when quantized ``staged``) and Wᵀ from the outputs of
    ``quantize_2d`` (16×16 blocks, one scale)."""
    d, s, dt, st, gs = out
    n, k = shape
    w = StagedOperand(d, gs[0]) if d.dtype == torch.float16 else NVFP4Tensor(d, s, gs[0], torch.Size(shape), (16, 16))
    return (w,
            NVFP4Tensor(dt, st, gs[0], torch.Size((k, n)), (16, 16)))


__all__ = ["StagedOperand", "check_bias", "operand_pair", "weight_pair"]
