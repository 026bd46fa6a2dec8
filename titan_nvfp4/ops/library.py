"""The kernels as torch.library custom ops, so torch.compile traces an NVFP4 model without graph breaks.

Each op takes and returns plain tensors (an NVFP4 operand travels as codes, scales and global scale);
ops/quantize.py and ops/gemm.py wrap them back into NVFP4Tensors. The fake implementations give
inductor the output shapes, dtypes and devices without running a kernel. The ops are opaque to
autograd: NVFP4LinearFunction calls them from its own forward and backward.

In eager mode, on plain tensors and with no dispatch or torch-function mode active, a call runs the
implementation directly: the custom-op machinery (autograd wrapper, redispatch, output aliasing
checks) costs ~100 µs of host time per call, as much as a small kernel takes on the GPU. Under
torch.compile, on fake, meta or subclass tensors (DTensor), or inside a mode, the call goes through
the registered op, so tracing and dispatch modes see one opaque op as before.

Calling convention: the tensors come first and positionally (an optional one, such as ``signs``, ``seed`` or
``amaxes``, defaults to None and may be named); every other option is keyword-only, named as the recipe names
its knob (``four_over_six`` for ``block_scale_rule = "four_over_six"``; ``sr_block_scale`` as the recipe's;
``row_staged`` / ``col_staged`` / ``staged`` for the staged fp16 form).
torch.library does not take keyword-only tensors, hence the split.

  titan_nvfp4::amax         the tensor amaxes quantize would reduce (for a cross-rank all-reduce first)
  titan_nvfp4::quantize     1×16 rows and/or RHT'd 16-along-tokens columns of one 2D operand
  titan_nvfp4::quantize_2d  16×16-block weight plus the codes and scales of its transpose
  titan_nvfp4::gemm         (A·Bᵀ)·gs_A·gs_B [+ bias] on the emulated or the native backend
  titan_nvfp4::stage        an operand's codes as the emulated GEMM's fp16 values, for one read by several GEMMs
  titan_nvfp4::quantize_mxfp8  rowwise and/or columnwise MXFP8 of one 2D operand
  titan_nvfp4::mxfp8_addmm  C + A·Bᵀ of staged MXFP8 operands onto an addend (OutControl's forward)
  titan_nvfp4::*_grouped, amax_experts, grouped_gemm_*  the same for MoE experts, per-expert tensor scales
  titan_nvfp4::stage_grouped  a grouped operand's codes as the GEMMs' fp16 values, for one read by several GEMMs
  titan_nvfp4::quantize_2d_grouped_pair  W1 and W3 of SwiGLU experts staged into one buffer, for one GEMM of both
  titan_nvfp4::swiglu_amax, swiglu_backward_amax  the experts' SwiGLU fused with the amaxes of its outputs
  titan_nvfp4::ms_eden_amax, ms_eden_quantize  MS-EDEN (Quartet II) of a backward operand: RHT'd amax, quantization
"""

from __future__ import annotations

from typing import Optional

import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import StagedOperand, operand_pair, weight_pair  # noqa: F401  (re-exported)

Tensor = torch.Tensor


def _runs_directly(args) -> bool:
    """Whether an op call may skip the dispatcher: eager, no mode, every tensor a plain non-meta one. (A loop:
    it runs on every eager call, and a generator over the arguments cost ~10 µs a call.)"""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    for a in args:
        if type(a) in _PLAIN:
            if a.is_meta:
                return False
        elif isinstance(a, torch.Tensor):  # a subclass (DTensor, FakeTensor)
            return False
    return True


#: Tensor types an eager call may hand to the implementation as they are (a Parameter is a plain
#: tensor to the kernels: the weight reaches quantize_2d as one inside NVFP4LinearFunction.forward).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _op(name: str):
    """``torch.library.custom_op("titan_nvfp4::<name>")`` whose eager calls on plain tensors run the
    implementation directly (module docstring); the registered op is ``<fn>.op``."""
    def wrap(fn):
        op = torch.library.custom_op(f"titan_nvfp4::{name}", mutates_args=())(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _runs_directly((*args, *kwargs.values())):
                return fn(*args, **kwargs)
            return op(*args, **kwargs)

        call.op = op
        return call
    return wrap


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((0,), dtype=dtype)


@_op("amax")
def amax(x: Tensor, signs: Optional[Tensor] = None, *, colwise: bool) -> Tensor:
    """fp32 [max|x|, max|rht(xᵀ)|] as ``quantize`` would reduce them (non-finite: +inf)."""
    from ..kernels.quantize import operand_amax_tensors

    return operand_amax_tensors(x, colwise, signs)


@amax.op.register_fake
def _amax_fake(x, signs=None, *, colwise):
    return x.new_empty((2,), dtype=torch.float32)


@_op("quantize")
def quantize(x: Tensor, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
             amaxes: Optional[Tensor] = None, *, rowwise: bool, colwise: bool, stochastic_row: bool = False,
             stochastic_col: bool = False, row_staged: bool = False, col_staged: bool = False,
             four_over_six: bool = False,
             sr_block_scale: str = "nearest") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(row codes, row scales, column codes, column scales, [gs_row, gs_col]); an operand not asked
    for comes back as empty tensors (and its decode scale unset). ``signs``: the RHT of the column
    operand; ``seed``: int64 [1], for ``stochastic_row`` / ``stochastic_col``. ``row_staged`` /
    ``col_staged``: that operand as the emulated GEMM's staged fp16 values ([M, K] / [K, M padded])
    instead of codes (its scales empty). ``amaxes``: fp32 [row, column] tensor amaxes to use (e.g.
    all-reduced across ranks) instead of reducing them from x. ``four_over_six``: Four Over Six block
    scales (numerics/nvfp4.py). ``sr_block_scale``: "up" rounds the stochastic operands' block scales up."""
    from ..kernels.quantize import quantize_operand_tensors

    a_row, a_col = (None, None) if amaxes is None else (amaxes[0:1], amaxes[1:2])
    return quantize_operand_tensors(x, rowwise=rowwise, colwise=colwise, signs=signs, stochastic_row=stochastic_row,
                                    stochastic_col=stochastic_col, seed=seed, row_staged=row_staged,
                                    col_staged=col_staged, amax=a_row, amax_col=a_col if colwise else None,
                                    four_over_six=four_over_six, sr_block_scale=sr_block_scale)


@quantize.op.register_fake
def _quantize_fake(x, signs=None, seed=None, amaxes=None, *, rowwise, colwise, stochastic_row=False,
                   stochastic_col=False, row_staged=False, col_staged=False, four_over_six=False,
                   sr_block_scale="nearest"):
    m, k = x.shape
    mpad = m + (-m) % 16
    f8 = torch.float8_e4m3fn
    rd = x.new_empty((m, k // 2), dtype=torch.uint8) if rowwise else _empty(x, torch.uint8)
    rs = x.new_empty((m, k // 16), dtype=f8) if rowwise else _empty(x, f8)
    if rowwise and row_staged:
        rd, rs = x.new_empty((m, k), dtype=torch.float16), _empty(x, f8)
    cd = x.new_empty((k, mpad // 2), dtype=torch.uint8) if colwise else _empty(x, torch.uint8)
    cs = x.new_empty((k, mpad // 16), dtype=f8) if colwise else _empty(x, f8)
    if colwise and col_staged:
        cd, cs = x.new_empty((k, mpad), dtype=torch.float16), _empty(x, f8)
    return rd, rs, cd, cs, x.new_empty((2,), dtype=torch.float32)


@_op("ms_eden_amax")
def ms_eden_amax(values: Tensor, pre_scale: Optional[Tensor], sign_seed: Tensor, block_scales: Optional[Tensor] = None,
                 *, size: int, transposed: bool = False, tiles: bool = False) -> Tensor:
    """fp32 0-d max|RHT of values·pre_scale, zero-padded to a multiple of ``size``| (non-finite: +inf), from
    the sign stream ``sign_seed`` (int64 [1]): the amax ms_eden_quantize would reduce. The operand as there."""
    from ..kernels.ms_eden import ms_eden_amax_tensor

    return ms_eden_amax_tensor(values, pre_scale, sign_seed, size=size, block_scales=block_scales,
                               transposed=transposed, tiles=tiles)


def _ms_eden_dims(values: Tensor, block_scales: Optional[Tensor], transposed: bool) -> tuple:
    """The operand's [R, C]: values', or with ``block_scales`` its NVFP4 storage's [rows, 2·values.shape[1]]
    (either transposed with ``transposed``)."""
    r, c = (values.shape[0], 2 * values.shape[1]) if block_scales is not None else tuple(values.shape)
    return (c, r) if transposed else (r, c)


@ms_eden_amax.op.register_fake
def _ms_eden_amax_fake(values, pre_scale, sign_seed, block_scales=None, *, size, transposed=False, tiles=False):
    return values.new_empty((), dtype=torch.float32)


@_op("ms_eden_quantize")
def ms_eden_quantize(values: Tensor, pre_scale: Optional[Tensor], sign_seed: Tensor, draw_seed: Tensor,
                     amax: Optional[Tensor] = None, block_scales: Optional[Tensor] = None, *, size: int, staged: bool,
                     transposed: bool = False, tiles: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """MS-EDEN of values [R, C] (blocks of 16 along C) after the RHT of ``size``: (codes uint8 [R, Cpad/2],
    E4M3 scales [R, Cpad/16], s fp32 [1]), or with ``staged`` (fp16 q·ê_b [R, Cpad], empty scales, s).
    Seeds: int64 [1]; ``amax``: the rotated operand's amax to use (all-reduced) instead of its own. With
    ``block_scales`` the operand is an NVFP4 storage's q·e_b read from its packed codes ``values`` [rows, cols/2]
    and E4M3 ``block_scales`` (``tiles``: 16×16 tiles); ``transposed``: the operand's transpose is quantized."""
    from ..kernels.ms_eden import ms_eden_quantize_tensors

    return ms_eden_quantize_tensors(values, pre_scale, sign_seed, draw_seed, amax, size=size, staged=staged,
                                    block_scales=block_scales, transposed=transposed, tiles=tiles)


@ms_eden_quantize.op.register_fake
def _ms_eden_quantize_fake(values, pre_scale, sign_seed, draw_seed, amax=None, block_scales=None, *, size, staged,
                           transposed=False, tiles=False):
    r, c = _ms_eden_dims(values, block_scales, transposed)
    cpad = c + (-c) % size
    if staged:
        return (values.new_empty((r, cpad), dtype=torch.float16), _empty(values, torch.float8_e4m3fn),
                values.new_empty((1,), dtype=torch.float32))
    return (values.new_empty((r, cpad // 2), dtype=torch.uint8),
            values.new_empty((r, cpad // 16), dtype=torch.float8_e4m3fn), values.new_empty((1,), dtype=torch.float32))


@_op("quantize_2d")
def quantize_2d(w: Tensor, amax: Optional[Tensor] = None, *, staged: bool = False,
                four_over_six: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(codes of W, 16×16 scales, codes of Wᵀ, scales of Wᵀ, global decode scale [1]); ``amax``: the
    tensor amax to use instead of max|w| (a sharded weight's, all-reduced); ``staged``: W as the GEMM's
    fp16 values (scales empty)."""
    from ..kernels.quantize import quantize_weight_2d_tensors

    return quantize_weight_2d_tensors(w, amax=amax, staged=staged, four_over_six=four_over_six)


@quantize_2d.op.register_fake
def _quantize_2d_fake(w, amax=None, *, staged=False, four_over_six=False):
    n, k = w.shape
    f8 = torch.float8_e4m3fn
    d, s = w.new_empty((n, k // 2), dtype=torch.uint8), w.new_empty((n // 16, k // 16), dtype=f8)
    if staged:
        d, s = w.new_empty((n, k), dtype=torch.float16), _empty(w, f8)
    return (d, s, w.new_empty((k, n // 2), dtype=torch.uint8), w.new_empty((k // 16, n // 16), dtype=f8),
            w.new_empty((1,), dtype=torch.float32))


def _operand(data: Tensor, scale: Tensor, gs: Tensor, tiles: bool) -> NVFP4Tensor | StagedOperand:
    if data.dtype == torch.float16:
        return StagedOperand(data, gs.reshape(()))
    rows, cols = data.shape[0], data.shape[1] * 2
    return NVFP4Tensor(data, scale, gs.reshape(()), torch.Size((rows, cols)), (16, 16) if tiles else (1, 16))


@_op("gemm")
def gemm(a_data: Tensor, a_scale: Tensor, a_gs: Tensor, b_data: Tensor, b_scale: Tensor, b_gs: Tensor,
         bias: Optional[Tensor] = None, *, a_tiles: bool, b_tiles: bool, out_dtype: torch.dtype, backend: str,
         round_to: Optional[torch.dtype] = None) -> Tensor:
    """out [M, N] = (A · Bᵀ)·gs_A·gs_B [+ bias]; ``*_tiles``: the operand has 16×16 scale blocks; ``round_to``:
    a 16-bit dtype the values of a wider ``out_dtype`` are rounded to first."""
    a = _operand(a_data, a_scale, a_gs, a_tiles)
    b = _operand(b_data, b_scale, b_gs, b_tiles)
    if backend == "emulated":
        from ..kernels.gemm import nvfp4_gemm_triton
        return nvfp4_gemm_triton(a, b, out_dtype, bias, round_to=round_to)
    if backend == "native":
        from ..kernels.native import nvfp4_gemm_native
        return nvfp4_gemm_native(a, b, round_to or out_dtype, bias).to(out_dtype)
    raise ValueError(f"titan_nvfp4::gemm: backend must be 'emulated' or 'native', got {backend!r}")


@gemm.op.register_fake
def _gemm_fake(a_data, a_scale, a_gs, b_data, b_scale, b_gs, bias=None, *, a_tiles, b_tiles, out_dtype, backend,
               round_to=None):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


@_op("stage")
def stage(data: Tensor, scale: Tensor, *, tiles: bool) -> Tensor:
    """fp16 q·e_b [R, C] of an operand's codes [R, C/2] and scales (no global scale: the GEMM applies it),
    exact: what the emulated GEMM stages from codes on each call, as one op, so that the wgrads of sibling
    layers on one X (wq, wk, wv) stage its saved Xᵀ once under torch.compile (CSE) instead of once each."""
    from ..kernels.gemm import dequantize_fp16

    return dequantize_fp16(_operand(data, scale, scale.new_ones((), dtype=torch.float32), tiles))


@stage.op.register_fake
def _stage_fake(data, scale, *, tiles):
    return data.new_empty((data.shape[0], 2 * data.shape[1]), dtype=torch.float16)


@_op("quantize_mxfp8")
def quantize_mxfp8(x: Tensor, *, rowwise: bool, colwise: bool,
                   staged: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MXFP8 (row elements, row E8M0 scales, column elements, column scales) of a 2D operand; the
    column operand holds xᵀ with tokens zero-padded to a multiple of 32. ``staged``: the elements come
    dequantized in BF16 (what a BF16 GEMM reads) and the scales empty."""
    from ..kernels.mxfp8 import quantize_mxfp8_tensors

    return quantize_mxfp8_tensors(x, rowwise, colwise, staged)


@quantize_mxfp8.op.register_fake
def _quantize_mxfp8_fake(x, *, rowwise, colwise, staged=False):
    m, k = x.shape
    mpad = m + (-m) % 32
    f8, e8 = (torch.bfloat16 if staged else torch.float8_e4m3fn), torch.float8_e8m0fnu
    return (x.new_empty((m, k) if rowwise else (0,), dtype=f8),
            x.new_empty((m, k // 32) if rowwise and not staged else (0,), dtype=e8),
            x.new_empty((k, mpad) if colwise else (0,), dtype=f8),
            x.new_empty((k, mpad // 32) if colwise and not staged else (0,), dtype=e8))


@_op("mxfp8_addmm")
def mxfp8_addmm(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """c + a · bᵀ in c's dtype: a [M, K] and b [N, K] staged MXFP8 values, fp32 sums, one rounding (OutControl's
    MXFP8 part added onto the NVFP4 part's output)."""
    from ..kernels.mxfp8_addmm import mxfp8_addmm_tensor

    return mxfp8_addmm_tensor(a, b, c)


@mxfp8_addmm.op.register_fake
def _mxfp8_addmm_fake(a, b, c):
    return torch.empty_like(c, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- grouped (MoE experts)

@_op("quantize_grouped")
def quantize_grouped(x: Tensor, offsets: Tensor, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
                     amaxes: Optional[Tensor] = None, *, rowwise: bool, colwise: bool, stochastic_row: bool = False,
                     stochastic_col: bool = False, row_staged: bool = False, col_staged: bool = False,
                     four_over_six: bool = False,
                     sr_block_scale: str = "nearest") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize`` (same arguments, same order) of routed tokens grouped by expert (``offsets``: cumulative
    group ends, multiples of 16), each expert with its own tensor scales: decode scales fp32 [2, E + 1]
    (row, column). ``amaxes``: amax_grouped's fp32 [2, E + 1] to use (all-reduced across ranks) instead
    of x's own."""
    from ..kernels.quantize import quantize_operand_tensors

    return quantize_operand_tensors(x, rowwise=rowwise, colwise=colwise, signs=signs, stochastic_row=stochastic_row,
                                    stochastic_col=stochastic_col, seed=seed, groups=offsets, row_staged=row_staged,
                                    col_staged=col_staged, four_over_six=four_over_six, group_amaxes=amaxes,
                                    sr_block_scale=sr_block_scale)


@quantize_grouped.op.register_fake
def _quantize_grouped_fake(x, offsets, signs=None, seed=None, amaxes=None, *, rowwise, colwise, stochastic_row=False,
                           stochastic_col=False, row_staged=False, col_staged=False, four_over_six=False,
                           sr_block_scale="nearest"):
    rd, rs, cd, cs, _ = _quantize_fake(x, rowwise=rowwise, colwise=colwise, row_staged=row_staged,
                                       col_staged=col_staged)
    return rd, rs, cd, cs, x.new_empty((2, offsets.shape[0] + 1), dtype=torch.float32)


@_op("amax_grouped")
def amax_grouped(x: Tensor, offsets: Tensor, signs: Optional[Tensor] = None, *, colwise: bool) -> Tensor:
    """fp32 [2, E + 1]: the per-expert (row, column) amaxes ``quantize_grouped`` would reduce."""
    from ..kernels.quantize import operand_amax_tensors

    return operand_amax_tensors(x, colwise, signs, offsets)


@amax_grouped.op.register_fake
def _amax_grouped_fake(x, offsets, signs=None, *, colwise):
    return x.new_empty((2, offsets.shape[0] + 1), dtype=torch.float32)


@_op("amax_experts")
def amax_experts(w: Tensor, *, experts: int) -> Tensor:
    """fp32 [E]: the tensor amax of each of ``experts`` expert weights stacked along w's rows."""
    from ..kernels.quantize import expert_amax_tensors

    return expert_amax_tensors(w, experts)


@amax_experts.op.register_fake
def _amax_experts_fake(w, *, experts):
    return w.new_empty((experts,), dtype=torch.float32)


@_op("quantize_2d_grouped")
def quantize_2d_grouped(w: Tensor, amax: Optional[Tensor] = None, *, experts: int, staged: bool = False,
                        four_over_six: bool = False,
                        emit_transpose: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_2d`` of ``experts`` stacked expert weights w [E·N, K], one tensor scale each:
    decode scales [E]; the transpose is that of the stack, [K, E·N] (empty without ``emit_transpose``).
    ``staged``: W as the GEMM's fp16 values [E·N, K] (scales empty); Wᵀ stays codes. ``amax``: fp32 [E]
    expert amaxes to use."""
    from ..kernels.quantize import quantize_weight_2d_tensors

    return quantize_weight_2d_tensors(w, amax, emit_transpose, experts=experts, staged=staged,
                                      four_over_six=four_over_six)


@quantize_2d_grouped.op.register_fake
def _quantize_2d_grouped_fake(w, amax=None, *, experts, staged=False, four_over_six=False, emit_transpose=True):
    d, s, dt, st, _ = _quantize_2d_fake(w, staged=staged)
    if not emit_transpose:
        dt, st = _empty(w, torch.uint8), _empty(w, torch.float8_e4m3fn)
    return d, s, dt, st, w.new_empty((experts,), dtype=torch.float32)


_SevenTensors = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@_op("quantize_2d_grouped_pair")
def quantize_2d_grouped_pair(w1: Tensor, w3: Tensor, amax1: Optional[Tensor] = None, amax3: Optional[Tensor] = None,
                             *, experts: int, four_over_six: bool = False,
                             emit_transpose: bool = True) -> _SevenTensors:
    """``quantize_2d_grouped(staged=True)`` of two stacked expert weights of one shape [E·N, K] (W1 and
    W3 of SwiGLU experts, read by the same tokens), their staged values interleaved in one [E·2N, K]
    buffer, expert e's W1_e rows then its W3_e rows, so one grouped GEMM of 2N outputs
    (grouped_gemm_rows ``n_split``) computes both products: (staged W1|W3, W1ᵀ codes, W1ᵀ scales, W1's
    decode scales [E], the same three for W3; the Wᵀ ones empty without ``emit_transpose``). The values
    and scales are bit for bit those of two separate calls."""
    from ..kernels.quantize import quantize_weight_2d_tensors

    if w1.shape != w3.shape:
        raise ValueError(f"quantize_2d_grouped_pair: the two weights differ in shape, {tuple(w1.shape)} vs "
                         f"{tuple(w3.shape)}")
    n, k = w1.shape[0] // experts, w1.shape[1]
    staged = torch.empty((2 * w1.shape[0], k), dtype=torch.float16, device=w1.device)
    out = [staged]
    for i, (w, amax) in enumerate(((w1, amax1), (w3, amax3))):
        _, _, dt, st, gs = quantize_weight_2d_tensors(w, amax, emit_transpose, experts=experts, staged=True,
                                                      four_over_six=four_over_six,
                                                      staged_into=(staged[i * n:], 2 * n))
        out += [dt, st, gs]
    return tuple(out)


@quantize_2d_grouped_pair.op.register_fake
def _quantize_2d_grouped_pair_fake(w1, w3, amax1=None, amax3=None, *, experts, four_over_six=False,
                                   emit_transpose=True):
    out = [w1.new_empty((2 * w1.shape[0], w1.shape[1]), dtype=torch.float16)]
    for w in (w1, w3):
        _, _, dt, st, _ = _quantize_2d_fake(w, staged=True)
        if not emit_transpose:
            dt, st = _empty(w, torch.uint8), _empty(w, torch.float8_e4m3fn)
        out += [dt, st, w.new_empty((experts,), dtype=torch.float32)]
    return tuple(out)


@_op("grouped_gemm_rows")
def grouped_gemm_rows(a_data: Tensor, a_scale: Tensor, b_data: Tensor, b_scale: Tensor, offsets: Tensor,
                      gs_a: Tensor, gs_b: Tensor, bias: Optional[Tensor] = None, add_to: Optional[Tensor] = None, *,
                      b_tiles: bool, n_out: int, b_row_step: int, b_col_step: int, out_dtype: torch.dtype,
                      n_split: int = 0) -> Tensor:
    """Tokens grouped along M (fprop, dgrad): see kernels/grouped_gemm.py. An fp16 ``a_data`` is A
    already staged (``quantize_grouped(row_staged=True)``). ``add_to``: the result is add_to plus the
    product, summed as two outputs would be (a new tensor; add_to is only read). ``n_split``: B holds
    two stacked weights per expert (quantize_2d_grouped_pair), gs_b their decode scales [2, E]."""
    from ..kernels.grouped_gemm import grouped_gemm_rows as run
    from ..kernels.grouped_gemm import stage

    a = stage(_operand(a_data, a_scale, gs_a.reshape(-1)[:1], False))
    b = stage(_operand(b_data, b_scale, gs_b.reshape(-1)[:1], b_tiles))
    return run(a, b, offsets, gs_a, gs_b, n_out, b_row_step, b_col_step, out_dtype, bias, add_to, n_split)


@grouped_gemm_rows.op.register_fake
def _grouped_gemm_rows_fake(a_data, a_scale, b_data, b_scale, offsets, gs_a, gs_b, bias=None, add_to=None, *,
                            b_tiles, n_out, b_row_step, b_col_step, out_dtype, n_split=0):
    return a_data.new_empty((a_data.shape[0], n_out), dtype=out_dtype)


@_op("grouped_gemm_tokens")
def grouped_gemm_tokens(a_data: Tensor, a_scale: Tensor, b_data: Tensor, b_scale: Tensor, offsets: Tensor,
                        gs_a: Tensor, gs_b: Tensor, *, out_dtype: torch.dtype) -> Tensor:
    """Tokens grouped along K (wgrad): out [E, M, N], see kernels/grouped_gemm.py."""
    from ..kernels.grouped_gemm import grouped_gemm_tokens as run
    from ..kernels.grouped_gemm import stage

    return run(stage(_operand(a_data, a_scale, gs_a[:1], False)), stage(_operand(b_data, b_scale, gs_b[:1], False)),
               offsets, gs_a, gs_b, out_dtype)


@grouped_gemm_tokens.op.register_fake
def _grouped_gemm_tokens_fake(a_data, a_scale, b_data, b_scale, offsets, gs_a, gs_b, *, out_dtype):
    return a_data.new_empty((offsets.shape[0], a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


@_op("stage_grouped")
def stage_grouped(data: Tensor, scale: Tensor) -> Tensor:
    """fp16 q·e_b [R, C] of a grouped 1×16 operand's codes [R, C/2] and scales (no global scale: the
    GEMMs apply it per expert), exact: what the grouped GEMMs stage from codes on each call, for an
    operand that feeds several of them (X's wgrad operand, read by both W1's and W3's wgrad)."""
    from ..kernels.grouped_gemm import stage

    return stage(_operand(data, scale, scale.new_ones((), dtype=torch.float32), False))


@stage_grouped.op.register_fake
def _stage_grouped_fake(data, scale):
    return data.new_empty((data.shape[0], 2 * data.shape[1]), dtype=torch.float16)


@_op("swiglu_amax")
def swiglu_amax(h1: Tensor, h3: Tensor, offsets: Tensor, signs: Optional[Tensor] = None, *,
                colwise: bool) -> tuple[Tensor, Tensor]:
    """(silu(h1) ⊙ h3, its per-expert (row, column) amaxes fp32 [2, E + 1] as amax_grouped gives them)
    from one pass: the SwiGLU of MoE experts, see kernels/swiglu.py."""
    from ..kernels.swiglu import swiglu_amax_tensors

    return swiglu_amax_tensors(h1, h3, offsets, colwise, signs)


@swiglu_amax.op.register_fake
def _swiglu_amax_fake(h1, h3, offsets, signs=None, *, colwise):
    return h1.new_empty(h1.shape), h1.new_empty((2, offsets.shape[0] + 1), dtype=torch.float32)


@_op("swiglu_backward_amax")
def swiglu_backward_amax(dh: Tensor, h1: Tensor, h3: Tensor, offsets: Tensor, signs: Optional[Tensor] = None, *,
                         colwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh1, dh3, amaxes of dh1, amaxes of dh3): swiglu_amax's backward, the amaxes as for h."""
    from ..kernels.swiglu import swiglu_backward_amax_tensors

    return swiglu_backward_amax_tensors(dh, h1, h3, offsets, colwise, signs)


@swiglu_backward_amax.op.register_fake
def _swiglu_backward_amax_fake(dh, h1, h3, offsets, signs=None, *, colwise):
    amax = h1.new_empty((2, offsets.shape[0] + 1), dtype=torch.float32)
    return h1.new_empty(h1.shape), h3.new_empty(h3.shape), amax, torch.empty_like(amax)
