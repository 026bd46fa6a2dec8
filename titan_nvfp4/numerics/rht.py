"""The random Hadamard transform (RHT): 16-point on both wgrad operands, and of any power-of-two size
(the length of the sign vector) for MS-EDEN's backward operands (ms_eden.py).

T = Hn · diag(s) / √n is orthonormal (Hn is the ±1 Sylvester Hadamard matrix, s a ±1 sign
vector), so transforming both operands of dW = dYᵀ X along the token dim leaves the product
unchanged while spreading outliers across each n-element block before FP4 quantization.

The transform is defined as a fixed sequence of fp32 operations (sign flip, log2(n) butterfly stages
of a+b / a-b, multiply by the fp32 constant rht_norm(n): exactly 1/4 for n = 16, and exact for every
power of four), so a kernel that performs the same stages gets the same bits. The
signs' dtype is the precision of the output: fp32 signs keep it in fp32; bf16 (or fp16) signs round
it to that dtype, nearest-even, as Transformer Engine does for bf16 operands (the recipe's
``rht_round_to_input_dtype``; signs_for_operand picks the dtype).
"""

from __future__ import annotations

import numbers

import torch

RHT_SIZE = 16


def hadamard_matrix(n: int = RHT_SIZE, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unnormalised ±1 Sylvester Hadamard matrix of order n (a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rht_signs(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A reproducible ±1 fp32 sign vector of length 16 from ``seed`` (same on every rank)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= seed < 2**64:
        raise ValueError(f"rht_signs: seed must be an integer in [-2**63, 2**64), got {seed!r}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (RHT_SIZE,), generator=gen)
    return (1.0 - 2.0 * bits.float()).to(device)


def signs_for_operand(signs: torch.Tensor | None, dtype: torch.dtype, round_to_input: bool) -> torch.Tensor | None:
    """The signs to transform an operand of ``dtype`` with: in that dtype when ``round_to_input`` (so the
    transform's output is rounded to it), else fp32."""
    if signs is None:
        return None
    want = dtype if round_to_input and dtype in (torch.bfloat16, torch.float16) else torch.float32
    return signs if signs.dtype == want else signs.to(want)


def rht_norm(n: int) -> float:
    """1/√n rounded to fp32 (a Python float holding that fp32 value): the transform's last multiply."""
    return float(torch.tensor(n ** -0.5, dtype=torch.float32))


def rht_matrix(signs: torch.Tensor) -> torch.Tensor:
    """The transform as a float64 matrix M with ``rht(x) == x @ M`` on n-blocks, n = len(signs) (for tests)."""
    n = signs.numel()
    return torch.diag(signs.double().cpu()) @ hadamard_matrix(n) * n ** -0.5


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Apply the RHT to consecutive n-element blocks of the last dim of x, n = len(signs) (a power of
    two: 16 for wgrad, up to 128 and more for MS-EDEN); returns fp32.

    Each block b becomes Hn · (s ⊙ b) / √n, computed as sign flip, log2(n) butterfly stages and a
    multiply by rht_norm(n) (exactly 1/4 for n = 16), then rounded to ``signs.dtype`` when that is
    not fp32 (module docstring). Differentiable, unlike the quantizers: autograd gives the exact transposed
    transform (the rounding to 16-bit signs passes the gradient straight through).
    """
    for name, t in (("x", x), ("signs", signs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rht: {name} must be a torch.Tensor, got {type(t).__name__}")
    n = signs.numel()
    if signs.dim() != 1 or n < 2 or n & (n - 1) or not signs.is_floating_point():
        raise ValueError(f"rht: signs must be a 1-D floating-point tensor of a power-of-two length >= 2 (rht_signs), "
                         f"got {signs.dtype} {tuple(signs.shape)}")
    if x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(f"RHT needs the last dim to be a multiple of {n}, got shape {tuple(x.shape)}")
    y = x.float().reshape(-1, n) * signs.reshape(n).to(device=x.device, dtype=torch.float32)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(x.shape) * rht_norm(n)
    if signs.dtype != torch.float32:
        y = y.to(signs.dtype).float()
    return y.contiguous()
