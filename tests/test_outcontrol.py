"""TetraJet-v2's OutControl (modules/outcontrol.py, the outcontrol_* recipe keys): how many input channels, which ones
(the largest ‖X[:, k]‖₂ summed over the window's training forwards, summed over the ranks), when (once, after the
window's last optimizer step), the forward and gradients after it (the selected channels in MXFP8 beside the NVFP4
rest, bit for bit against the numerics), the selection in state dicts and checkpoints, and the refusals. Driven
through the real per-step core (titan_nvfp4.convert's TrainingSteps)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import titan_nvfp4
from titan_nvfp4.autograd.linear_function import cached_rht_signs, next_sr_seed, nvfp4_linear, sr_counter
from titan_nvfp4.autograd.ms_eden_backward import ms_eden_backward
from titan_nvfp4.autograd.outcontrol_linear import outcontrol_linear
from titan_nvfp4.autograd.mxfp8_linear import mxfp8_linear
from titan_nvfp4.modules.outcontrol import outcontrol_channels, select_channels
from titan_nvfp4.numerics.mxfp8 import quantize_mxfp8
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
from titan_nvfp4.ops import quantize_weight
from titan_nvfp4.ops.backends import interpreting
from titan_nvfp4.ops.gemm import gemm_reference
from titan_nvfp4.recipe.nvfp4_recipe import build_recipe

from dist_util import run_ranks
from job_helpers import toml_error
from linear_helpers import assert_matches

K, N, M = 128, 32, 64  # in_features, out_features, tokens per forward; 0.1 of K rounds up to 32 channels


class _Net(nn.Module):
    def __init__(self, in_features: int = K, out_features: int = N):
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.lin(x)


def _convert(**knobs):
    knobs = {"filter_fqns": [], "gemm_backend": "reference", "outcontrol_fraction": 0.1, "outcontrol_start": 1,
             "outcontrol_steps": 2, **knobs}
    torch.manual_seed(0)
    return titan_nvfp4.convert(_Net(), **knobs)


def _x(big: list[int], seed: int = 0, scale: float = 20.0) -> torch.Tensor:
    """Activations with the columns ``big`` ``scale`` times larger."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[:, big] *= scale
    return x


PLANTED = sorted({(7 * i + 3) % K for i in range(32)})


def _train(model, steps, xs) -> None:
    for x in xs:
        model(x).square().mean().backward()
        steps.step()


def test_k_is_the_rounded_fraction_rounded_up_to_whole_mxfp8_blocks():
    assert outcontrol_channels(2048, 0.1) == 224  # round(204.8) = 205 -> 224
    assert outcontrol_channels(4096, 0.02) == 96  # 82 -> 96
    assert outcontrol_channels(128, 0.1) == 32  # 13 -> 32
    assert outcontrol_channels(64, 0.5) == 32
    assert outcontrol_channels(32, 0.5) == 32  # at most K
    assert outcontrol_channels(64, 0.001) == 0  # round(0.064) = 0: the layer keeps no channel in MXFP8
    model, _ = _convert(outcontrol_fraction=0.3)
    assert model.lin.outcontrol_index.shape == (64,) and model.lin.outcontrol_rest.shape == (64,)


def test_the_planted_outlier_channels_are_selected_once_after_the_window(caplog):
    """start 1, steps 2: the forwards of steps 2 and 3 count; selection after step 3; later outliers change nothing."""
    model, steps = _convert()
    lin = model.lin
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        _train(model, steps, [_x(list(range(32)), 1, 1e3)])  # step 1: outside the window, not summed
        assert not bool(lin.outcontrol_norms.any()) and lin.outcontrol.recording
        with torch.no_grad():
            model(_x(list(range(32, 64)), 2, 1e3))  # an evaluation forward: not summed
        assert not bool(lin.outcontrol_norms.any())
        _train(model, steps, [_x(PLANTED, 3)])
        expected = torch.linalg.vector_norm(_x(PLANTED, 3), dim=0)
        assert torch.equal(lin.outcontrol_norms, expected) and not lin._outcontrol_on
        _train(model, steps, [_x(PLANTED, 4)])
    assert lin._outcontrol_on and bool(lin.outcontrol_done)
    assert lin.outcontrol_index.tolist() == PLANTED
    assert lin.outcontrol_rest.tolist() == sorted(set(range(K)) - set(PLANTED))
    assert "NVFP4: OutControl of lin: 32 of 128 input channels in MXFP8 from optimizer step 4 on" in caplog.text
    _train(model, steps, [_x(list(range(32)), 5, 1e3) for _ in range(3)])  # static from here on
    assert lin.outcontrol_index.tolist() == PLANTED and not lin.outcontrol.recording


def test_ties_go_to_the_lower_channel():
    model, _ = _convert()
    lin = model.lin
    with torch.no_grad():
        lin.outcontrol_norms.fill_(1.0)
        lin.outcontrol_norms[[5, 9, 100]] = 2.0  # three clear winners, then 29 of the 125 tied channels
    assert select_channels([lin]) == [("lin", 32, K)]
    assert lin.outcontrol_index.tolist() == sorted([5, 9, 100] + [c for c in range(K) if c not in (5, 9, 100)][:29])


def _mxfp8_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, C] · b [N, C]ᵀ by hand: both quantized to MXFP8 along C, dequantized, multiplied in fp32."""
    return quantize_mxfp8(a).dequantize() @ quantize_mxfp8(b).dequantize().t()


def _selected(model, steps):
    _train(model, steps, [_x(PLANTED, s) for s in (1, 2, 3)])
    assert model.lin._outcontrol_on
    return model.lin.outcontrol_index, model.lin.outcontrol_rest


def test_before_the_selection_the_layer_is_plain_nvfp4_after_it_the_split_bit_for_bit():
    model, steps = _convert()
    lin, x = model.lin, _x(PLANTED, 9)
    with torch.no_grad():
        assert torch.equal(model(x), nvfp4_linear(x, lin.weight, lin.bias, lin.recipe, None, lin.rht_signs))
    sel, rest = _selected(model, steps)
    with torch.no_grad():
        y = model(x)
        fp4 = nvfp4_linear(x[:, rest], lin.weight[:, rest], lin.bias, lin.recipe, None, lin.rht_signs)
        assert torch.equal(y, fp4 + _mxfp8_product(x[:, sel], lin.weight[:, sel]))
        assert not torch.equal(y, nvfp4_linear(x, lin.weight, lin.bias, lin.recipe, None, lin.rht_signs))


def _rebuilt(w: torch.Tensor, sel: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Ŵ by hand: the forward's quantized weight, the rest columns in NVFP4 16×16 tiles (the layer's weight_2d), the
    selected ones in MXFP8 (1×32 along K), put back in column order (fp32)."""
    w_hat = torch.empty(w.shape, dtype=torch.float32)
    w_hat[:, rest] = quantize_nvfp4(w[:, rest], block_shape=(16, 16)).dequantize()
    w_hat[:, sel] = quantize_mxfp8(w[:, sel]).dequantize()
    return w_hat


def test_dgrad_runs_over_every_column_on_the_rebuilt_weight_and_wgrad_splits_as_the_authors_code():
    """After the selection the backward is the authors' (TetraJet-v2 linear_mix.py): dX = dY·Ŵ in NVFP4 over all K
    columns, Ŵ the forward's quantized weight rebuilt from its NVFP4 and MXFP8 parts and quantized again by the
    recipe's weight quantizer (nearest, 16×16), dY the stochastically rounded rows of the call's SR stream; dW of the
    rest columns is the NVFP4 wgrad of the same call (the rest-only nvfp4_linear's, bit for bit), of the selected
    columns the MXFP8 product. dX by hand from the reference numerics bit for bit, and against float64 to fp32
    accumulation; it differs from both a split dgrad and a dgrad on the unquantized W."""
    model, steps = _convert()
    lin = model.lin
    sel, rest = _selected(model, steps)
    x = _x(PLANTED, 11).requires_grad_()
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(12))
    model.zero_grad(set_to_none=True)
    counter = lin.sr_counter.clone()  # the call's SR stream, as the layer will draw it
    seed = int(next_sr_seed(counter.clone()))
    model(x).backward(dy)
    # wgrad of the rest and db: nvfp4_linear on the rest columns with the layer's stream (its dX asked for too: one
    # quantization of dY for both, as the layer's)
    xr, wr = x.detach()[:, rest].requires_grad_(), lin.weight.detach()[:, rest].requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    nvfp4_linear(xr, wr, b, lin.recipe, counter, lin.rht_signs).backward(dy)
    assert torch.equal(lin.weight.grad[:, rest], wr.grad) and torch.equal(lin.bias.grad, b.grad)
    xs = x.detach()[:, sel]
    assert torch.equal(lin.weight.grad[:, sel], _mxfp8_product(dy.t().contiguous(), xs.t().contiguous()))
    # dgrad by hand
    w_dgrad = quantize_nvfp4(_rebuilt(lin.weight.detach(), sel, rest), block_shape=(16, 16))
    dyq = quantize_nvfp4(dy, block_shape=(1, 16), stochastic=True, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(x.grad, gemm_reference(dyq, w_dgrad.t(), torch.float32))
    exact = (dyq.dequantize(torch.float64) @ w_dgrad.dequantize(torch.float64))
    bound = (dyq.dequantize(torch.float64).abs() @ w_dgrad.dequantize(torch.float64).abs()) * N * 2.0**-23
    assert ((x.grad.double() - exact).abs() <= bound + exact.abs() * 2.0**-24).all()
    plain_w = gemm_reference(dyq, quantize_nvfp4(lin.weight.detach(), block_shape=(16, 16)).t(), torch.float32)
    split_sel = _mxfp8_product(dy, lin.weight.detach()[:, sel].t().contiguous())
    assert not torch.equal(x.grad, plain_w) and not torch.equal(x.grad[:, sel], split_sel)


@pytest.mark.parametrize("backward", ["mxfp8", "bf16"])
def test_another_backward_keeps_its_format_over_every_column_and_the_selected_wgrad_in_mxfp8(backward):
    """``backward = "mxfp8"``: the layer's whole MXFP8 backward (per column what a split computes); ``"bf16"``: dgrad
    and the rest's wgrad in the compute dtype (fp32 here: no autocast), the selected columns' wgrad in MXFP8."""
    model, steps = _convert(backward=backward)
    lin = model.lin
    sel, rest = _selected(model, steps)
    model.zero_grad(set_to_none=True)
    x = _x(PLANTED, 13).requires_grad_()
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(14))
    model(x).backward(dy)
    w, xd = lin.weight.detach(), x.detach()
    if backward == "mxfp8":
        assert torch.equal(x.grad, _mxfp8_product(dy, w.t().contiguous()))
        assert torch.equal(lin.weight.grad, _mxfp8_product(dy.t().contiguous(), xd.t().contiguous()))
    else:
        assert torch.equal(x.grad, dy @ w)
        assert torch.equal(lin.weight.grad[:, rest], dy.t() @ xd[:, rest])
        assert torch.equal(lin.weight.grad[:, sel], _mxfp8_product(dy.t().contiguous(), xd[:, sel].t().contiguous()))


def test_a_forward_only_switch_runs_the_forward_in_high_precision_and_keeps_the_backward():
    model, steps = _convert(bf16_after_fraction=0.5, bf16_after_scope="forward", total_steps=8)  # switch after 4
    lin = model.lin
    sel, rest = _selected(model, steps)
    _train(model, steps, [_x(PLANTED, 4)])
    assert lin.high_precision_forward and not lin.high_precision
    x = _x(PLANTED, 15).requires_grad_()
    y = model(x)
    assert torch.equal(y, torch.nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach()))
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(16))
    seed = int(next_sr_seed(lin.sr_counter.clone()))
    y.backward(dy)
    w_dgrad = quantize_nvfp4(_rebuilt(lin.weight.detach(), sel, rest), block_shape=(16, 16))
    dyq = quantize_nvfp4(dy, block_shape=(1, 16), stochastic=True, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(x.grad, gemm_reference(dyq, w_dgrad.t(), torch.float32))


def test_the_mxfp8_linear_alone_matches_the_numerics_and_skips_what_is_not_needed():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(M, 64, generator=g).requires_grad_(), torch.randn(N, 64, generator=g).requires_grad_()
    y = mxfp8_linear(x, w, "reference")
    assert torch.equal(y, _mxfp8_product(x.detach(), w.detach()))
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    with torch.no_grad():
        assert torch.equal(mxfp8_linear(x, w, "reference"), y)
    with pytest.raises(ValueError, match=r"mxfp8_linear: x \(64, 64\) and weight \(32, 48\) do not fit"):
        mxfp8_linear(x, torch.zeros(N, 48), "reference")


def test_the_selection_survives_a_state_dict_round_trip_and_a_bf16_state_dict_loads_unselected():
    model, steps = _convert()
    sel, _ = _selected(model, steps)
    state = model.state_dict()
    assert state["lin.outcontrol_done"].item() and torch.equal(state["lin.outcontrol_index"], sel)
    fresh, _ = _convert()
    assert not fresh.lin._outcontrol_on
    fresh.load_state_dict(state)
    assert fresh.lin._outcontrol_on and torch.equal(fresh.lin.outcontrol_index, sel)
    x = _x(PLANTED, 20)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    plain = {k: v for k, v in state.items() if "outcontrol" not in k}  # a BF16 model's keys
    other, _ = _convert()
    other.load_state_dict(plain)  # strict: the selection's keys are not required
    assert not other.lin._outcontrol_on
    broken = dict(state, **{"lin.outcontrol_index": torch.full_like(sel, 3)})
    with pytest.raises(ValueError, match="NVFP4 Linear 'lin': outcontrol_index holds a channel twice"):
        other.load_state_dict(broken)


def test_a_meta_model_materializes_unselected_and_a_resume_restores_the_window(tmp_path):
    with torch.device("meta"):
        net = _Net()
    model, steps = titan_nvfp4.convert(net, filter_fqns=[], gemm_backend="reference", outcontrol_fraction=0.1,
                                       outcontrol_start=1, outcontrol_steps=2)
    model.to_empty(device="cpu")
    assert not bool(model.lin.outcontrol_done) and not bool(model.lin.outcontrol_norms.any())
    # a TrainingSteps resumed after 2 steps: inside the window (the forward of step 3 is summed)
    model2, steps2 = _convert()
    steps2.load_state_dict({"steps": 2})
    assert model2.lin.outcontrol.recording
    _train(model2, steps2, [_x(PLANTED, 4)])
    assert model2.lin._outcontrol_on and model2.lin.outcontrol_index.tolist() == PLANTED


def _dp_worker(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    a, b, common = list(range(0, 32)), list(range(32, 64)), list(range(64, 96))
    model, steps = _convert()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x = torch.ones(M, K)
    x[:, a if rank == 0 else b] = 10.0  # each rank alone would pick its own 32
    x[:, common] = 6.0  # summed over both ranks: 12 > 10
    _train(model, steps, [x, x, x])
    model(x).square().mean().backward()  # the split forward and backward on FSDP2's unsharded weight
    grad = model.lin.weight.grad.full_tensor()
    out[rank] = (model.lin.outcontrol_index.tolist(), bool(torch.isfinite(grad).all()), bool(grad[:, common].any()))


@pytest.mark.long
def test_data_parallel_ranks_sum_their_norms_and_select_the_same_channels_under_fsdp2():
    out = run_ranks(_dp_worker, 2)
    assert out[0] == out[1] == (list(range(64, 96)), True, True)


# -- refusals --------------------------------------------------------------------------------------------------

S = r"\[quantize.linear.nvfp4\] "


@pytest.mark.parametrize("knobs, message", [
    ({"outcontrol_fraction": 1.0}, S + r"outcontrol_fraction must be a number in \[0, 1\) \(0 = off\), got 1.0"),
    ({"outcontrol_fraction": -0.1}, S + r"outcontrol_fraction must be a number in \[0, 1\) \(0 = off\), got -0.1"),
    ({"outcontrol_fraction": 0.1, "outcontrol_start": -1}, S + "outcontrol_start must be a non-negative integer, got -1"),
    ({"outcontrol_fraction": 0.1, "outcontrol_steps": 0}, S + "outcontrol_steps must be a positive integer, got 0"),
    ({"outcontrol_steps": 10}, S + "outcontrol_steps = 10 needs outcontrol_fraction > 0"),
    ({"outcontrol_fraction": 0.1, "fsdp_nvfp4_all_gather": True},
     S + "outcontrol_fraction = 0.1 cannot be combined with fsdp_nvfp4_all_gather = true yet"),
    ({"outcontrol_fraction": 0.1, "lora_rank": 16}, S + "outcontrol_fraction = 0.1 cannot be combined with lora_rank = 16"),
])
def test_bad_values_are_refused_at_parse_time_by_name(tmp_path, knobs, message):
    lines = [f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()]
    assert pytest.raises(ValueError, titan_nvfp4.convert, _Net(), **knobs).match(message)
    assert str(pytest.raises(ValueError, titan_nvfp4.convert, _Net(), **knobs).value) == toml_error(tmp_path, *lines)


def test_the_experts_refuse_it_and_experts_true_leaves_it_to_the_linears(tmp_path):
    message = "[quantize.grouped_mm.nvfp4] outcontrol_fraction = 0.1: OutControl applies to the dense Linears only"
    assert message in toml_error(tmp_path, "outcontrol_fraction = 0.1", grouped=True)
    with pytest.raises(ValueError) as e:
        titan_nvfp4.convert(_Net(), experts={"outcontrol_fraction": 0.1})
    assert message in str(e.value)


def test_tensor_parallel_shards_are_refused_by_name():
    model, steps = _convert()
    model.lin.local_tp = (0, None)  # as TorchTitan 0.3's spmd_types parallelize sets it
    with pytest.raises(NotImplementedError, match="NVFP4 Linear 'lin': outcontrol_fraction is not supported with tensor"):
        steps.sections[0].attach([model], [[model.lin]])
    from torchtitan.distributed import ParallelDims
    from titan_nvfp4.integration.converter import require_outcontrol_parallelism

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    with pytest.raises(ValueError, match=S + r"outcontrol_fraction = 0.1 is not supported with pipeline parallelism "
                       r"\(parallelism.pipeline_parallel_degree = 2\)"):
        require_outcontrol_parallelism(0.1, dims)


# -- TorchTitan 0.2's CheckpointManager (DCP) ----------------------------------------------------------------------

@pytest.mark.long
def test_torchtitans_checkpoint_manager_keeps_the_selection_and_loads_checkpoints_without_it(tmp_path):
    from checkpoint_helpers import REF, Job, tokens as _tokens

    oc = {**REF, "outcontrol_fraction": 0.25, "outcontrol_start": 1, "outcontrol_steps": 1}  # selects after step 2
    a = Job(tmp_path, oc)
    for t in range(1, 4):
        a.step(_tokens(t))
    a.save()
    wq = a.linear("attention.wq")
    assert wq._outcontrol_on and wq.outcontrol_index.shape == (32,)
    loss = a.step(_tokens(4))
    b = Job(tmp_path, oc)
    b.load()
    assert b.trainer.step == 3
    for name in ("attention.wq", "feed_forward.w2"):
        assert b.linear(name)._outcontrol_on
        assert torch.equal(b.linear(name).outcontrol_index, a.linear(name).outcontrol_index)
    assert torch.equal(b.step(_tokens(4)), loss)
    plain = Job(tmp_path, REF, folder="plain")  # a checkpoint without the selection
    plain.step(_tokens(1))
    plain.save()
    c = Job(tmp_path, oc, folder="plain")
    c.load()
    assert c.trainer.step == 1 and not c.linear("attention.wq")._outcontrol_on
    c.step(_tokens(2))
    assert c.linear("attention.wq")._outcontrol_on  # its window (step 2's forward) still ran


def test_osci_reset_beside_it_quantizes_the_rest_on_its_own_and_never_resets_the_selected_channels():
    """With both (the tetrajet2 preset): OsciReset's grid Q is the forward's, W[:, rest] quantized on its own, and the
    selected MXFP8 channels keep their master weights (the authors reset FP4 weights only)."""
    from titan_nvfp4.modules.osci_reset import forward_grid
    from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4

    model, steps = _convert(osci_reset_every=4, osci_reset_window=1)
    lin = model.lin
    sel, rest = _selected(model, steps)
    q = forward_grid(lin, lin.weight)
    assert torch.equal(q[:, sel], lin.weight.detach()[:, sel].float())
    want = quantize_nvfp4(lin.weight.detach()[:, rest], block_shape=(16, 16)).dequantize()
    assert torch.equal(q[:, rest], want)
    before = lin.weight.detach()[:, sel].clone()
    with torch.no_grad():
        lin.weight[:, sel] += 1e-3  # any movement of the selected channels stays below τ times itself
    _train(model, steps, [_x(PLANTED, s) for s in range(10, 16)])  # two windows, resets included
    assert not torch.equal(lin.weight.detach()[:, sel], before)  # trained, not snapped to a grid
    grid = forward_grid(lin, lin.weight)[:, sel]
    assert torch.equal(grid, lin.weight.detach()[:, sel].float())


def _leaves(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, PLANTED] *= 20.0
    return (x.requires_grad_(), (torch.randn(N, K, generator=g) * 0.1).requires_grad_(),
            torch.randn(N, generator=g).requires_grad_(), torch.randn(M, N, generator=g))


def _split():
    sel = torch.tensor(PLANTED)
    return sel, torch.tensor(sorted(set(range(K)) - set(PLANTED)))


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="kernels need TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("weight_2d", [True, False])
def test_the_emulated_kernels_agree_with_the_reference_backend(weight_2d):
    """outcontrol_linear on the emulated backend (Triton kernels; their interpreter on the CPU), nearest rounding (the
    kernels draw stochastic rounding from Philox, the reference from torch), against the reference backend: Y, dX,
    dW and db to fp32 accumulation order (the quantized operands agree bit for bit; one code off would move a value
    by ~1e-2 relative). With 16×16 weights the forward's W comes staged (fp16 values), from which Ŵ is rebuilt."""
    sel, rest = _split()
    out = {}
    for backend in ("reference", "emulated"):
        recipe = build_recipe("nvidia_paper", {"gemm_backend": backend, "stochastic_rounding": False,
                                               "weight_2d": weight_2d})
        x, w, b, dy = _leaves(21)
        y = outcontrol_linear(x, w, b, recipe, sr_counter(recipe, 0), cached_rht_signs(recipe.rht_seed, x.device),
                              sel, rest)
        y.backward(dy)
        out[backend] = (y.detach(), x.grad, w.grad, b.grad)
    for what, ref, got in zip(("Y", "dX", "dW", "db"), out["reference"], out["emulated"]):
        assert_matches(got, ref, what)


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="kernels need TRITON_INTERPRET=1 or a GPU")
def test_compiled_fullgraph_gives_the_eager_bits():
    """The OutControl function under torch.compile (aot_eager, fullgraph: no graph break), emulated backend (the
    kernels' custom ops; stochastic rounding drawn in them): the same output and gradients as eager, the SR stream
    advanced once per backward either way."""
    sel, rest = _split()
    recipe = build_recipe("tetrajet2", {"gemm_backend": "emulated"})
    signs = cached_rht_signs(recipe.rht_seed, torch.device("cpu"))
    runs = []
    for compiled in (False, True):
        counter = sr_counter(recipe, 3)
        x, w, b, dy = _leaves(22)

        def f(x, w, b):
            return outcontrol_linear(x, w, b, recipe, counter, signs, sel, rest)

        fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
        y = fn(x, w, b)
        y.backward(dy)
        runs.append((y.detach(), x.grad, w.grad, b.grad, counter.clone()))
    for what, a, c in zip(("Y", "dX", "dW", "db", "counter"), *runs):
        assert torch.equal(a, c), what


def test_ms_eden_dgrad_runs_on_the_rebuilt_weight():
    """With Quartet II's backward (``ms_eden``, preset quartet2) the dgrad is MS-EDEN over every column with Ŵ rebuilt
    from the forward's quantized parts; the rest columns' wgrad is the rest-only linear's (the two GEMMs draw from
    their own role seeds of one call seed), the selected columns' MXFP8."""
    sel, rest = _split()
    recipe = build_recipe("quartet2", {"gemm_backend": "reference", "rht_size": 32, "outcontrol_fraction": 0.1})
    counter = sr_counter(recipe, 4)
    seed = next_sr_seed(counter.clone())
    x, w, b, dy = _leaves(23)
    outcontrol_linear(x, w, b, recipe, counter, None, sel, rest).backward(dy)
    wd = w.detach()
    w_rest, _ = quantize_weight(wd[:, rest], recipe.weight_2d, "reference", four_over_six=recipe.four_over_six,
                                transposed=False)
    w_hat = torch.empty(N, K)
    w_hat[:, rest] = w_rest.dequantize()
    w_hat[:, sel] = quantize_mxfp8(wd[:, sel]).dequantize()
    dx, _ = ms_eden_backward(dy, None, (w_hat, None), call_seed=seed, size=32, backend="reference", need_dx=True,
                             need_dw=False, out_dtypes=(torch.float32, torch.float32))
    assert torch.equal(x.grad, dx)
    xr, wr = x.detach()[:, rest].requires_grad_(), wd[:, rest].clone().requires_grad_()
    nvfp4_linear(xr, wr, None, recipe, sr_counter(recipe, 4)).backward(dy)
    assert torch.equal(w.grad[:, rest], wr.grad)
    assert torch.equal(w.grad[:, sel], _mxfp8_product(dy.t().contiguous(), x.detach()[:, sel].t().contiguous()))


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="kernels need TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("shape", [(64, 96, 64), (70, 33, 224), (1, 130, 32)])
def test_the_addmm_kernel_adds_the_fp32_sums_to_the_addend_and_rounds_once(shape):
    """kernels/mxfp8_addmm.py (ops.mxfp8_gemm with an addend on a kernel backend): c + a·bᵀ with a, b BF16 values
    of MXFP8 blocks (exact products), masked edges, against float64: the sums to fp32 accumulation (K·2⁻²⁴ of
    Σ|products|), then c added and one rounding to BF16 (half an ulp). A 16-bit product rounded before the sum
    (the old path) is off by up to a full ulp more."""
    from titan_nvfp4.kernels.mxfp8_addmm import mxfp8_addmm_tensor

    m, n, k = shape
    g = torch.Generator().manual_seed(m + n + k)
    a = quantize_mxfp8(torch.randn(m, k, generator=g) * 3).dequantize().to(torch.bfloat16)
    b = quantize_mxfp8(torch.randn(n, k, generator=g)).dequantize().to(torch.bfloat16)
    c = (torch.randn(m, n, generator=g) * 4).to(torch.bfloat16)
    out = mxfp8_addmm_tensor(a, b, c)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    prods = a.double() @ b.double().t()
    exact = prods + c.double()
    slack = (a.double().abs() @ b.double().abs().t()) * k * 2.0**-24
    ulp = torch.finfo(torch.bfloat16).eps
    assert ((out.double() - exact).abs() <= exact.abs() * ulp / 2 * (1 + 1e-3) + slack * (1 + ulp)).all()
    with pytest.raises(ValueError, match=r"mxfp8_addmm: a \(.*\).* and c \(3, 3\) do not fit"):
        mxfp8_addmm_tensor(a, b, torch.zeros(3, 3, dtype=torch.bfloat16))


def _losses_and_state(model, steps, xs, opt):
    out = []
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps.step()
        out.append(loss.detach())
    return out


@pytest.mark.parametrize("resume_at", [2, 3])
def test_a_resume_inside_the_window_selects_and_trains_as_the_uninterrupted_run(resume_at, caplog):
    """start 1, steps 3: the forwards of steps 2-4 are summed. Resumed after step 2 or 3, the window's sums come back
    with the per-step state (nvfp4_outcontrol_norms): the same selection, the same losses bit for bit. A state
    without them restarts the sums, logged."""
    xs = [_x(PLANTED if t % 2 else list(range(32)), t, 3.0 + t) for t in range(1, 7)]
    knobs = {"outcontrol_steps": 3}
    model, steps = _convert(**knobs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    whole = _losses_and_state(model, steps, xs, opt)
    assert model.lin._outcontrol_on

    model, steps = _convert(**knobs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = _losses_and_state(model, steps, xs[:resume_at], opt)
    saved = (model.state_dict(), opt.state_dict(), steps.state_dict())
    assert torch.equal(saved[2]["nvfp4_outcontrol_norms"]["lin"], model.lin.outcontrol_norms)
    again, again_steps = _convert(**knobs)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-3)
    again.load_state_dict(saved[0])
    again_opt.load_state_dict(saved[1])
    again_steps.load_state_dict(saved[2])
    rest = _losses_and_state(again, again_steps, xs[resume_at:], again_opt)
    assert torch.equal(torch.stack(first + rest), torch.stack(whole))
    assert torch.equal(again.lin.outcontrol_index, model.lin.outcontrol_index) or not model.lin._outcontrol_on

    lost, lost_steps = _convert(**knobs)
    lost.load_state_dict(saved[0])
    with caplog.at_level(logging.WARNING, logger="titan_nvfp4"):
        lost_steps.load_state_dict({k: v for k, v in saved[2].items() if k != "nvfp4_outcontrol_norms"})
    assert (f"the checkpoint of step {resume_at} has no OutControl sums for 1 layers (e.g. 'lin') inside their "
            "window: the sums restart") in caplog.text


def test_torchtitans_checkpoint_manager_resumes_inside_the_window_bit_for_bit(tmp_path):
    """start 1, steps 3: saved after step 3, two of the window's three forwards summed; the resumed job's sums come
    back from its train_state (nvfp4_outcontrol_norms), so step 4 selects the same channels and steps 4-5 train the
    same bits."""
    from checkpoint_helpers import REF, Job, tokens as _tokens

    oc = {**REF, "outcontrol_fraction": 0.25, "outcontrol_start": 1, "outcontrol_steps": 3}
    a = Job(tmp_path, oc)
    for t in range(1, 4):
        a.step(_tokens(t))
    a.save()
    assert not a.linear("attention.wq")._outcontrol_on
    losses = [a.step(_tokens(t)) for t in (4, 5)]
    b = Job(tmp_path, oc)
    b.load()
    assert b.trainer.step == 3 and not b.linear("attention.wq")._outcontrol_on
    assert torch.equal(torch.stack([b.step(_tokens(t)) for t in (4, 5)]), torch.stack(losses))
    for name in ("attention.wq", "feed_forward.w2"):
        assert b.linear(name)._outcontrol_on
        assert torch.equal(b.linear(name).outcontrol_index, a.linear(name).outcontrol_index)
