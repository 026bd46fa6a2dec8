"""Emulated NVFP4 GEMM in Triton: out = (A · Bᵀ) · (gs_A · gs_B) [+ bias], for GPUs without FP4 tensor
cores (sm_80–sm_90, ROCm) and for the CPU interpreter.

Structure (chosen by measurement on an H100; current figures in docs/performance.md):

  * Both operands are staged per call as fp16 values q·e_b (``dequantize_fp16``): exact, since q·e_b
    is a multiple of 2⁻¹⁰ below 2688 with at most 8 significant bits. The kernel reads them through
    TMA on sm_90 (plain loads elsewhere) like a 16-bit GEMM's operands. Staging runs in row chunks of
    at most STAGE_BYTES per operand, so its buffers stay small whatever the shape. Operands that feed
    this GEMM only (X and W in forward, dY in dgrad) arrive already staged from the quantization
    kernels (``StagedOperand``), and are read as they are.
  * On sm_90 with both operands staged (the default) a persistent kernel runs: one program per SM
    walks the output tiles, the tile loop and the K loop flattened so that the next tile's TMA loads
    overlap this tile's epilogue, and C leaves through a TMA store (in two half tiles where the
    autotuner picks that: less shared memory, one more pipeline stage). Its TMA descriptors are built
    on the device: host descriptor objects cost ~30 µs of host time each per launch. It measured
    102–113% of cuBLAS BF16 on an H100 where the one-tile-per-program kernel below reached 87–93%
    (``python benchmarks/bench_kernels.py --only gemm`` times it). Operands that arrive staged are not chunked.
  * With ``stage_a=False`` A stays packed instead: each K step loads bytes and E4M3 scales and builds
    fp16 q·e_b·2⁻¹⁴ in registers (the 3 magnitude bits of a code shifted into fp16's exponent and
    mantissa give q·2⁻¹⁴ exactly; one exact fp16 multiply applies the scale; on CUDA a PTX routine
    does 4 bytes per call). It saves the staging traffic but measured 58–69% of cuBLAS BF16 on an H100
    against 63–89% staged; the accumulator then holds 2⁻¹⁴·Σ and the epilogue multiplies by 2¹⁴.
  * The epilogue multiplies the fp32 accumulator by gs_A·gs_B, adds the bias in fp32 and rounds once
    to the output dtype, as the reference does.

Reference twin: titan_nvfp4/ops/gemm.py:gemm_reference (checked in tests/test_kernels.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.runtime import _allocation
except ImportError:  # pragma: no cover - another Triton layout (ensure_scratch_allocator then always sets one)
    _allocation = None

from ..numerics.nvfp4 import NVFP4Tensor
from ..numerics.operands import StagedOperand, check_bias
from .platform import capability, interpreting, shared_memory
from .launch import autotune, cdiv, launch, tune_bucket
from .nvfp4_jit import e4m3_value

#: Staging budget per operand (bytes of fp16); larger operands are staged in row chunks.
STAGE_BYTES = 64 * 2**20
#: Row chunks shorter than this make launches of too few tiles; long contractions then split K.
MIN_CHUNK_ROWS = 2048
#: Stage A as fp16 as well (both operands through TMA) instead of dequantizing it in registers.
STAGE_A = True


def set_b_block(nargs):
    """Autotune pre-hook: the TMA descriptors take the tile shape of the config being run."""
    for name, rows in (("a_desc", "BM"), ("b_desc", "BN")):
        desc = nargs[name]
        if hasattr(desc, "block_shape"):
            desc.block_shape = [nargs[rows], nargs["BK"]]


def tma_tiles_fit(configs, named_args, **kwargs):
    """Autotune early prune: the configs whose TMA tiles fit the GPU's shared memory. Each host descriptor the kernel
    loads (a_desc, b_desc) takes num_stages buffers of its [BM or BN, BK] tile, a lower bound of what it needs, so a config
    dropped here would fail anyway (Triton's OutOfResources, after a compile: 128×256×128 in 3 stages of fp16 needs
    288 KiB, an H100 has 227), and a failed config's error holds the launch's tensors in a reference cycle."""
    fit, limit = [], None
    for c in configs:
        meta = {**named_args, **kwargs, **c.kwargs}
        need, device = 0, None
        tma = meta.get("TMA", meta.get("B_TMA", False))  # the grouped kernels' flag, the dense kernel's
        for name, rows, used in (("a_desc", "BM", tma and meta.get("A_STAGED", True)), ("b_desc", "BN", tma)):
            desc = meta.get(name)
            if used and hasattr(desc, "block_shape") and hasattr(desc, "base"):
                need += c.num_stages * meta[rows] * meta["BK"] * desc.base.element_size()
                device = desc.base.device
        if need and limit is None:
            limit = shared_memory(device)
        if not need or need <= limit:
            fit.append(c)
    return fit or configs  # Triton needs one: then the failure says which


def _configs():
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s, pre_hook=set_b_block)
            for bm, bn, bk, w, s in ((128, 256, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4))]


@triton.jit
def _dequant_asm(raw, s):
    """(lo, hi) fp16 q·e_b·2⁻¹⁴ of packed bytes, 4 bytes per PTX call: prmt spreads the bytes to 16-bit
    lanes, shifts and masks place the 3 magnitude bits and the sign, mul.f16x2 applies the scales."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t<2>, x, y, l<2>, h<2>;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        shl.b32 x, t0, 9; shl.b32 y, t0, 12; and.b32 y, y, 0x80008000; lop3.b32 l0, x, 0x0E000E00, y, 0xEA;
        shl.b32 x, t1, 9; shl.b32 y, t1, 12; and.b32 y, y, 0x80008000; lop3.b32 l1, x, 0x0E000E00, y, 0xEA;
        shl.b32 x, t0, 5; shl.b32 y, t0, 8; and.b32 y, y, 0x80008000; lop3.b32 h0, x, 0x0E000E00, y, 0xEA;
        shl.b32 x, t1, 5; shl.b32 y, t1, 8; and.b32 y, y, 0x80008000; lop3.b32 h1, x, 0x0E000E00, y, 0xEA;
        mul.rn.f16x2 $0, l0, $5;
        mul.rn.f16x2 $1, l1, $6;
        mul.rn.f16x2 $2, h0, $5;
        mul.rn.f16x2 $3, h1, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[raw, s],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _nibbles_fp16(raw):
    """(low, high) nibbles of packed bytes as fp16 q·2⁻¹⁴: the 3 magnitude bits shifted into fp16's
    exponent/mantissa, the sign bit into fp16's sign (exact)."""
    b = raw.to(tl.uint16)
    lo = (((b & 0x7) << 9) | ((b & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _dequant_a(raw, s16, R: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """[R, BK/2] packed bytes and [R, BK/16] fp16 scales -> [R, BK] fp16 q·e_b·2⁻¹⁴ in K order."""
    s = tl.reshape(tl.broadcast_to(s16[:, :, None], (R, BK // 16, 8)), (R, BK // 2))
    if USE_ASM:
        lo, hi = _dequant_asm(raw, s)
    else:
        lo, hi = _nibbles_fp16(raw)
        lo, hi = lo * s, hi * s
    return tl.reshape(tl.join(lo, hi), (R, BK))


@triton.jit
def swizzle_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of tile ``pid`` of a tiles_m × tiles_n grid, walking GROUP_M tile rows
    per column so that neighbouring programs share operand tiles in L2."""
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def grouped_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of this program over an [M, N] output (see swizzle_tile)."""
    return swizzle_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)


#: ROUND codes of the GEMM kernels: the 16-bit dtype their fp32 results are rounded to before a wider store
ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """fp32 x rounded to bf16 (ROUND 1) or fp16 (2), as fp32; x itself for 0. The same conversion a 16-bit
    store applies, so a wide C holds exactly what a 16-bit C widened would."""
    if ROUND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _nvfp4_gemm_kernel(A, SA, a_desc, B, b_desc, GSA, GSB, BIAS, C, P, M, N, K, sam, ssam, ssak, sbn, scm, scn,
                       A_SCALE_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, B_TMA: tl.constexpr, A_STAGED: tl.constexpr,
                       ACC_IN: tl.constexpr, FINAL: tl.constexpr, USE_ASM: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, ROUND: tl.constexpr = 0):
    """C[M, N] = A[M, K] · B[N, K]ᵀ (B staged fp16), scaled in the epilogue. A is packed NVFP4 and
    dequantized here, or with A_STAGED staged fp16 like B (then read through TMA when B_TMA).
    Split along K: ACC_IN adds the fp32 partial sums in P [M, N] (contiguous) to this launch's, and a
    launch that is not FINAL writes its unscaled sums back to P instead of C. ROUND (round_code): C's values
    rounded to bf16 or fp16 first, for a wider C that holds what a 16-bit C and its widening would."""
    pid_m, pid_n = grouped_tile(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rb = tl.arange(0, BK // 2)
    rs = tl.arange(0, BK // 16)
    rk = tl.arange(0, BK)
    mask_m = rm < M
    mask_n = rn < N
    a_ptr = A + rm[:, None].to(tl.int64) * sam + rb[None, :]
    sa_ptr = SA + (rm // A_SCALE_DIV)[:, None].to(tl.int64) * ssam + rs[None, :] * ssak
    b_ptr = B + rn[:, None].to(tl.int64) * sbn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a16_ptr = A + rm[:, None].to(tl.int64) * sam + rk[None, :]
    for k0 in range(0, K, BK):
        if A_STAGED:
            if B_TMA:
                a = a_desc.load([pid_m * BM, k0])
            else:
                a = tl.load(a16_ptr, mask=mask_m[:, None] & (k0 + rk < K)[None, :], other=0.0)
        else:
            raw = tl.load(a_ptr, mask=mask_m[:, None] & (k0 // 2 + rb < K // 2)[None, :], other=0)
            sa = tl.load(sa_ptr, mask=mask_m[:, None] & (k0 // 16 + rs < K // 16)[None, :], other=0.0)
            a = _dequant_a(raw, e4m3_value(sa, tl.float16), BM, BK, USE_ASM)
        if B_TMA:
            b = b_desc.load([pid_n * BN, k0])
        else:
            b = tl.load(b_ptr, mask=mask_n[:, None] & (k0 + rk < K)[None, :], other=0.0)
        acc = tl.dot(a, b.T, acc)
        a_ptr += BK // 2
        sa_ptr += (BK // 16) * ssak
        a16_ptr += BK
        b_ptr += BK

    if not A_STAGED:
        acc = acc * 16384.0  # 2^14 undoes the 2^-14 of A dequantized in registers, exactly
    mask = mask_m[:, None] & mask_n[None, :]
    p_ptr = P + rm[:, None].to(tl.int64) * N + rn[None, :]
    if ACC_IN:
        acc = tl.load(p_ptr, mask=mask, other=0.0) + acc
    if FINAL:
        out = acc * (tl.load(GSA) * tl.load(GSB))
        if HAS_BIAS:
            out = out + tl.load(BIAS + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        c_ptr = C + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
        tl.store(c_ptr, _rounded(out, ROUND).to(C.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr, acc, mask=mask)


# restore_value: benchmarking runs each config several times, and a K-split launch that adds into the
# partial sums P must not see its own earlier runs
_nvfp4_gemm_autotuned = autotune(_configs(), key=["M", "N", "K", "A_SCALE_DIV", "B_TMA", "A_STAGED"],
                                        restore_value=["P"], prune_configs_by={"early_config_prune": tma_tiles_fit}
                                        )(_nvfp4_gemm_kernel)

#: Fixed tiles for small problems on a GPU (autotuning there would only cost time).
SMALL_TILES = {"BM": 32, "BN": 32, "BK": 32, "GROUP_M": 4}
#: Fixed tiles in Triton's CPU interpreter, which pays per program and per operation, not per element: a
#: test shape takes a few programs (partial tiles still occur along every dim at the tests' shapes).
INTERPRETER_TILES = {"BM": 64, "BN": 64, "BK": 64, "GROUP_M": 4}


def fixed_tiles(t: torch.Tensor) -> dict:
    """The fixed (not autotuned) tiles of a GEMM whose operand is ``t``: SMALL_TILES on a GPU, else the interpreter's."""
    return SMALL_TILES if t.is_cuda else INTERPRETER_TILES


@triton.jit
def _nvfp4_gemm_persistent_kernel(A, B, C, GSA, GSB, BIAS, M, N, K, sam, sbn, scm,
                                  HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                  GROUP_M: tl.constexpr, SUBTILE: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                  ROUND: tl.constexpr = 0):
    """C[M, N] = (A[M, K] · B[N, K]ᵀ)·gs_A·gs_B [+ bias] for staged fp16 A and B, all three through TMA
    descriptors built on the device (no host descriptor objects per launch: they cost more host time
    than the kernel launch itself). Out-of-range rows and columns load as zeros and are not stored.
    Program p takes tiles p, p + NUM_PROGRAMS, ... (swizzle_tile order). SUBTILE stores C as two
    [BM, BN/2] halves."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[sam, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[sbn, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[scm, 1],
                                       block_shape=[BM, BN // 2] if SUBTILE else [BM, BN])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    gs = tl.load(GSA) * tl.load(GSB)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = swizzle_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        out = acc * gs
        if HAS_BIAS:
            rn = pid_n * BN + tl.arange(0, BN)
            out = out + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = _rounded(out, ROUND)
        if SUBTILE:
            left, right = tl.split(tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BM, pid_n * BN], left.to(c_desc.dtype))
            c_desc.store([pid_m * BM, pid_n * BN + BN // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([pid_m * BM, pid_n * BN], out.to(c_desc.dtype))


def _persistent_configs():
    # the best persistent variants (plain, split-store, double-buffered) on an H100 at 8192³ and the Linear shapes
    return [triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "SUBTILE": sub}, num_warps=w, num_stages=st)
            for bm, bn, w, st, sub in ((128, 256, 8, 3, False), (128, 256, 8, 3, True), (128, 256, 8, 4, True),
                                       (128, 128, 4, 4, False))]


_nvfp4_gemm_persistent_autotuned = autotune(_persistent_configs(),
                                                   key=["M", "N", "K", "HAS_BIAS"])(_nvfp4_gemm_persistent_kernel)


@triton.jit
def _dequant_kernel(D, S, OUT, R, C, sdr, ssr, ssc, sor, TUNE_R, TUNE_C, SCALE_DIV: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr):
    """OUT [R, C] fp16 = q·e_b of packed D [R, C/2] with scales S (row r uses scale row r // SCALE_DIV).
    OUT is written as int32 words, one per packed byte: (fp16 of the high nibble) << 16 | (low nibble).
    TUNE_R, TUNE_C: R and C as the autotuner keys on them (launch.tune_bucket), not read here."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rb = tl.program_id(1) * BC + tl.arange(0, BC)  # packed byte columns
    mask = (rr < R)[:, None] & (rb < C // 2)[None, :]
    raw = tl.load(D + rr[:, None].to(tl.int64) * sdr + rb[None, :], mask=mask, other=0)
    s = tl.load(S + (rr // SCALE_DIV)[:, None].to(tl.int64) * ssr + (rb // 8)[None, :] * ssc, mask=mask, other=0.0)
    s = e4m3_value(s) * 16384.0  # the codes below carry 2^-14; fold 2^14 into the (exact) scale
    lo, hi = _nibbles_fp16(raw)
    lo, hi = lo.to(tl.float32) * s, hi.to(tl.float32) * s
    lo16 = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi16 = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(OUT + rr[:, None].to(tl.int64) * sor + rb[None, :], (lo16 | (hi16 << 16)).to(tl.int32, bitcast=True),
             mask=mask)


_dequant_autotuned = autotune(
    [triton.Config({"BR": br, "BC": bc}, num_warps=w)
     for br, bc, w in ((16, 256, 4), (32, 256, 8), (16, 512, 8), (64, 128, 8), (32, 128, 4))],
    key=["TUNE_R", "TUNE_C", "SCALE_DIV"])(_dequant_kernel)  # R, C as launch.tune_bucket rounds them


def _scale_div(t: NVFP4Tensor) -> int:
    return 16 if tuple(t.block_shape) == (16, 16) else 1


def dequantize_fp16(t: NVFP4Tensor, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
    """fp16 [R, C] of q·e_b (no global scale) over storage rows ``rows`` and columns ``cols`` (whole
    16-blocks): exact (see module doc)."""
    r0, r1 = (0, t.storage_shape[0]) if rows is None else (rows.start, rows.stop)
    c0, c1 = (0, t.storage_shape[1]) if cols is None else (cols.start, cols.stop)
    R, C = r1 - r0, c1 - c0
    div = _scale_div(t)
    if r0 % div or c0 % 16 or C % 16:
        raise ValueError(f"dequantize_fp16: rows from {r0} / columns {c0}:{c1} split a scale block")
    out = torch.empty((R, C), dtype=torch.float16, device=t.data.device)
    if R and C:
        data, scale = t.data[r0:r1, c0 // 2:c1 // 2], t.scale[r0 // div:, c0 // 16:]
        words = out.view(torch.int32)  # [R, C/2]: one word per packed byte
        args = (data, scale, words, R, C, data.stride(0), scale.stride(0), scale.stride(1), words.stride(0),
                tune_bucket(R), tune_bucket(C))
        if data.is_cuda and not interpreting() and R * C >= 2**22:
            grid = lambda meta: (cdiv(R, meta["BR"]), cdiv(C // 2, meta["BC"]))  # noqa: E731
            launch(_dequant_autotuned, grid, *args, SCALE_DIV=div)
        else:
            BR, BC = (16, 256) if data.is_cuda else (16, 32)
            launch(_dequant_kernel, (cdiv(R, BR), cdiv(C // 2, BC)), *args, SCALE_DIV=div, BR=BR, BC=BC,
                   num_warps=4)
    return out


def tma_supported(x: torch.Tensor) -> bool:
    """TMA descriptors on this tensor's device: NVIDIA sm_90+."""
    return x.is_cuda and torch.version.hip is None and capability(x.device)[0] >= 9


def _use_asm(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.version.hip is None


def tma_descriptor(t: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor
    tiles = fixed_tiles(t)
    block = [tiles["BN"], tiles["BK"]]  # autotuning sets each config's tile shape
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _launch_gemm(autotune: bool, args: tuple, kw: dict) -> None:
    m, n = args[10], args[11]
    if autotune:
        grid = lambda meta: (cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]),)  # noqa: E731
        launch(_nvfp4_gemm_autotuned, grid, *args, **kw)
    else:
        tiles = fixed_tiles(args[0])
        launch(_nvfp4_gemm_kernel, (cdiv(m, tiles["BM"]) * cdiv(n, tiles["BN"]),), *args, **kw, **tiles)


def persistent_programs(t: torch.Tensor) -> int:
    """Programs of a persistent launch: one per SM (a few in the interpreter)."""
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda else 4


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_storable(c: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride and a contiguous last dim."""
    size = c.element_size()
    return c.stride(1) == 1 and (c.stride(0) * size) % 16 == 0 and c.data_ptr() % 16 == 0


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for device-side TMA descriptors (Triton asks for it at launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator(t: torch.Tensor) -> None:
    """Device-side descriptors need Triton's launch-time allocator on CUDA (the interpreter needs none).
    Triton keeps it in a ContextVar, so each thread (autograd runs backward in its own) starts without
    one: set ours where none is set, and leave a caller's own allocator alone."""
    if not t.is_cuda:
        return
    try:
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except AttributeError:  # another Triton layout: set it (a launch without one fails)
        unset = True
    if unset:
        triton.set_allocator(_scratch)


def _launch_persistent(autotune: bool, a16: torch.Tensor, b16: torch.Tensor, gsa, gsb, bias, c: torch.Tensor, *,
                       rnd: int = 0) -> None:
    """C = (a16 · b16ᵀ)·gs_A·gs_B [+ bias] with the persistent TMA kernel (both operands staged fp16); ``rnd``: the
    kernel's ROUND."""
    M, K = a16.shape
    N = b16.shape[0]
    progs = persistent_programs(a16)
    ensure_scratch_allocator(a16)
    args = (a16, b16, c, gsa, gsb, bias if bias is not None else gsa, M, N, K, a16.stride(0), b16.stride(0),
            c.stride(0))
    if autotune:
        grid = lambda meta: (min(progs, cdiv(M, meta["BM"]) * cdiv(N, meta["BN"])),)  # noqa: E731
        launch(_nvfp4_gemm_persistent_autotuned, grid, *args, HAS_BIAS=bias is not None, NUM_PROGRAMS=progs,
               ROUND=rnd)
    else:
        tiles = fixed_tiles(a16)
        grid = (min(progs, cdiv(M, tiles["BM"]) * cdiv(N, tiles["BN"])),)
        launch(_nvfp4_gemm_persistent_kernel, grid, *args, HAS_BIAS=bias is not None, SUBTILE=False,
               NUM_PROGRAMS=progs, ROUND=rnd, **tiles)


def _chunks(rows: int, K: int):
    """Row ranges whose fp16 staging fits STAGE_BYTES (multiples of 256 rows: whole 16x16 blocks)."""
    step = max(256, (STAGE_BYTES // (2 * K)) // 256 * 256)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _stage(t: NVFP4Tensor | StagedOperand, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
    """An operand's fp16 values over storage rows/columns: a view when the quantization kernel staged
    it already."""
    if isinstance(t, StagedOperand):
        return t.values[rows if rows is not None else slice(None), cols if cols is not None else slice(None)]
    return dequantize_fp16(t, rows, cols)


def nvfp4_gemm_triton(a: NVFP4Tensor | StagedOperand, b: NVFP4Tensor | StagedOperand, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None, autotune: bool | None = None,
                      use_tma: bool | None = None, stage_a: bool | None = None,
                      round_to: torch.dtype | None = None) -> torch.Tensor:
    """out [M, N] = Σ_k A[m, k] B[n, k] over the storages of a and b (contraction along their rows).
    ``stage_a``: stage A as fp16 too instead of dequantizing it in registers (default STAGE_A); an
    operand that comes staged (StagedOperand) is read as it is. ``round_to``: bf16 or fp16, the values of a
    wider ``out_dtype`` rounded to it first (a 16-bit result and its widening, in one store)."""
    M, K = a.storage_shape
    N, Kb = b.storage_shape
    if K != Kb:
        raise ValueError(f"NVFP4 GEMM contraction mismatch: {a.storage_shape} vs {b.storage_shape}")
    pre_staged = isinstance(a, StagedOperand)
    check_bias(bias, N, (a.values if pre_staged else a.data).device)  # the kernels read N values at stride 1
    bias = bias.contiguous() if bias is not None else None
    a_data = a.values if pre_staged else a.data
    a_scale = a.values if pre_staged else a.scale  # a placeholder argument when A is staged
    b_data = b.values if isinstance(b, StagedOperand) else b.data
    for t, name in ((a_data, "A"), (b_data, "B")):
        if t.stride(1) != 1:
            raise ValueError(f"NVFP4 GEMM operand {name}: packed codes must be contiguous along K")
    out = torch.empty((M, N), dtype=out_dtype, device=a_data.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.copy_(bias.to(round_to or out_dtype).to(out_dtype).expand(M, N) if bias is not None
                  else torch.zeros_like(out))
        return out
    if autotune is None:
        autotune = a_data.is_cuda and not interpreting() and M * N >= 128 * 128
    if use_tma is None:
        use_tma = tma_supported(a_data)
    if stage_a is None or pre_staged:
        stage_a = STAGE_A or pre_staged
    gsa = a.global_scale.reshape(1).float()
    gsb = b.global_scale.reshape(1).float()
    rnd = ROUND_CODES[round_to]
    kw = dict(A_SCALE_DIV=1 if pre_staged else _scale_div(a), HAS_BIAS=bias is not None, B_TMA=use_tma,
              A_STAGED=stage_a, USE_ASM=_use_asm(a_data) and not interpreting(), ROUND=rnd)
    b_pre = isinstance(b, StagedOperand)
    if (stage_a and not (pre_staged and b_pre) and K >= max(M, N)
            and STAGE_BYTES // (2 * K) < min(MIN_CHUNK_ROWS, max(M, N))):
        # wgrad-like (long contraction, small output): row chunks would give launches of a few tiles,
        # so split K instead and carry fp32 partial sums in a [M, N] buffer (whose traffic grows with
        # the number of K chunks: hence only when the row chunks would be that small)
        kc = max(256, (STAGE_BYTES // (2 * max(M, N))) // 256 * 256)
        part = torch.empty((M, N), dtype=torch.float32, device=out.device)
        for k0 in range(0, K, kc):
            k1 = min(K, k0 + kc)
            a16, b16 = _stage(a, cols=slice(k0, k1)), _stage(b, cols=slice(k0, k1))
            a_arg, b_arg = (tma_descriptor(a16), tma_descriptor(b16)) if use_tma else (a16, b16)
            _launch_gemm(autotune, (a16, a_scale, a_arg, b16, b_arg, gsa, gsb, bias if bias is not None else out,
                                    out, part, M, N, k1 - k0, a16.stride(0), a_scale.stride(0), a_scale.stride(1),
                                    b16.stride(0), out.stride(0), out.stride(1)),
                         dict(kw, ACC_IN=k0 > 0, FINAL=k1 == K))
            del a16, b16, a_arg, b_arg
        return out
    persistent = use_tma and stage_a  # both operands staged, TMA available: the persistent kernel
    # Staged chunks: the operand with fewer restaging bytes goes in the inner loop. One chunk of each
    # operand is alive at a time.
    # (an operand that arrives staged is one chunk: its buffer exists already)
    a_rows = _chunks(M, K) if stage_a and not pre_staged else [(0, M)]
    b_rows = _chunks(N, K) if not b_pre else [(0, N)]
    a_outer = stage_a and len(a_rows) * N < len(b_rows) * M
    pairs = [(ar, br) for ar in a_rows for br in b_rows] if a_outer else [(ar, br) for br in b_rows for ar in a_rows]
    a_cur = b_cur = None
    for (m0, m1), (n0, n1) in pairs:
        if b_cur is None or b_cur[0] != n0:
            b_cur = None
            b16 = _stage(b, slice(n0, n1))
            b_cur = (n0, b16, tma_descriptor(b16) if use_tma and not persistent else b16)
        if stage_a and (a_cur is None or a_cur[0] != m0):
            a_cur = None
            a16 = _stage(a, slice(m0, m1))
            a_cur = (m0, a16, tma_descriptor(a16) if use_tma and not persistent else a16)
        _, b16, b_arg = b_cur
        a_src, a_arg = (a_cur[1], a_cur[2]) if stage_a else (a_data, b_arg)
        bias_t = bias[n0:n1].contiguous() if bias is not None else out
        tile = out[m0:m1, n0:n1]
        if persistent and tma_storable(tile) and tma_storable(a_src) and tma_storable(b16):  # else plain loads
            _launch_persistent(autotune, a_src, b16, gsa, gsb, bias_t if bias is not None else None, tile, rnd=rnd)
            continue
        if persistent:  # C cannot take a TMA store: the tile kernel, still with TMA loads
            a_arg, b_arg = tma_descriptor(a_src), tma_descriptor(b16)
        _launch_gemm(autotune, (a_src, a_scale, a_arg, b16, b_arg, gsa, gsb, bias_t, tile, tile, m1 - m0, n1 - n0, K,
                                a_src.stride(0), a_scale.stride(0), a_scale.stride(1), b16.stride(0), tile.stride(0),
                                tile.stride(1)), dict(kw, ACC_IN=False, FINAL=True))
        del b16, b_arg, a_src, a_arg
    return out
