"""The fused SwiGLU of MoE experts (kernels/swiglu.py) against its twin, the eager ops it replaces, and
the amaxes it emits against the amax pass it saves (ops.grouped.token_amaxes on its own outputs).

On a CPU machine the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1); on a
GPU compiled, at larger shapes too. On the GPU the SwiGLU values are compared bit for bit with the
eager CUDA ops: the kernel repeats their roundings (silu rounded to the dtype before the product;
autograd's two products and silu_backward) with the same expf and IEEE division. On the CPU the eager
ops compute silu with another exp than the interpreter's (numpy) and in fp32 by other formulas, so a
value may land one unit in the last place of a 16-bit dtype away; in fp32, where silu_backward's
1 + h1·(1 − σ) cancels near h1 = −1.28, 1e-5 relative to the tensor's largest finite value. The amaxes are exact everywhere: they are
checked against the amax pass over the kernel's own outputs.
"""

from __future__ import annotations

import pytest
import torch

from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
from titan_nvfp4.kernels.swiglu import swiglu_amax_tensors, swiglu_backward_amax_tensors, swiglu_reference
from titan_nvfp4.autograd.linear_function import sr_counter
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops import grouped as G
from titan_nvfp4.ops.backends import interpreting

from pairwise import cpu_pairwise  # tests/pairwise.py

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cpu_triton = pytest.mark.skipif(not GPU and not interpreting(),
                                reason="CPU tensors through Triton: set TRITON_INTERPRET=1 on a GPU machine")

# (group sizes, tail rows past the last expert, features): an empty expert, a 16-token one, a tail
CASES = [((32, 0, 16, 48), 16, 48), ((16,), 0, 16), ((64, 32), 5, 80)]
if GPU:
    CASES.append(((4096, 0, 2048, 6144), 112, 1408))


def _operands(counts, tail, n, dtype=torch.bfloat16, kind="normal", seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + tail
    h1, h3, dh = (torch.randn(rows, n, generator=g) * s for s in (3.0, 1.0, 0.5))
    if kind == "adversarial":
        h1[0, :16] = 0.0  # a zero block
        h1[1, 1::3] = torch.tensor([float("inf"), float("-inf"), 90.0, -90.0])[torch.arange(len(range(1, n, 3))) % 4]
        h3[2, 5] = 1e30 if dtype == torch.float32 else 6e4  # overflows the product
        h3[3, :] = 1e-30  # underflow
        dh[4, 7] = float("nan")
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(DEV)
    return [t.to(dtype).to(DEV) for t in (h1, h3, dh)] + [offsets]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaNs differ"
    ok = a.isnan()
    assert torch.equal(torch.where(ok, 0, a), torch.where(ok, 0, b)), \
        f"{what}: {(torch.where(ok, 0, a) != torch.where(ok, 0, b)).sum()} elements differ"


def _values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit on the GPU; on the CPU within one ulp of a 16-bit dtype, 1e-5 of the largest finite
    value in fp32 (module docstring)."""
    if GPU:
        return _same(a, b, what)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), f"{what}: non-finite differ"
    fin = a.isfinite()
    ulp = (torch.nextafter(b, torch.full_like(b, float("inf"))) - b).float()
    if b.dtype == torch.float32:
        ulp = torch.full_like(ulp, 1e-5) * b[fin].abs().max()
    assert ((a.float() - b.float()).abs()[fin] <= ulp[fin]).all(), f"{what}: beyond the tolerance"
    assert torch.equal(a[~fin & ~a.isnan()], b[~fin & ~b.isnan()]), f"{what}: infinities differ"


DTYPE_KINDS = [(torch.bfloat16, "normal"), (torch.bfloat16, "adversarial"), (torch.float16, "normal"),
               (torch.float32, "adversarial")]


# every case with every dtype and input kind, and each of those with and without the RHT (pairwise on a
# CPU, where the kernels run in Triton's interpreter; the whole product on a GPU)
@cpu_triton
@pytest.mark.parametrize("case,dtype_kind,rht", cpu_pairwise(CASES, DTYPE_KINDS, [True, False]))
def test_fused_swiglu_equals_eager_ops_and_the_amax_pass(case, dtype_kind, rht):
    (counts, tail, n), (dtype, kind) = case, dtype_kind
    h1, h3, dh, offsets = _operands(counts, tail, n, dtype, kind)
    signs = rht_signs(7).to(DEV) if rht else None
    h, amax = swiglu_amax_tensors(h1, h3, offsets, True, signs)
    _values(h, swiglu_reference(h1, h3), "h")
    _same(amax, G.token_amaxes(h, offsets, True, signs), "amaxes of h")
    a, b = h1.clone().requires_grad_(), h3.clone().requires_grad_()
    swiglu_reference(a, b).backward(dh)
    d1, d3, a1, a3 = swiglu_backward_amax_tensors(dh, h1, h3, offsets, True, signs)
    _values(d1, a.grad, "dh1")
    _values(d3, b.grad, "dh3")
    _same(a1, G.token_amaxes(d1, offsets, True, signs), "amaxes of dh1")
    _same(a3, G.token_amaxes(d3, offsets, True, signs), "amaxes of dh3")
    if kind == "adversarial":
        assert amax[0, 0] == float("inf") and a1[0, 0] == float("inf"), "non-finite values give an +inf amax"


@cpu_triton
def test_fused_swiglu_without_columns_and_bad_inputs():
    h1, h3, dh, offsets = _operands((16, 32), 0, 32)
    h, amax = swiglu_amax_tensors(h1, h3, offsets, False, rht_signs(1).to(DEV))
    assert torch.equal(amax[1], torch.zeros_like(amax[1])), "no column amaxes asked for"
    _same(amax[0], G.token_amaxes(h, offsets, False, None)[0], "row amaxes")
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_amax_tensors(h1[:, :24].contiguous(), h3[:, :24].contiguous(), offsets, True, None)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        swiglu_amax_tensors(h1, h3.float(), offsets, True, None)
    with pytest.raises(ValueError, match="expected contiguous"):
        swiglu_backward_amax_tensors(dh.t().contiguous().t(), h1, h3, offsets, True, None)


_pair = G.quantize_expert_pair  # the real one, for the spy below


def _expert_block(seed: int):
    """(offsets, x, W1, W3, W2, dY) of a 3-expert SwiGLU block (dim 32, hidden 48, an empty expert, 16 tail rows)."""
    g = torch.Generator().manual_seed(seed)
    E, dim, hidden = 3, 32, 48
    counts, tail = (32, 0, 48), 16
    rows = sum(counts) + tail
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(DEV)
    x = torch.randn(rows, dim, generator=g).bfloat16().to(DEV)
    w1, w3 = (torch.randn(E, hidden, dim, generator=g).mul(dim ** -0.5).bfloat16().to(DEV) for _ in range(2))
    w2 = torch.randn(E, dim, hidden, generator=g).mul(hidden ** -0.5).bfloat16().to(DEV)
    return offsets, x, w1, w3, w2, torch.randn(rows, dim, generator=g).bfloat16().to(DEV)


@pytest.mark.long
@cpu_triton
def test_fused_swiglu_experts_equal_the_unfused_block(monkeypatch):
    """The expert block through nvfp4_grouped_swiglu (W1 and W3 as one GEMM of 2·hidden outputs,
    quantize_expert_pair, whose halves the SwiGLU reads as strided views) and W2 with the given amaxes:
    outputs, every gradient and the SR counters bit-identical to W1/W3 as two GEMMs on one quantized x,
    eager SwiGLU, W2 on its own amax pass. Stochastic rounding only: no part of the fused path depends on
    the rounding mode, and nearest-even doubled the test's CI time."""
    pairs = []
    monkeypatch.setattr(G, "quantize_expert_pair", lambda *a, **k: pairs.append(1) or _pair(*a, **k))
    recipe = NVFP4Recipe(gemm_backend="emulated", stochastic_rounding=True)  # SR: the counters must match too
    offsets, x, w1, w3, w2, dy = _expert_block(3)
    runs = []
    for fused in (False, True):
        xi, w1i, w2i, w3i = (t.clone().requires_grad_() for t in (x, w1, w2, w3))
        c1, c2, c3 = (sr_counter(recipe, i, DEV) for i in range(3))
        if fused:
            h, h_amax = nvfp4_grouped_swiglu(xi, w1i, w3i, offsets, recipe, (c1, c3), aligned=True)
            assert h_amax is not None
        else:
            h1, h3 = nvfp4_grouped_mm_shared(xi, (w1i, w3i), offsets, (None, None), recipe, (c1, c3), aligned=True)
            h, h_amax = torch.nn.functional.silu(h1) * h3, None
        (y,) = nvfp4_grouped_mm_shared(h, (w2i,), offsets, (None,), recipe, (c2,), aligned=True, x_amax=h_amax)
        y.backward(dy)
        runs.append((y, xi.grad, w1i.grad, w2i.grad, w3i.grad, c1, c2, c3))
        assert len(pairs) == int(fused), "only the fused block runs W1 and W3 as one GEMM"
    for i, (a, b) in enumerate(zip(*runs)):
        _same(a, b, f"output {i}")


@cpu_triton
def test_fused_swiglu_experts_requantizing_their_weights_give_the_same_bits():
    """recipe.requantize_expert_weights on the fused block (W1|W3 as one GEMM, quantize_expert_pair, then W2):
    no Wᵀ codes kept from forward, and outputs, every gradient and the SR counters bit-identical to keeping them."""
    offsets, x, w1, w3, w2, dy = _expert_block(5)
    runs = []
    for requant in (False, True):
        recipe = NVFP4Recipe(gemm_backend="emulated", stochastic_rounding=True, requantize_expert_weights=requant)
        xi, w1i, w2i, w3i = (t.clone().requires_grad_() for t in (x, w1, w2, w3))
        c1, c2, c3 = (sr_counter(recipe, i, DEV) for i in range(3))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            h, h_amax = nvfp4_grouped_swiglu(xi, w1i, w3i, offsets, recipe, (c1, c3), aligned=True)
            (y,) = nvfp4_grouped_mm_shared(h, (w2i,), offsets, (None,), recipe, (c2,), aligned=True, x_amax=h_amax)
        assert any(t.dtype == torch.uint8 for t in saved) != requant  # Wᵀ codes: the only codes saved
        y.backward(dy)
        runs.append((y, xi.grad, w1i.grad, w2i.grad, w3i.grad, c1, c2, c3))
    for i, (a, b) in enumerate(zip(*runs)):
        _same(a, b, f"output {i}")


@cpu_triton
def test_swiglu_kernels_read_strided_halves():
    """h1 and h3 as the two column halves of one [T, 2N] GEMM output (row stride 2N): the same h, dh1,
    dh3 and amaxes as from contiguous copies."""
    h1, h3, dh, offsets = _operands((32, 0, 16), 16, 48)
    both = torch.cat([h1, h3], dim=1)
    v1, v3 = both[:, :48], both[:, 48:]
    signs = rht_signs(1).to(DEV)
    for a, b in zip(swiglu_amax_tensors(h1, h3, offsets, True, signs),
                    swiglu_amax_tensors(v1, v3, offsets, True, signs)):
        _same(a, b, "forward")
    for a, b in zip(swiglu_backward_amax_tensors(dh, h1, h3, offsets, True, signs),
                    swiglu_backward_amax_tensors(dh, v1, v3, offsets, True, signs)):
        _same(a, b, "backward")
    with pytest.raises(ValueError, match="rows of one stride"):
        swiglu_amax_tensors(v1, h3, offsets, True, signs)


def test_fused_swiglu_falls_back_off_the_grouped_kernels():
    """On the reference backend (or unaligned groups) the SwiGLU stays eager and no amaxes are given."""
    recipe = NVFP4Recipe(gemm_backend="reference")
    x = torch.randn(40, 32)
    w1, w3 = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    offsets = torch.tensor([17, 40], dtype=torch.int32)
    h, amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe)
    h1, h3 = nvfp4_grouped_mm_shared(x, (w1, w3), offsets, (None, None), recipe)
    assert amax is None and torch.equal(h, torch.nn.functional.silu(h1) * h3)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (inductor)")
def test_fused_swiglu_block_compiles_without_graph_breaks():
    """The fused expert block under torch.compile(fullgraph=True), forward and backward with SR: the
    same bits as eager, and the SR counters advanced the same way."""
    recipe = NVFP4Recipe(gemm_backend="emulated")
    offsets = torch.tensor([256, 256, 768, 1024], dtype=torch.int32, device="cuda")
    signs = rht_signs(0, "cuda")
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(4, 512, 256, device="cuda") * 0.05 for _ in range(2))
    w2 = torch.randn(4, 256, 512, device="cuda") * 0.05

    def block(x, w1, w2, w3, c):
        h, amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe, (c[0], c[2]), signs, aligned=True)
        return nvfp4_grouped_mm_shared(h, (w2,), offsets, (None,), recipe, (c[1],), signs, True, x_amax=amax)[0]

    torch._dynamo.reset()
    outs = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        c = [sr_counter(recipe, i, "cuda") for i in range(3)]
        ts = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        for _ in range(2):
            fn(*ts, c).float().square().sum().backward()
        outs.append((fn(*ts, c), *[t.grad for t in ts], *c))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@cpu_triton
def test_grouped_gemm_add_to_is_checked():
    """The dgrad accumulation's ``add_to`` must be the output's shape and dtype: else a clear error."""
    from titan_nvfp4.kernels.grouped_gemm import grouped_gemm_rows

    a, b = torch.ones(32, 16, dtype=torch.float16, device=DEV), torch.ones(16, 16, dtype=torch.float16, device=DEV)
    offsets = torch.tensor([32], dtype=torch.int32, device=DEV)
    gs = torch.ones(2, device=DEV)
    with pytest.raises(ValueError, match="add_to"):
        grouped_gemm_rows(a, b, offsets, gs, gs, 16, 16, 0, torch.bfloat16, add_to=torch.zeros(32, 8, device=DEV))
    out = grouped_gemm_rows(a, b, offsets, gs, gs, 16, 16, 0, torch.bfloat16,
                            add_to=torch.full((32, 16), 0.5, dtype=torch.bfloat16, device=DEV))
    assert torch.equal(out, torch.full_like(out, 16.5)), "16 ones summed, plus the 0.5 added"
