"""An independent NumPy twin of the NVFP4 quantizer, for tests only.

It follows the same published Transformer Engine arithmetic as titan_nvfp4.numerics.nvfp4 but is
written differently: NumPy float32 scalars instead of torch ops, the E4M3 rounding done by brute
force over all 127 finite positive E4M3 values, and the E2M1 rounding by nearest-grid search with an
explicit even-mantissa tie rule. Agreement of the two is evidence that neither has a slip.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def _e4m3_values() -> np.ndarray:
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8.0) * 2.0**-6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
            vals.append(v)
    return np.array(vals, dtype=np.float64)  # index == byte value for bytes 0..126


E4M3 = _e4m3_values()


def e4m3_byte(v: float) -> int:
    """Round-to-nearest-even onto E4M3 (saturating at 448), returned as the byte value."""
    if np.isnan(v):
        return 0x7F
    v = min(float(v), 448.0)
    d = np.abs(E4M3 - v)
    best = np.flatnonzero(d == d.min())
    if len(best) == 2:  # a tie: the even mantissa (even byte, since mantissa is the low bits)
        return int(best[0] if best[0] % 2 == 0 else best[1])
    return int(best[0])


def e2m1_code(v: float) -> int:
    """Nearest-even E2M1 code of v (sign in bit 3), saturating at 6."""
    s = 8 if np.signbit(v) else 0
    a = min(abs(float(v)), 6.0)
    d = np.abs(E2M1 - a)
    best = np.flatnonzero(d == d.min())
    if len(best) == 2:
        idx = best[0] if best[0] % 2 == 0 else best[1]  # even code index == even mantissa bit
    else:
        idx = best[0]
    return int(idx) | s


def quantize_blocks(x: np.ndarray, block_amax_of, amax: float | None = None):
    """Quantize 2D fp32 x (rows hold the 16-blocks). block_amax_of(r, c) gives a block's amax.

    Returns (codes uint8 (rows, cols), scale bytes (rows, cols/16), decode scale 1/S)."""
    x = x.astype(np.float32)
    rows, cols = x.shape
    amax = F32(np.abs(x).max()) if amax is None else F32(amax)
    s_enc = F32(F32(2688.0) / amax) if amax != 0 else F32(1.0)
    if not np.isfinite(s_enc):
        s_enc = F32(np.finfo(np.float32).max)
    inv6 = F32(1.0) / F32(6.0)
    s_dec = F32(F32(1.0) / s_enc)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=np.uint8)
    for r in range(rows):
        for c in range(cols // 16):
            bamax = F32(block_amax_of(r, c))
            byte = e4m3_byte(F32(bamax * F32(s_enc * inv6)))
            scales[r, c] = byte
            e = F32(E4M3[byte])
            rcp = F32(F32(1.0) / F32(e * s_dec)) if e != 0 else F32(np.finfo(np.float32).max)
            for k in range(16):
                codes[r, 16 * c + k] = e2m1_code(F32(x[r, 16 * c + k] * rcp))
    return codes, scales, s_dec


def quantize_1x16(x: np.ndarray, amax: float | None = None):
    blk = np.abs(x.astype(np.float32)).reshape(x.shape[0], -1, 16).max(-1)
    return quantize_blocks(x, lambda r, c: blk[r, c], amax)


def quantize_16x16(x: np.ndarray, amax: float | None = None):
    rows, cols = x.shape
    tiles = np.abs(x.astype(np.float32)).reshape(rows // 16, 16, cols // 16, 16).max(axis=(1, 3))
    return quantize_blocks(x, lambda r, c: tiles[r // 16, c], amax)
