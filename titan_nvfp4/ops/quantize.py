"""Quantization dispatch: what the autograd functions call to turn an operand into NVFP4.

Each function returns NVFP4Tensors in the reference layout whatever the backend, so the GEMM
dispatch and the tests never see a difference: bits are identical for nearest-even; stochastic
rounding draws from torch's generator (reference) or Philox (kernels), both seeded by ``seed``.
The kernel backends go through the custom ops of library.py, so torch.compile sees one opaque op.
"""

from __future__ import annotations

import torch

from ..numerics import ms_eden_operand as _ms_eden
from ..numerics.mxfp8 import MX_BLOCK, MXFP8Tensor, quantize_mxfp8
from ..numerics.nvfp4 import NVFP4Tensor, quantize_nvfp4
from ..numerics.rht import rht
from ..numerics.operands import StagedOperand
from . import library


def quantize_rowwise(x2d: torch.Tensor, block_shape=(1, 16), stochastic: bool = False,
                     generator: torch.Generator | None = None, amax: torch.Tensor | None = None, *,
                     four_over_six: bool = False, sr_block_scale: str = "nearest") -> NVFP4Tensor:
    """Reference: NVFP4 of a 2D operand with blocks along its rows' contraction dim (tensor scale
    from ``amax`` when given, else from max|x2d|; Four Over Six scales with ``four_over_six``; block
    scales of a stochastic operand rounded up with ``sr_block_scale="up"``)."""
    return quantize_nvfp4(x2d, block_shape=block_shape, stochastic=stochastic, generator=generator, amax=amax,
                          four_over_six=four_over_six, sr_block_scale=sr_block_scale)


def _wgrad_values(x2d: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """x2dᵀ with the tokens zero-padded to a multiple of 16, after the RHT when ``signs`` is given."""
    pad = (-x2d.shape[0]) % 16
    xt = x2d.t()
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    return rht(xt, signs) if signs is not None else xt


def quantize_wgrad_operand(x2d: torch.Tensor, signs: torch.Tensor | None, stochastic: bool = False,
                           generator: torch.Generator | None = None, amax: torch.Tensor | None = None, *,
                           four_over_six: bool = False, sr_block_scale: str = "nearest") -> NVFP4Tensor:
    """Reference: NVFP4 of x2dᵀ with 16-element blocks along the token dim (dim 0 of x2d), after the
    RHT when ``signs`` is given. Token counts that are not multiples of 16 are zero-padded: zero
    tokens add nothing to dW = dYᵀ X, so the product is unchanged."""
    return quantize_nvfp4(_wgrad_values(x2d, signs).contiguous(), block_shape=(1, 16), stochastic=stochastic,
                          generator=generator, amax=amax, four_over_six=four_over_six, sr_block_scale=sr_block_scale)


def operand_amax(x2d: torch.Tensor, colwise: bool, signs: torch.Tensor | None, backend: str) -> torch.Tensor:
    """fp32 [row amax, column amax] of an operand as quantize_activation / quantize_gradient would
    reduce them (column: of the RHT'd x2dᵀ; 0 without ``colwise``), non-finite values giving +inf: for
    a caller that all-reduces them across the ranks sharding the operand first."""
    if backend != "reference":
        return library.amax(x2d, signs if colwise else None, colwise=colwise)
    a = x2d.abs().amax().float() if x2d.numel() else x2d.new_zeros((), dtype=torch.float32)
    c = torch.zeros_like(a)
    if colwise:
        c = _wgrad_values(x2d, signs).abs().amax().float() if (signs is not None and x2d.numel()) else a
    out = torch.stack([a, c])
    return torch.where(torch.isfinite(out), out, torch.full_like(out, float("inf")))


def _generator(seed: torch.Tensor | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(int(seed.reshape(-1)[0]))


def _amaxes(amaxes: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if amaxes is None else (amaxes[0], amaxes[1])


def quantize_activation(x2d: torch.Tensor, need_col: bool, signs: torch.Tensor | None, backend: str,
                        amaxes: torch.Tensor | None = None, *, four_over_six: bool = False,
                        row_staged: bool = True) -> tuple[NVFP4Tensor, NVFP4Tensor | None]:
    """Forward operand X (1×16, nearest-even) and, when ``need_col``, its wgrad operand Xᵀ. On the
    emulated backend X comes as the GEMM's staged fp16 values (library.StagedOperand): it feeds the
    forward GEMM only, so its codes are never needed; ``row_staged=False`` gives its codes there too (a caller
    that saves X̂, staged_for_gemms stages them for the GEMM, the same values). ``amaxes``: operand_amax's
    [row, column] tensor amaxes to use (all-reduced across ranks) instead of x2d's own. ``four_over_six``: Four
    Over Six block scales."""
    if backend == "reference":
        a_row, a_col = _amaxes(amaxes)
        return (quantize_rowwise(x2d, amax=a_row, four_over_six=four_over_six),
                quantize_wgrad_operand(x2d, signs, amax=a_col, four_over_six=four_over_six) if need_col else None)
    out = library.quantize(x2d, signs, amaxes=amaxes, rowwise=True, colwise=need_col,
                           row_staged=row_staged and backend == "emulated", four_over_six=four_over_six)
    return library.operand_pair(out, x2d.shape, True, need_col)


def quantize_gradient(dy2d: torch.Tensor, need_row: bool, need_col: bool, signs: torch.Tensor | None,
                      seed: torch.Tensor | None, backend: str, amaxes: torch.Tensor | None = None, *,
                      four_over_six: bool = False,
                      sr_block_scale: str = "nearest") -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:
    """dgrad operand dY (1×16) and wgrad operand dYᵀ (RHT, 16 along tokens); stochastic iff ``seed``
    (an int64 tensor [1]) is given. On the emulated backend both come staged (fp16, as X in
    quantize_activation): each feeds one GEMM at once, so their codes would only be read to be staged.
    ``amaxes`` as in quantize_activation. ``sr_block_scale``: the recipe's ("up": block scales rounded up;
    only with a seed). The native backend quantizes through the same kernel, so it honours it too."""
    sr = seed is not None
    if backend == "reference":
        a_row, a_col = _amaxes(amaxes)
        gen = _generator(seed, dy2d.device)  # one stream: the row draws, then the column draws
        kw = dict(stochastic=sr, generator=gen, four_over_six=four_over_six, sr_block_scale=sr_block_scale)
        row = quantize_rowwise(dy2d, amax=a_row, **kw) if need_row else None
        col = quantize_wgrad_operand(dy2d, signs, amax=a_col, **kw) if need_col else None
        return row, col
    staged = backend == "emulated"
    out = library.quantize(dy2d, signs, seed, amaxes, rowwise=need_row, colwise=need_col, stochastic_row=sr,
                           stochastic_col=sr, row_staged=staged, col_staged=staged, four_over_six=four_over_six,
                           sr_block_scale=sr_block_scale)
    return library.operand_pair(out, dy2d.shape, need_row, need_col)


def quantize_weight(w: torch.Tensor, weight_2d: bool, backend: str, amax: torch.Tensor | None = None, *,
                    four_over_six: bool = False, transposed: bool = True,
                    staged: bool = True) -> tuple[NVFP4Tensor, NVFP4Tensor | None]:
    """The weight for forward (W, blocks along K) and for dgrad (Wᵀ, blocks along N): with 16×16 blocks
    the same quantization read both ways; with 1×16 blocks two separate quantizations (the second skipped, Wᵀ
    None, when not ``transposed``). ``amax``: the tensor amax to use (a sharded weight's, all-reduced) instead of
    max|w|. ``four_over_six``: Four Over Six. ``staged``: a 16×16-block W comes as the emulated GEMM's staged fp16
    values (False: its codes, for a caller that saves them)."""
    if backend == "reference":
        if weight_2d:
            wq = quantize_rowwise(w, block_shape=(16, 16), amax=amax, four_over_six=four_over_six)
            return wq, wq.t()
        return (quantize_rowwise(w, amax=amax, four_over_six=four_over_six),
                quantize_rowwise(w.t().contiguous(), amax=amax, four_over_six=four_over_six) if transposed else None)
    if weight_2d:  # W feeds the forward GEMM only: on the emulated backend it comes staged (fp16)
        a = None if amax is None else amax.reshape(1)
        return library.weight_pair(library.quantize_2d(w, a, staged=staged and backend == "emulated",
                                                       four_over_six=four_over_six),
                                   w.shape)
    a = None if amax is None else amax.reshape(1).expand(2).contiguous()  # [row, column] (only the row is read)
    rows = dict(amaxes=a, rowwise=True, colwise=False, four_over_six=four_over_six)
    wq, _ = library.operand_pair(library.quantize(w, **rows), w.shape, True, False)
    if not transposed:
        return wq, None
    wt, _ = library.operand_pair(library.quantize(w.t(), **rows), w.t().shape, True, False)
    return wq, wt


def mxfp8_operands(x2d: torch.Tensor, rowwise: bool, colwise: bool, backend: str,
                   staged: bool = False) -> tuple[MXFP8Tensor | torch.Tensor | None, MXFP8Tensor | torch.Tensor | None]:
    """MXFP8 operands of an MXFP8 backward: x2d with 1×32 blocks along its last dim (zero-padded to a
    multiple of 32), and x2dᵀ with blocks along x2d's first dim ([K, M padded to 32]), nearest-even.
    The Triton kernel emits both from one read when 32 divides x2d's last dim; the reference quantizer
    (numerics/mxfp8.py, bit-identical) serves the CPU backend and other shapes. ``staged``: each operand
    comes dequantized, as the GEMM reads it (BF16 on a GPU: exact, see ops.gemm.mxfp8_gemm; else fp32)."""
    kernel = backend != "reference" and x2d.shape[1] % MX_BLOCK == 0 and 0 < x2d.numel() < 2**31
    if kernel:
        rd, rs, cd, cs = library.quantize_mxfp8(x2d, rowwise=rowwise, colwise=colwise, staged=staged)
        if staged:
            return (rd if rowwise else None), (cd if colwise else None)
        return (MXFP8Tensor(rd, rs) if rowwise else None), (MXFP8Tensor(cd, cs) if colwise else None)
    pad_k, pad_m = (-x2d.shape[1]) % MX_BLOCK, (-x2d.shape[0]) % MX_BLOCK
    row = quantize_mxfp8(torch.nn.functional.pad(x2d, (0, pad_k))) if rowwise else None
    col = quantize_mxfp8(torch.nn.functional.pad(x2d, (0, 0, 0, pad_m)).t().contiguous()) if colwise else None
    if staged:
        dt = torch.bfloat16 if x2d.is_cuda else torch.float32
        return (row.dequantize(dt) if row else None), (col.dequantize(dt) if col else None)
    return row, col


def _seed_tensor(seed: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """An MS-EDEN stream seed as the kernels take it: int64 [1] on the operand's device."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(1) if seed.device == device else seed.reshape(1).to(device)
    return torch.tensor([seed], dtype=torch.int64, device=device)


def _ms_eden_source(values: torch.Tensor | NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(values or codes, block scales or None, 16×16 tiles) of an MS-EDEN operand, as the custom ops take it."""
    if isinstance(values, NVFP4Tensor):
        return values.data, values.scale, tuple(values.block_shape) == (16, 16)
    return values, None, False


def ms_eden_operand_amax(values: torch.Tensor | NVFP4Tensor, *, size: int, sign_seed: torch.Tensor | int,
                         backend: str, pre_scale: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """fp32 0-d max|RHT of values·pre_scale, zero-padded along its last dim to a multiple of ``size``|
    (non-finite: +inf): the amax quantize_ms_eden_operand would use, for a caller that all-reduces it first."""
    if backend == "reference":
        return _ms_eden.ms_eden_operand_amax(values, size=size, sign_seed=sign_seed, pre_scale=pre_scale,
                                             transposed=transposed)
    v, scales, tiles = _ms_eden_source(values)
    return library.ms_eden_amax(v, pre_scale, _seed_tensor(sign_seed, v.device), scales, size=size,
                                transposed=transposed, tiles=tiles)


def quantize_ms_eden_operand(values: torch.Tensor | NVFP4Tensor, *, size: int, sign_seed: torch.Tensor | int,
                             draw_seed: torch.Tensor | int, backend: str, pre_scale: torch.Tensor | None = None,
                             amax: torch.Tensor | None = None, staged: bool = False,
                             transposed: bool = False) -> NVFP4Tensor | StagedOperand:
    """MS-EDEN (Quartet II) of a backward GEMM operand values [R, C] (any float dtype and strides; blocks of 16
    along C, the contraction dim): values·pre_scale, C zero-padded to Cpad (a multiple of ``size``), the RHT
    of ``size`` with signs from ``sign_seed``, scale draws from ``draw_seed`` (int64 [1] tensors or ints;
    numerics/ms_eden_operand.py). Returns the rotated operand [R, Cpad] as an NVFP4Tensor (1×16 blocks), or
    with ``staged`` on the emulated backend as a StagedOperand (the GEMM's fp16 values); two operands rotated
    with the same sign_seed feed nvfp4_gemm for the product of the originals. ``amax``: the rotated operand's
    amax (ms_eden_operand_amax, all-reduced) to use instead of its own. ``values`` may be an NVFP4Tensor (its
    storage's q·e_b, read from the codes in place: bit for bit the same as those values given staged);
    ``transposed``: the transpose of ``values`` is the operand. Bits are the same on every backend."""
    if backend == "reference":
        return _ms_eden.ms_eden_operand(values, size=size, sign_seed=sign_seed, draw_seed=draw_seed,
                                        pre_scale=pre_scale, amax=amax, transposed=transposed)
    v, scales, tiles = _ms_eden_source(values)
    dev = v.device
    staged = staged and backend == "emulated"
    a = None if amax is None else amax.reshape(1).to(dev, torch.float32)
    data, scale, gs = library.ms_eden_quantize(v, pre_scale, _seed_tensor(sign_seed, dev),
                                               _seed_tensor(draw_seed, dev), a, scales, size=size, staged=staged,
                                               transposed=transposed, tiles=tiles)
    if staged:
        return StagedOperand(data, gs.reshape(()))
    rows = data.shape[0]
    return NVFP4Tensor(data, scale, gs.reshape(()), torch.Size((rows, data.shape[1] * 2)), (1, 16))
