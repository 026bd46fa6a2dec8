"""torch.compile: the kernels are torch.library custom ops whose fake implementations match the real
ones, and an NVFP4 model compiles with fullgraph=True (no graph breaks) to the same bits as eager,
stochastic-rounding stream included. On the CPU the kernels run in Triton's interpreter and the
compiler backend is aot_eager (dynamo + AOTAutograd, no C++ toolchain); tests/test_gpu.py repeats the
model test with inductor on a GPU."""

import copy

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.numerics.nvfp4 import NVFP4Tensor
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops import library
from titan_nvfp4.ops.backends import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="needs a GPU or TRITON_INTERPRET=1")


def _x(m, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(DEV, dtype)


@pytest.mark.parametrize("rows", [32, 40])  # 40: tokens padded to 48 in the column operand
def test_quantize_op_passes_opcheck(rows):
    x = _x(rows, 64)
    seed = torch.tensor([7], dtype=torch.int64, device=DEV)
    signs = rht_signs(1, DEV)
    both, sr = dict(rowwise=True, colwise=True), dict(stochastic_row=True, stochastic_col=True)
    every = [((x, signs), both), ((x, signs, seed), dict(both, **sr)),
             ((x,), dict(rowwise=False, colwise=True)), ((x,), dict(rowwise=True, colwise=False))]
    # every flag set where the column operand is padded; at 32 rows (no padding) the one with every output
    for args, kwargs in every if rows % 16 else every[1:2]:
        torch.library.opcheck(library.quantize.op, args, kwargs)


def test_amax_op_and_given_amaxes_pass_opcheck():
    x = _x(40, 64)
    signs = rht_signs(1, DEV)
    for args, colwise in [((x, signs), True), ((x,), False), ((x,), True)]:
        torch.library.opcheck(library.amax.op, args, dict(colwise=colwise))
    amaxes = torch.tensor([3.0, 5.0], device=DEV)
    torch.library.opcheck(library.quantize.op, (x, signs, None, amaxes), dict(rowwise=True, colwise=True))
    torch.library.opcheck(library.quantize_2d.op, (_x(48, 64, seed=1), amaxes[:1]))


def test_quantize_2d_and_gemm_ops_pass_opcheck():
    w = _x(48, 64, seed=1)
    torch.library.opcheck(library.quantize_2d.op, (w,))
    d, s, dt, st, gs = library.quantize_2d(w)
    rd, rs, _, _, gsx = library.quantize(_x(32, 64, seed=2), rowwise=True, colwise=False)
    bias = torch.randn(48, device=DEV)
    # test_schema is left out: its mutation check multiplies the float8 scale inputs, which PyTorch's
    # CPU kernels do not implement ("mul_cpu_reduced_float" for Float8_e4m3fn)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for out_dtype, b in [(torch.float32, None), (torch.bfloat16, bias)]:
        torch.library.opcheck(library.gemm.op, (rd, rs, gsx[0], d, s, gs[0], b),
                              dict(a_tiles=False, b_tiles=True, out_dtype=out_dtype, backend="emulated"),
                              test_utils=utils)


@pytest.mark.parametrize("rows", [64, 40])
def test_quantize_mxfp8_op_passes_opcheck(rows):
    x = _x(rows, 64, dtype=torch.bfloat16)
    every = [(True, True), (True, False), (False, True), (True, True, True), (False, True, True)]
    # every flag set where the columns are padded (40 rows); at 64 rows the two with both outputs
    for flags in every if rows % 32 else [every[0], every[3]]:  # third: staged BF16 values
        torch.library.opcheck(library.quantize_mxfp8.op, (x,), dict(zip(("rowwise", "colwise", "staged"), flags)))


def test_grouped_quantize_stage_and_wgrad_ops_pass_opcheck():
    """The wgrad path of the grouped experts: X's column operand as codes, staged once by stage_grouped
    (exactly the codes' q·e_b) and read by the tokens GEMM, which gives the same bits either way."""
    x, dy = _x(48, 32), _x(48, 64, seed=3)
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32, device=DEV)  # an empty expert in the middle
    signs = rht_signs(1, DEV)
    torch.library.opcheck(library.quantize_grouped.op, (x, offsets, signs),
                          dict(rowwise=True, colwise=True, row_staged=True))
    _, _, cd, cs, gs = library.quantize_grouped(x, offsets, signs, rowwise=False, colwise=True)
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # see above
    torch.library.opcheck(library.stage_grouped.op, (cd, cs), test_utils=no_schema)
    staged = library.stage_grouped(cd, cs)
    want = NVFP4Tensor(cd, cs, gs[1, 0], torch.Size((32, 48)), (1, 16)).scaled_codes(torch.float32)
    assert staged.dtype == torch.float16 and torch.equal(staged.float(), want)
    _, _, dd, _, gd = library.quantize_grouped(dy, offsets, signs, rowwise=False, colwise=True, col_staged=True)
    args, kwargs = (dd, dd.new_empty((0,)), cd, cs, offsets, gd[1], gs[1]), dict(out_dtype=torch.float32)
    torch.library.opcheck(library.grouped_gemm_tokens.op, args, kwargs, test_utils=no_schema)
    assert torch.equal(library.grouped_gemm_tokens(*args, **kwargs),
                       library.grouped_gemm_tokens(dd, dd.new_empty((0,)), staged, cs.new_empty((0,)), offsets, gd[1],
                                                   gs[1], out_dtype=torch.float32))


@pytest.mark.long
def test_expert_pair_ops_pass_opcheck_and_equal_separate_ones():
    """quantize_2d_grouped_pair: the staged W1|W3 rows, the Wᵀ codes and scales and the decode scales
    of two separate quantize_2d_grouped calls; the split grouped GEMM over it: each half of its
    output equals that weight's GEMM alone."""
    E, n, k = 2, 32, 48
    w1, w3 = _x(E * n, k, seed=4), _x(E * n, k, seed=5) * 3
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # see above
    torch.library.opcheck(library.quantize_2d_grouped_pair.op, (w1, w3), dict(experts=E), test_utils=no_schema)
    d, *rest = library.quantize_2d_grouped_pair(w1, w3, experts=E)
    one = [library.quantize_2d_grouped(w, experts=E, staged=True) for w in (w1, w3)]
    # without Wᵀ (requantize_expert_weights): the same staged rows and decode scales, the Wᵀ ones empty
    for op, args, kw in ((library.quantize_2d_grouped_pair, (w1, w3), {}),
                         (library.quantize_2d_grouped, (w1,), dict(staged=True))):
        torch.library.opcheck(op.op, args, dict(experts=E, emit_transpose=False, **kw), test_utils=no_schema)
    d_no_t, dt1, st1, gs1, *_ = library.quantize_2d_grouped_pair(w1, w3, experts=E, emit_transpose=False)
    assert torch.equal(d_no_t, d) and torch.equal(gs1, rest[2]) and dt1.numel() == st1.numel() == 0
    for i, (d_i, _, dt, st, gs) in enumerate(one):
        assert torch.equal(d.view(E, 2, n, k)[:, i].reshape(E * n, k), d_i)
        for a, b in zip(rest[3 * i:3 * i + 3], (dt, st, gs)):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    offsets = torch.tensor([16, 48], dtype=torch.int32, device=DEV)
    xd, xs, _, _, gx = library.quantize_grouped(_x(64, k, seed=6), offsets, rowwise=True, colwise=False,
                                                row_staged=True)
    gs_b = torch.stack([rest[2], rest[5]])
    args = (xd, xs, d, d.new_empty((0,)), offsets, gx[0], gs_b)
    kwargs = dict(b_tiles=True, n_out=2 * n, b_row_step=2 * n, b_col_step=0, out_dtype=torch.float32, n_split=n)
    torch.library.opcheck(library.grouped_gemm_rows.op, args, kwargs, test_utils=no_schema)
    y = library.grouped_gemm_rows(*args, **kwargs)
    for i, (d_i, *_, gs) in enumerate(one):
        alone = library.grouped_gemm_rows(xd, xs, d_i, d_i.new_empty((0,)), offsets, gx[0], gs, b_tiles=True, n_out=n,
                                          b_row_step=n, b_col_step=0, out_dtype=torch.float32)
        assert torch.equal(y[:, i * n:(i + 1) * n], alone), i


@pytest.mark.long
@pytest.mark.parametrize("requant", [False, pytest.param(True, marks=pytest.mark.slow(
    reason="24 s on 2 cores; the requantized Wᵀ's bits in eager: test_grouped, test_swiglu"))],
    ids=["wt_kept", "wt_requantized"])
def test_compiled_grouped_swiglu_matches_eager_bit_for_bit(requant):
    """A SwiGLU expert's grouped kernels (W1 and W3 on one quantization of x, the fused SwiGLU, X's
    wgrad operand staged once for both wgrads) under dynamo with fullgraph=True: the same bits as
    eager for h, dx and the three weight gradients, stochastic rounding included; with the weights'
    Wᵀ kept from forward or quantized again in backward (requantize_expert_weights)."""
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu
    from titan_nvfp4.autograd.linear_function import sr_counter

    recipe = NVFP4Recipe(gemm_backend="emulated", requantize_expert_weights=requant)
    offsets = torch.tensor([32, 32, 64], dtype=torch.int32, device=DEV)
    signs = rht_signs(recipe.rht_seed, DEV)  # as the expert module holds them (made outside the graph)
    x = _x(80, 32)
    ws = [_x(3 * 48, 32, seed=s).reshape(3, 48, 32) * 0.1 for s in (1, 2)] + [_x(3 * 32, 48, seed=3).reshape(3, 32, 48)]

    def block(x, w1, w3, w2, c1, c3, c2):
        h, h_amax = nvfp4_grouped_swiglu(x, w1, w3, offsets, recipe, (c1, c3), signs, aligned=True)
        return nvfp4_grouped_mm_shared(h, (w2,), offsets, (None,), recipe, (c2,), signs, aligned=True,
                                       x_amax=h_amax)[0]

    torch._dynamo.reset()
    outs = []
    for f in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        xi, wi = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        y = f(xi, *wi, *(sr_counter(recipe, i, DEV) for i in range(3)))
        y.square().sum().backward()
        outs.append([y, xi.grad, *(w.grad for w in wi)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gemm_op_rejects_unknown_backend():
    d, s, _, _, gs = library.quantize_2d(_x(16, 32))
    with pytest.raises(ValueError, match="backend must be 'emulated' or 'native', got 'cublas'"):
        library.gemm(d, s, gs[0], d, s, gs[0], a_tiles=True, b_tiles=True, out_dtype=torch.float32, backend="cublas")


class _Block(torch.nn.Module):
    """A residual block of one NVFP4 layer: blocks in a row chain NVFP4 layers with ordinary ops in between (one
    layer a block: each interpreted kernel launch costs the CPU tenths of a second)."""

    def __init__(self, dim, recipe, layer_id):
        super().__init__()
        self.proj = NVFP4Linear(dim, dim, bias=True, recipe=recipe, layer_id=layer_id)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(x))


def _model(recipe, blocks=2, dim=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Block(dim, recipe, i) for i in range(blocks)]).to(DEV)


def _step(model, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.long
def test_compiled_model_with_sr_and_amax_history_matches_eager():
    """Blocks compiled as TorchTitan compiles them (fullgraph, one graph shared by the blocks), with
    stochastic rounding and activation_amax_history: compiled and eager agree bit for bit before and after
    the window's roll; the pending-amax update compiles into the graph, the window's readiness recompiles
    once; SR draws new numbers each step (steps 0 and 1 see the same inputs), in both alike."""
    from titan_nvfp4.modules.amax_history import AmaxHistory, register_buffers, roll

    recipe = NVFP4Recipe(gemm_backend="emulated", stochastic_rounding=True)
    eager = _model(recipe)
    compiled_twin = copy.deepcopy(eager)
    for model in (eager, compiled_twin):
        history = AmaxHistory(2)
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                register_buffers(m, history)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for blk in compiled_twin:
        blk.compile(backend="aot_eager", fullgraph=True)
    dy = _x(32, 32, seed=4)
    for step in range(3):
        x = _x(32, 32, seed=3) * (4.0 if step == 2 else 1.0)  # step 3 outgrows the window
        y_e, dx_e, g_e = _step(eager, x, dy)
        y_c, dx_c, g_c = _step(compiled_twin, x, dy)
        assert torch.equal(y_e, y_c) and torch.equal(dx_e, dx_c), f"step {step}"
        for name in g_e:
            assert torch.equal(g_e[name], g_c[name]), f"step {step}: {name}"
        lin_e = [m for m in eager.modules() if isinstance(m, NVFP4Linear)]
        lin_c = [m for m in compiled_twin.modules() if isinstance(m, NVFP4Linear)]
        for a, b in zip(lin_e, lin_c):
            assert torch.equal(a.x_amax_pending, b.x_amax_pending) and a.x_amax_pending.any()
        roll(lin_e)
        roll(lin_c)
        if step == 0:
            first = g_c["0.proj.weight"]
        elif step == 1:
            assert not torch.equal(first, g_c["0.proj.weight"])  # same inputs, new SR numbers
    assert [m.sr_calls for m in lin_c] == [3] * 2
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 2, f"expected one graph before and one after the window fills, got {frames}"


def test_eager_calls_skip_the_dispatcher_and_modes_do_not():
    """Eager calls on plain tensors run the kernel code directly (no custom-op overhead); under a
    dispatch mode (as selective activation checkpointing uses) the same call goes through the op, which
    the mode then sees as one opaque call with the same outputs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = _x(32, 64)
    direct = library.quantize(x, rowwise=True, colwise=True)
    with Seen() as mode:
        via_op = library.quantize(x, rowwise=True, colwise=True)
    assert "titan_nvfp4.quantize.default" in mode.ops
    for a, b in zip(direct, via_op):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    from unittest import mock

    from torch._library.custom_ops import CustomOpDef

    calls = []
    real = CustomOpDef.__call__
    with mock.patch.object(CustomOpDef, "__call__", lambda self, *a, **k: calls.append(self) or real(self, *a, **k)):
        library.quantize(x, rowwise=True, colwise=True)
        assert calls == []  # eager: straight to the kernels
        library.quantize_2d(torch.nn.Parameter(_x(32, 64)))
        assert calls == []  # a Parameter (the weight inside NVFP4LinearFunction) is a plain tensor too
        with Seen():
            library.quantize(x, rowwise=True, colwise=True)
        assert calls == [library.quantize.op]
    meta = library.quantize(x.to("meta"), rowwise=True, colwise=True)  # meta: the fake impl
    assert meta[0].device.type == "meta" and meta[0].shape == direct[0].shape


def test_compiled_functions_never_take_the_truth_of_amax_groups(monkeypatch):
    """torch 2.11's dynamo (the GPU machines') cannot apply ``not`` to a frozen dataclass inside an
    autograd.Function, and newer ones can: so no traced path takes an AmaxGroups' truth value. A ``__bool__``
    that raises makes the compile fail here, on any torch, wherever one does."""
    from titan_nvfp4.distributed.amax import AmaxGroups
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm
    from titan_nvfp4.autograd.linear_function import nvfp4_linear, sr_counter

    def no_truth(self):
        raise AssertionError("AmaxGroups' truth value taken in traced code")

    monkeypatch.setattr(AmaxGroups, "__bool__", no_truth, raising=False)
    recipe = NVFP4Recipe(gemm_backend="emulated")
    groups = AmaxGroups()  # no process group: every amax is local, as on one rank
    x = _x(32, 32).requires_grad_(True)
    w = _x(32, 32, seed=1).requires_grad_(True)
    we = _x(2 * 32, 32, seed=2).view(2, 32, 32).requires_grad_(True)
    offsets = torch.tensor([16, 32], dtype=torch.int32, device=DEV)
    counters = [sr_counter(recipe, i, device=DEV) for i in range(2)]
    signs = rht_signs(recipe.rht_seed).to(DEV)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def both(x, w, we):
        y = nvfp4_linear(x, w, None, recipe, counters[0], signs, groups=groups)
        return y.sum() + nvfp4_grouped_mm(x, we, offsets, None, recipe, counters[1], signs,
                                            aligned=True, groups=groups).sum()

    both(x, w, we).backward()
    assert x.grad is not None and w.grad is not None and we.grad is not None


def test_ms_eden_ops_pass_opcheck():
    x = _x(40, 48)  # 48 columns: padded to 64 at size 32
    ps = torch.tensor([0.5], device=DEV)
    s1, s2 = (torch.tensor([v], dtype=torch.int64, device=DEV) for v in (3, 2**40 + 7))
    torch.library.opcheck(library.ms_eden_amax.op, (x, ps, s1), dict(size=32))
    amax = library.ms_eden_amax(x, ps, s1, size=32)
    for staged in (False, True):
        torch.library.opcheck(library.ms_eden_quantize.op, (x.t(), None, s1, s2, None), dict(size=16, staged=staged))
        torch.library.opcheck(library.ms_eden_quantize.op, (x, ps, s1, s2, amax), dict(size=32, staged=staged))


@pytest.mark.long
def test_compiled_ms_eden_model_matches_eager_bit_for_bit():
    """quartet2's backward (MS-EDEN, seeds from the SR counter on the device) compiles with fullgraph into one graph
    shared by the blocks and draws the same bits as eager, afresh each step; after a forward-only switch
    (bf16_after_scope = "forward", the ranking's best combination) one more graph does, still bit for bit."""
    from titan_nvfp4.recipe.nvfp4_recipe import build_recipe
    from titan_nvfp4.training.schedule import PrecisionSchedule

    recipe = build_recipe("quartet2", {"gemm_backend": "emulated", "rht_size": 32})
    eager = _model(recipe)
    compiled_twin = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for blk in compiled_twin:
        blk.compile(backend="aot_eager", fullgraph=True)
    dy, x = _x(32, 32, seed=4), _x(32, 32, seed=3)
    grads = []
    for step in range(2):
        y_e, dx_e, g_e = _step(eager, x, dy)
        y_c, dx_c, g_c = _step(compiled_twin, x, dy)
        assert torch.equal(y_e, y_c) and torch.equal(dx_e, dx_c), f"step {step}"
        for name in g_e:
            assert torch.equal(g_e[name], g_c[name]), f"step {step}: {name}"
        grads.append(g_c["0.proj.weight"])
    assert not torch.equal(*grads)  # same inputs, new signs and scale draws
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    switch = PrecisionSchedule(2, "forward")
    assert switch.at_step(2) and switch.high_precision_forward and not switch.high_precision_backward
    for model in (eager, compiled_twin):
        for blk in model:
            blk.proj.precision_schedule = switch
    y_e, dx_e, g_e = _step(eager, x, dy)
    y_c, dx_c, g_c = _step(compiled_twin, x, dy)
    want = x
    for blk in eager:  # the forward is F.linear's now
        want = want + torch.nn.functional.linear(torch.nn.functional.gelu(want), blk.proj.weight, blk.proj.bias)
    assert torch.equal(y_e, want.detach())
    assert torch.equal(y_e, y_c) and torch.equal(dx_e, dx_c), "after the switch"
    assert all(torch.equal(g_e[name], g_c[name]) for name in g_e), "after the switch"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_capability_compiles_to_a_constant_without_the_lru_cache_warning(monkeypatch):
    """kernels.platform.capability under torch.compile asks torch directly (Dynamo folds it), not through its
    lru_cache, which Dynamo warns about once per process in every compiled NVFP4 job's log."""
    import warnings

    from titan_nvfp4.kernels import platform

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def f(x):
        return x + platform.capability(torch.device("cuda"))[0]

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
    torch._dynamo.reset()
    assert torch.equal(y, torch.full((2,), 9.0))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
