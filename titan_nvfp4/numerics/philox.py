"""A pure-PyTorch twin of Triton's ``tl.randint(seed, offset)`` (Philox4x32-10), so that a reference quantizer
draws the same random numbers as a kernel (MS-EDEN's scale draws and RHT signs, ms_eden_operand).

``tl.randint`` runs Philox4x32 for 10 rounds on the counter (offset_lo, offset_hi, 0, 0) under the key
(seed_lo, seed_hi) and returns the first word (triton/language/random.py). Here every word is a uint32 held in
an int64 tensor; the 32×32-bit products are formed from 16-bit halves so that nothing overflows int64. Works
on any device, elementwise (no loop over elements), and never reads a device tensor on the host.
"""

from __future__ import annotations

import torch

_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_M32 = 0xFFFFFFFF
_ROUNDS = 10


def _mul_wide(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of the constant m and uint32 c (int64 tensors)."""
    lo = m * (c & 0xFFFF)  # < 2^48
    hi = m * (c >> 16)  # < 2^48
    mid = lo + ((hi & 0xFFFF) << 16)  # < 2^49: the low 48 bits of the product plus carries
    return (hi >> 16) + (mid >> 32), mid & _M32


def _seed_words(seed: torch.Tensor | int, device: torch.device) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """The key (seed_lo, seed_hi) as tl.randint takes it from an int64 seed (two's complement for negatives)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"philox: seed must be an int64 tensor of one element, got {seed.dtype} "
                             f"{tuple(seed.shape)}")
        s = seed.reshape(()).to(device)
        return s & _M32, (s >> 32) & _M32
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
        raise ValueError(f"philox: seed must be an int64 tensor or an integer in [-2**63, 2**64), got {seed!r}")
    return seed & _M32, (seed >> 32) & _M32


def philox_bits(seed: torch.Tensor | int, offsets: torch.Tensor) -> torch.Tensor:
    """tl.randint(seed, offsets) as int64 tensors holding the uint32 words (in [0, 2^32)), elementwise.
    ``offsets``: an integer tensor (int64 offsets use their high word as the second counter word, as
    tl.randint does for a 64-bit offset; smaller ones are below 2^31 and have a zero high word)."""
    if offsets.is_floating_point() or offsets.is_complex():
        raise ValueError(f"philox: offsets must be an integer tensor, got {offsets.dtype}")
    off = offsets.to(torch.int64)
    k0, k1 = _seed_words(seed, off.device)
    c0, c1 = off & _M32, (off >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_wide(_ROUND_B, c2)
        hi_a, lo_a = _mul_wide(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0


def uniform24(bits: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) from 32-bit words: the top 24 bits times 2^-24 (exact in fp32)."""
    return ((bits & _M32) >> 8).to(torch.float32) * 2.0**-24


def philox_signs(seed: torch.Tensor | int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 ±1 [n] from the words at offsets 0..n-1: -1 where the word's top bit (bit 31, the sign of
    tl.randint's value read as int32) is set, +1 elsewhere. On seed's device (a tensor) or ``device``."""
    if device is None:
        device = seed.device if isinstance(seed, torch.Tensor) else "cpu"
    bits = philox_bits(seed, torch.arange(n, dtype=torch.int64, device=device))
    return 1.0 - 2.0 * (bits >> 31).to(torch.float32)


__all__ = ["philox_bits", "philox_signs", "uniform24"]
