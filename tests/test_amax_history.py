"""activation_amax_history (amax_history.py): X's tensor scale from the max amax of the last N optimizer
steps; the current amax on the first step; one scale per step whatever the number of forwards; the
window shared by all ranks, rolled by the converter's post-optimizer hook, restored on resume."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import titan_nvfp4.integration  # noqa: F401  (registers the converters)
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.modules.amax_history import AmaxHistory, layers_with_history, register_buffers, roll
from titan_nvfp4.integration import train_state
from titan_nvfp4.autograd.linear_function import nvfp4_linear
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
from titan_nvfp4.ops import operand_amax, quantize_activation
from dist_util import run_ranks
from job_helpers import llama_model, edited_toml, parse
from fake_trainer import FakeTrainer

RECIPE = NVFP4Recipe(gemm_backend="reference", stochastic_rounding=False)


def _layer(n: int = 3, recipe: NVFP4Recipe = RECIPE, seed: int = 0) -> NVFP4Linear:
    torch.manual_seed(seed)
    m = NVFP4Linear(64, 32, recipe=recipe, layer_id=0)
    register_buffers(m, AmaxHistory(n))
    return m


def _plain_twin(m: NVFP4Linear) -> NVFP4Linear:
    p = NVFP4Linear(64, 32, recipe=m.recipe, layer_id=0)
    p.load_state_dict(m.state_dict())
    return p


def _amaxes(x: torch.Tensor, m: NVFP4Linear) -> torch.Tensor:
    return operand_amax(x.reshape(-1, 64), True, m.rht_signs, "reference")


def test_first_step_is_the_current_amax_then_the_window_max():
    m = _layer()
    plain = _plain_twin(m)
    x1 = torch.randn(32, 64)
    y1 = m(x1)
    assert torch.equal(y1, plain(x1)), "empty history: X's own amax, as without a history"
    assert torch.equal(m.x_amax_pending, _amaxes(x1, m)), "the step's amaxes (row, RHT column) are recorded"
    assert m.x_amax_pending[1] > 0 and m.x_amax_pending[1] != m.x_amax_pending[0]
    roll([m])
    assert torch.equal(m.x_amax_history[0], _amaxes(x1, m)) and not m.x_amax_history[1:].any()
    assert not m.x_amax_pending.any() and m.amax_history.ready

    x2 = 0.25 * torch.randn(32, 64)  # a smaller X: scaled with step 1's larger amax now
    y2 = m(x2)
    assert not torch.equal(y2, plain(x2))
    want = nvfp4_linear(x2, m.weight, m.bias, RECIPE, signs=m.rht_signs, x_amax=_amaxes(x1, m))
    assert torch.equal(y2, want)


def test_scale_uses_the_history_and_saturates_above_it():
    m = _layer()
    x1 = torch.randn(32, 64)
    m(x1)
    roll([m])
    hist = m.x_amax_history.amax(0)
    x3 = 4 * torch.randn(32, 64)  # outgrows the history
    xq, _ = quantize_activation(x3, False, None, "reference", hist)
    ref = quantize_nvfp4(x3, amax=hist[0])  # the reference quantizer with that amax
    assert torch.equal(xq.data, ref.data) and torch.equal(xq.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    deq = xq.dequantize(torch.float32)
    # codes clip at ±6 and scales at 448: nothing decodes above the history's amax
    assert deq.abs().max() <= hist[0] * (1 + 1e-6) < x3.abs().max()
    assert (xq.scale.float() == 448).any()


def test_one_scale_per_step_whatever_the_forwards():
    m = _layer()
    xa, xb = torch.randn(16, 64), 3 * torch.randn(16, 64)
    m(xa)
    m(xa)  # an activation-checkpoint recompute: same amax, nothing changes
    assert torch.equal(m.x_amax_pending, _amaxes(xa, m))
    m(xb)  # a second microbatch
    assert torch.equal(m.x_amax_pending, torch.maximum(_amaxes(xa, m), _amaxes(xb, m)))
    roll([m])
    y_first = m(xa)
    m(xb)
    assert torch.equal(m(xa), y_first), "every forward of a step uses the window's scale"


def test_no_grad_forwards_use_the_history_and_record_nothing():
    m = _layer()
    m(torch.randn(8, 64))
    roll([m])
    with torch.no_grad():
        y = m(5 * torch.randn(8, 64))
    assert not m.x_amax_pending.any() and torch.isfinite(y).all()


def test_window_drops_the_oldest_step():
    m = _layer(n=2)
    x = torch.randn(16, 64)
    for scale in (4.0, 1.0, 2.0):
        m(scale * x)
        roll([m])
    want = torch.stack([_amaxes(2 * x, m), _amaxes(x, m)])
    assert torch.equal(m.x_amax_history, want), "step 1 (amax x4) left the 2-step window"


def test_non_finite_x_poisons_the_output_not_the_history():
    m = _layer()
    m(torch.randn(8, 64))
    roll([m])
    x = torch.randn(8, 64)
    x[3, 5] = float("inf")
    y = m(x)
    assert torch.isnan(y[3]).all()
    assert torch.isfinite(m.x_amax_pending).all() and m.x_amax_pending[0] < float("inf")


def test_backward_runs_with_the_history_scale():
    m = _layer()
    x = torch.randn(32, 64, requires_grad=True)
    m(x).sum().backward()
    roll([m])
    m.zero_grad()
    x2 = torch.randn(32, 64, requires_grad=True)
    m(x2).square().sum().backward()
    assert torch.isfinite(m.weight.grad).all() and torch.isfinite(x2.grad).all()
    # wgrad's Xᵀ operand took the history's column amax: a twin given the same amaxes agrees exactly
    t = _plain_twin(m)
    y = nvfp4_linear(x2, t.weight, t.bias, RECIPE, signs=t.rht_signs, x_amax=m.x_amax_history.amax(0))
    y.square().sum().backward()
    assert torch.equal(t.weight.grad, m.weight.grad)


@pytest.mark.parametrize("value", ["-1", "true", '"4"', "2.5"])
def test_bad_length_stops_the_job_at_parse_time(tmp_path, value):
    with pytest.raises(Exception, match="activation_amax_history must be a non-negative integer"):
        parse(toml=edited_toml(tmp_path, add=(f"activation_amax_history = {value}",)))


def test_refused_with_pipeline_parallelism(tmp_path):
    from torchtitan.distributed import ParallelDims
    from titan_nvfp4.integration.converter import NVFP4LinearConverter

    cfg = parse(toml=edited_toml(tmp_path, add=("activation_amax_history = 4",)))
    pp2 = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=2)
    with pytest.raises(ValueError, match="activation_amax_history = 4 is not supported with pipeline parallelism"):
        NVFP4LinearConverter(cfg, pp2)


def test_converter_wires_it_and_resume_restores_it(tmp_path):
    keys = ("activation_amax_history = 3", 'gemm_backend = "reference"', "stochastic_rounding = false")
    model, converters = llama_model(tmp_path, *keys)
    layers = layers_with_history(model)
    assert layers and all(isinstance(m, NVFP4Linear) for m in layers)
    assert not any("amax" in k for k in model.state_dict()), "model keys stay TorchTitan's"
    assert not any(m.x_amax_history.any() for m in layers), "zero-filled when materialized"
    tokens = torch.randint(0, 2000, (2, 32))
    model(tokens).float().mean().backward()
    converters.post_optimizer_hook([model])
    assert all(m.amax_history.ready and m.x_amax_history[0, 0] > 0 for m in layers)
    y = model(tokens)

    trainer = FakeTrainer(model)
    trainer.step = 1
    dcp.save({"train_state": trainer}, checkpoint_id=str(tmp_path / "step-1"))

    fresh, _ = llama_model(tmp_path, *keys)
    assert not layers_with_history(fresh)[0].amax_history.ready
    t2 = FakeTrainer(fresh)
    dcp.load({"train_state": t2}, checkpoint_id=str(tmp_path / "step-1"))
    fresh.load_state_dict(model.state_dict())
    assert t2.step == 1 and all(m.amax_history.ready for m in layers_with_history(fresh))
    for a, b in zip(layers, layers_with_history(fresh)):
        assert torch.equal(a.x_amax_history, b.x_amax_history)
    assert torch.equal(fresh(tokens), y), "the resumed model quantizes X with the same scales"


def test_resume_refuses_another_window_length():
    m = _layer(n=3)
    other = _layer(n=5)
    with pytest.raises(ValueError, match="has 3 steps, this run's activation_amax_history = 5"):
        train_state.load_amax_histories([nn.Sequential(other)], {"0": m.x_amax_history})


def _two_rank_worker(rank, world, out):
    m = _layer(seed=0)  # same weights on both ranks, different data
    torch.manual_seed(100 + rank)
    x = (1 + 3 * rank) * torch.randn(16, 64)
    m(x)
    mine = m.x_amax_pending.clone()
    roll([m])
    gathered = [torch.zeros(2) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine)
    out[rank] = (m.x_amax_history[0].clone(), torch.stack(gathered).amax(0))


def test_ranks_share_one_history():
    out = run_ranks(_two_rank_worker, 2)
    (h0, want), (h1, _) = out[0], out[1]
    assert torch.equal(h0, want) and torch.equal(h1, want)
