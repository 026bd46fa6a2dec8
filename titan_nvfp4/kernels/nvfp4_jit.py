"""Triton device functions for NVFP4: the same fp32 steps as titan_nvfp4/numerics, element by element.

Each function here has a twin in the reference (named in its docstring); the kernel tests check the
pair bit for bit. Shared by the quantization kernels (quantize.py) and the GEMM (gemm.py).
"""

import triton
import triton.language as tl

from .platform import interpreting

E4M3_MAX = tl.constexpr(448.0)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
# Triton's CPU interpreter decodes E4M3 NaN (0x7F, 0xFF) as ±480; compiled kernels decode it as NaN
INTERPRETED = tl.constexpr(interpreting())


@triton.jit
def e4m3_value(e, dt: tl.constexpr = tl.float32):
    """E4M3 scales e (float8e4nv) as dtype dt, NaN kept NaN also in the interpreter (INTERPRETED; a
    compiled kernel gets the bare conversion)."""
    v = e.to(dt)
    if INTERPRETED:
        v = tl.where((e.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def nan_to_inf_abs(x):
    """|x| with NaN mapped to +inf, so that max-reductions flag non-finite blocks reliably
    (Triton's max does not promise NaN propagation)."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def global_encode_scale(amax, FOUR_OVER_SIX: tl.constexpr = False):
    """Twin of numerics.nvfp4.global_encode_scale: S = min(2688 / amax, FP32_MAX) (1536 / amax with
    FOUR_OVER_SIX); 1 if amax == 0; NaN if amax is not finite (amax == +inf here, see nan_to_inf_abs)."""
    top: tl.constexpr = 1536.0 if FOUR_OVER_SIX else 2688.0
    s = tl.minimum(tl.math.div_rn(tl.full(amax.shape, top, tl.float32), amax), FP32_MAX)
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where(amax == float("inf"), float("nan"), s)


@triton.jit
def e4m3_round(v):
    """Round non-negative fp32 v <= 448 to the nearest-even E4M3 value, as fp32. Done by hand because
    the hardware-free paths (sm_80 emulation, the CPU interpreter) do not all round fp32 -> e4m3
    correctly at mantissa carries."""
    bits = v.to(tl.int32, bitcast=True)
    # normals: round the 23-bit mantissa to 3 bits, ties to even; a carry bumps the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormals (below 2^-6): multiples of 2^-9, rounded by an fp32 add of 1.5·2^14 (ties to even)
    magic = 24576.0
    sub = (v + magic) - magic
    return tl.where(v < 0.015625, sub, normal)


@triton.jit
def e4m3_round_up(v):
    """Twin of formats.to_e4m3_round_up for non-negative fp32 v <= 448: the smallest E4M3 value >= v, as
    fp32. e4m3_round, then one E4M3 step up where that rounded down: 2⁻⁹ below 2⁻⁶ (0 included), else
    one unit of the 3-bit mantissa (a carry bumps the exponent). Never past 448: 448 >= v."""
    r = e4m3_round(v)
    up = tl.where(r < 0.015625, r + 0.001953125, (r.to(tl.int32, bitcast=True) + 0x100000).to(tl.float32, bitcast=True))
    return tl.where(r < v, up, r)


@triton.jit
def block_scales(block_amax, s_enc, TO_FOUR: tl.constexpr = False, UP: tl.constexpr = False):
    """Twin of block_decode_scale + block_encode_factor (TO_FOUR: the block max scaled to 4, Four Over
    Six's second candidate; UP: the scale rounded up, sr_block_scale = "up"). block_amax uses
    nan_to_inf_abs; s_enc is the tensor's encode scale (a scalar, so 1/s_enc is one division per
    program, not per block). Returns (e_b as float8e4nv, r_b fp32)."""
    s_dec = tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    mult: tl.constexpr = 0.25 if TO_FOUR else 0.1666666716337204  # fp32(1/6), as the reference uses
    v = block_amax * (s_enc * mult)
    if UP:
        e = e4m3_round_up(tl.minimum(v, E4M3_MAX)).to(tl.float8e4nv)
    else:
        e = e4m3_round(tl.minimum(v, E4M3_MAX)).to(tl.float8e4nv)  # exact: the value is already E4M3
    nan = tl.full(block_amax.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)  # E4M3 NaN
    e = tl.where(block_amax == float("inf"), nan, e)
    e = tl.where(s_enc != s_enc, nan, e)
    return e, encode_factor(e4m3_value(e), s_dec)


@triton.jit
def four_over_six_unit(block_amax, s_enc):
    """2¹⁰ / u of Four Over Six's error (numerics.nvfp4.four_over_six_error): u = 2^⌊log₂(amax_b·S)⌋,
    built from the exponent bits (clamped to [10, 253], where 2^(137 - exp) is a normal fp32)."""
    ex = ((block_amax * s_enc).to(tl.int32, bitcast=True) >> 23) & 0xFF
    ex = tl.minimum(tl.maximum(ex, 10), 253)
    return ((264 - ex) << 23).to(tl.float32, bitcast=True)


@triton.jit
def four_over_six_d2(x, s_enc, r, e32, p):
    """One element's D² (int32) of four_over_six_error: D = min(⌊|x·S - g·e_b|·p⌋, 2047), g the
    nearest-even E2M1 magnitude of x·r_b; 0 where the block is not finite (e_b NaN)."""
    a = tl.minimum(tl.abs(x * r), 6.0)
    magic = e2m1_magic(a)
    g = (a + magic) - magic  # exact grid value; g·e_b is exact too, so the subtraction rounds once
    t = tl.minimum(tl.abs(tl.abs(x) * s_enc - g * e32) * p, 2047.0)
    d = tl.where(t == t, t, 0.0).to(tl.int32)
    return d * d


@triton.jit
def pick_four_or_six(e6, r6, e4, r4, err6, err4):
    """Four Over Six's choice (twin of four_over_six_scales): the "4" scale where it is not 0 and its
    error is strictly lower. Returns (e_b float8e4nv, r_b fp32)."""
    four = (e4m3_value(e4) != 0.0) & (err4 < err6)
    e = tl.where(four, e4.to(tl.uint8, bitcast=True), e6.to(tl.uint8, bitcast=True)).to(tl.float8e4nv, bitcast=True)
    return e, tl.where(four, r4, r6)


@triton.jit
def four_over_six_scales16(xs, block_amax, s_enc, UP: tl.constexpr = False):
    """Twin of numerics.nvfp4.four_over_six_scales (plus the encode factor) for 16-element blocks
    across a 16-tuple of tiles (tile i = element i of each block); UP: both candidates rounded up.
    Returns (e_b, r_b) as block_scales."""
    e6, r6 = block_scales(block_amax, s_enc, UP=UP)
    e4, r4 = block_scales(block_amax, s_enc, TO_FOUR=True, UP=UP)
    p = four_over_six_unit(block_amax, s_enc)
    f6 = e4m3_value(e6)
    f4 = e4m3_value(e4)
    err6 = four_over_six_d2(xs[0], s_enc, r6, f6, p)
    err4 = four_over_six_d2(xs[0], s_enc, r4, f4, p)
    for i in tl.static_range(1, 16):
        err6 += four_over_six_d2(xs[i], s_enc, r6, f6, p)
        err4 += four_over_six_d2(xs[i], s_enc, r4, f4, p)
    return pick_four_or_six(e6, r6, e4, r4, err6, err4)


@triton.jit
def encode_factor(e32, s_dec):
    """Twin of block_encode_factor: r_b = min(1 / (e_b · s_dec), FP32_MAX) for the decoded E4M3 scales
    e32 and the tensor's decode scale s_dec = 1/S; NaN for non-finite blocks, as the reference's clamp."""
    return tl.minimum(tl.math.div_rn(tl.full(e32.shape, 1.0, tl.float32), e32 * s_dec), FP32_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _range_bits(a):
    """fp32 bits of max(2^⌊log₂ a⌋, 1) for a ∈ [0, 6]: 1, 2 or 4, the E2M1 range R = 0, 1, 2 whose grid
    step is 2^R / 2."""
    return tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)


@triton.jit
def _with_sign_of(g, v):
    """g ≥ 0 (fp32) with the sign bit of v (-0 included)."""
    return (g.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_magic(a):
    """2²²·max(2^⌊log₂ a⌋, 1) for a ∈ [0, 6]: adding it rounds a to its E2M1 grid step (0.5 below 2,
    1 below 4, 2 from 4), nearest-even, in one fp32 add; even multiples of the step are the even codes."""
    return _range_bits(a).to(tl.float32, bitcast=True) * 4194304.0  # a multiply: it fuses into the add


@triton.jit
def e2m1_code(v):
    """Twin of formats.e2m1_encode_rne for non-NaN v (NaN: any code; callers mask non-finite blocks),
    as uint8 (e2m1_nibble)."""
    return e2m1_nibble(v).to(tl.uint8)


@triton.jit
def e2m1_nibble(v):
    """The nearest-even E2M1 code of non-NaN v as an int32 holding 0-15 (sign in bit 3). The add
    rounds a = min(|v|, 6) on its grid step with a magic 6 steps past 2²²·2^R (R the range of
    e2m1_magic; an even offset keeps ties-to-even), so f's bits are base_R + 6 + k with k the rounded
    a in steps, and (f + (f >> 22)) & 7 = k + 2R: the 6 cancels base_R >> 22 ≡ 2 (mod 8). Five
    instructions and the sign's two; no compares, no float-to-int conversion."""
    a = tl.minimum(tl.abs(v), 6.0)
    f = (a + _range_bits(a).to(tl.float32, bitcast=True) * 4194307.0).to(tl.int32, bitcast=True)
    return ((f + (f >> 22)) & 7) | (v.to(tl.uint32, bitcast=True) >> 28).to(tl.int32) & 8


@triton.jit
def nibble_word(ns):
    """8 int32 tiles of nibbles 0-15 -> the int32 tile whose bits 4j..4j+3 hold ns[j]: 8 codes packed
    as the bytes of formats.pack_nibbles, element 2j in the low nibble of byte j (little-endian).
    Folded in code order, so that each code can be packed as soon as it exists."""
    w = ns[0]
    for j in tl.static_range(1, 8):
        w = add_nibble(w, ns[j], j)
    return w


@triton.jit
def add_nibble(w, n, j: tl.constexpr):
    """w with nibble n (0-15) placed in bits 4j..4j+3, which must be clear: one shift-add (LEA)."""
    return w + (n << (4 * j))


@triton.jit
def words_along_slices(lo, hi):
    """Packed codes of 16-blocks running along G (lo, hi: [G, C] words of elements 0-7 and 8-15, as
    nibble_word) -> [C, 2G] words: row c holds the 16·G codes of column c in order (8 bytes per block)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2)), (lo.shape[1], 2 * lo.shape[0]))


@triton.jit
def e2m1_staged(v, e32):
    """q·e_b as fp32 for the E2M1 value q = rne(v) (sign kept, -0 included) and the block's decoded E4M3
    scale e32 (twin of formats.e2m1_decode of the code, times e_b), without forming the code. Exact."""
    a = tl.minimum(tl.abs(v), 6.0)
    magic = e2m1_magic(a)
    g = (a + magic) - magic  # the grid value, exactly
    return _with_sign_of(g, v) * e32


@triton.jit
def e2m1_stochastic_code(v, r):
    """Twin of formats.e2m1_encode_stochastic for non-NaN v (NaN: any code; callers mask non-finite
    blocks) and 8 random bits r (int32 in [0, 2⁸)), as uint8 (e2m1_stochastic_nibble)."""
    return e2m1_stochastic_nibble(v, r).to(tl.uint8)


@triton.jit
def e2m1_stochastic_nibble(v, r):
    """e2m1_stochastic_code as an int32 holding 0-15 (as e2m1_nibble): the k grid steps of
    _stochastic_bits sit in bits 8-10 of its word, and the code is k + 2R, R the range of p."""
    f, p = _stochastic_bits(v, r)
    return (((f >> 8) & 7) + (p >> 22) - 254) | (v.to(tl.int32, bitcast=True) >> 28) & 8


@triton.jit
def _stochastic_bits(v, r):
    """(f, p): |v| (saturated at 6) rounded stochastically on its E2M1 grid, as the fp32 bits f of
    c + k·step with c = 2¹⁵·step, p the bits of the range's 2^R (the step is 2^R / 2). Adding c to a
    fixes a in units of step·2⁻⁸ (nearest-even: the reference's F = rne(2⁸·frac)); adding the
    random r and clearing the low 8 bits then rounds up exactly when F + r ≥ 2⁸, with probability
    F / 2⁸. Four integer and two float instructions, no compares."""
    a = tl.minimum(tl.abs(v), 6.0)
    p = _range_bits(a)
    f = (a + p.to(tl.float32, bitcast=True) * 16384.0).to(tl.int32, bitcast=True)  # p·2¹⁴ exact: one FFMA
    return (f + r) & -256, p


@triton.jit
def e2m1_stochastic_staged(v, r, e32):
    """q·e_b as fp32 for q = e2m1_stochastic_code(v, r) (as e2m1_staged for nearest-even). Exact:
    f - c is k·step, both in one binade."""
    f, p = _stochastic_bits(v, r)
    g = f.to(tl.float32, bitcast=True) - p.to(tl.float32, bitcast=True) * 16384.0
    return _with_sign_of(g, v) * e32


@triton.jit
def pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """[R, C] uint8 codes to [R, C // 2] bytes, element 2i in the low nibble (twin of pack_nibbles)."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return lo | (hi << 4).to(tl.uint8)


@triton.jit
def rht16_slices(xs, SIGNS, SCALE: tl.constexpr = True):
    """Twin of numerics.rht.rht across a 16-tuple of equally shaped tiles (tile i = element i of each
    block): sign flip, butterfly stages h = 1, 2, 4, 8 (i meets i + h: a + b, a - b), * 0.25, then
    rounding to SIGNS' dtype when that is bf16 or fp16. Every stage is elementwise between tiles, so no
    data moves between threads. SCALE=False leaves out the * 0.25 and the rounding, for a caller that only
    takes a max (and applies both to it): rounding is monotone, so max|r(0.25·y)| = r(0.25·max|y|)."""
    ys = ()
    for i in tl.static_range(16):
        ys = ys + (xs[i] * tl.load(SIGNS + i),)
    for stage in tl.static_range(4):  # h = 2^stage
        zs = ()
        for i in tl.static_range(16):
            if (i >> stage) % 2 == 0:
                zs = zs + (ys[i] + ys[i + (1 << stage)],)
            else:
                zs = zs + (ys[i - (1 << stage)] - ys[i],)
        ys = zs
    if not SCALE:
        return ys
    out = ()
    for i in tl.static_range(16):
        out = out + (round_to(ys[i] * 0.25, SIGNS.dtype.element_ty, False),)
    return out


@triton.jit
def round_to(x, dt: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 x rounded to dtype dt (nearest-even), still as fp32: the hardware conversion (``NATIVE``),
    or for bf16 by its bits, since the interpreter's own float-to-bf16 conversion truncates; fp32 x as it is."""
    if NATIVE:
        return x.to(dt).to(tl.float32)
    elif dt == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        r = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x == x, r, x)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def amax16(xs):
    """Elementwise max of |x| over a 16-tuple of tiles, NaN mapped to +inf (as nan_to_inf_abs): one
    NaN-propagating max per element, the mapping once per result."""
    m = tl.abs(xs[0])
    for i in tl.static_range(1, 16):
        m = tl.maximum(m, tl.abs(xs[i]), propagate_nan=tl.PropagateNan.ALL)
    return tl.where(m == m, m, float("inf"))


@triton.jit
def random8x16(seed, counter):
    """16 tiles of 8 random bits each (int32 in [0, 2⁸)) from one Philox call at ``counter``, which
    must be unique per tile element: the four bytes of each of its four words, low byte first. Eight
    bits per element is what Blackwell's cvt.rs.satfinite.e2m1x4.f32 takes (one 32-bit word for four
    values)."""
    words = philox4x32(seed, counter)
    out = ()
    for w in tl.static_range(4):
        r = words[w].to(tl.int32, bitcast=True)
        out = out + (r & 0xFF, (r >> 8) & 0xFF, (r >> 16) & 0xFF, (r.to(tl.uint32, bitcast=True) >> 24).to(tl.int32))
    return out


@triton.jit
def philox4x32(seed, counter):
    """Philox4x32-10 of (counter, 0, 0, 0) under the 64-bit key ``seed``: the same four words as
    tl.randint4x(seed, counter) (tests/test_kernels.py checks it), with each round's two products
    formed by one 32×32→64-bit multiply each instead of separate high and low multiplies."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = counter.to(tl.uint32, bitcast=True)
    c1 = tl.zeros_like(c0)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        hi_b, lo_b = _mul_wide(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul_wide(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _mul_wide(c, m: tl.constexpr):
    """(high, low) 32-bit words of the 64-bit product of uint32 c and the constant m."""
    p = c.to(tl.uint64) * m
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def _scales16(xs, s_enc, FOUR_OVER_SIX: tl.constexpr, UP: tl.constexpr):
    """(e_b, r_b) of 16-element blocks across a 16-tuple of tiles: block_scales of their amax, or Four Over Six's."""
    if FOUR_OVER_SIX:
        e, r = four_over_six_scales16(xs, amax16(xs).to(tl.float32), s_enc, UP=UP)
    else:
        e, r = block_scales(amax16(xs).to(tl.float32), s_enc, UP=UP)
    return e, r


@triton.jit
def quantize_slices16(xs, s_enc, STOCHASTIC: tl.constexpr, seed, counter, STAGED: tl.constexpr = False,
                      FOUR_OVER_SIX: tl.constexpr = False, SR_SCALE_UP: tl.constexpr = False):
    """NVFP4 of 16-element blocks laid out across a 16-tuple of tiles (tile i = element i of each
    block): (out, e4m3 scales, one per tile element). out is 2 int32 tiles, the packed codes of
    elements 0-7 and 8-15 of each block (nibble_word), or with STAGED the 16 tiles of the GEMM's fp16
    values q·e_b (the decoded codes times e_b). Stochastic draws: one Philox call per block at
    ``counter`` (unique per block), a byte per element (random8x16). Codes of a non-finite block are
    0 (the reference's NaN·r). FOUR_OVER_SIX: block scales by Four Over Six (s_enc must then be the
    FOUR_OVER_SIX tensor scale). SR_SCALE_UP (sr_block_scale = "up"): with STOCHASTIC, the block scales
    round up; nearest-even blocks ignore it."""
    if STOCHASTIC and SR_SCALE_UP:
        e, r = _scales16(xs, s_enc, FOUR_OVER_SIX, True)
    else:
        e, r = _scales16(xs, s_enc, FOUR_OVER_SIX, False)
    finite = r == r
    # Ties the counters to the data's register layout (NaN blocks, coded 0 anyway, draw at 0): else
    # Triton computes Philox in the counters' own layout and moves all its random bits between threads.
    counter = tl.where(finite, counter, 0)
    keep = tl.where(finite, -1, 0)  # a whole word of codes at once
    e32 = e4m3_value(e)
    out = ()
    if STOCHASTIC:
        us = random8x16(seed, counter)
    for h in tl.static_range(2):
        ns = ()
        for i in tl.static_range(8):
            if STOCHASTIC and STAGED:
                out = out + (e2m1_stochastic_staged(xs[8 * h + i] * r, us[8 * h + i], e32).to(tl.float16),)
            elif STOCHASTIC:
                ns = ns + (e2m1_stochastic_nibble(xs[8 * h + i] * r, us[8 * h + i]),)
            elif STAGED:
                out = out + (e2m1_staged(xs[8 * h + i] * r, e32).to(tl.float16),)
            else:
                ns = ns + (e2m1_nibble(xs[8 * h + i] * r),)
        if not STAGED:
            out = out + (nibble_word(ns) & keep,)
    return out, e


@triton.jit
def split8(t, R: tl.constexpr, C: tl.constexpr):
    """[R, C, 8] -> its 8 slices [R, C] in order; the 8 are one thread's vector, so no data moves."""
    a, b = tl.split(tl.reshape(t, (R, C, 4, 2)))  # elements 0 2 4 6 | 1 3 5 7
    a0, a1 = tl.split(tl.reshape(a, (R, C, 2, 2)))  # 0 4 | 2 6
    b0, b1 = tl.split(tl.reshape(b, (R, C, 2, 2)))  # 1 5 | 3 7
    s0, s4 = tl.split(a0)
    s2, s6 = tl.split(a1)
    s1, s5 = tl.split(b0)
    s3, s7 = tl.split(b1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def join_slices16(t, R: tl.constexpr, C: tl.constexpr):
    """16-tuple of [R, C] tiles -> [R, C, 16], tile i at index i: joins only add in-thread dims."""
    a = ()
    for i in tl.static_range(8):
        a = a + (tl.join(t[i], t[i + 8]),)  # [.., d0]: tile i + 8·d0
    b = ()
    for i in tl.static_range(4):
        b = b + (tl.join(a[i], a[i + 4]),)  # [.., d0, d1]: tile i + 4·d1 + 8·d0
    c = ()
    for i in tl.static_range(2):
        c = c + (tl.join(b[i], b[i + 2]),)
    return tl.reshape(tl.join(c[0], c[1]), (R, C, 16))  # tile 8·d0 + 4·d1 + 2·d2 + d3
