"""Per-layer numerics telemetry (titan_nvfp4/telemetry.py): the statistics on crafted blocks, the
measured steps, the three operands of a converted Linear, and the hand-off to TorchTitan's metrics."""

from __future__ import annotations

import math

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
from titan_nvfp4.schedule import StepCounter
from titan_nvfp4.telemetry import Telemetry, drain_all, install_metrics_hook, operand_stats


def test_operand_stats_on_crafted_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 96, generator=g) + 0.5  # 96 blocks of ordinary values
    x[0, 0:16] = 2688.0  # the tensor amax: S = 1
    x[1, 16:32] = 1e-6  # 1e-6/6 is below E4M3's smallest subnormal: the scale flushes to 0
    x[2, 32:48] = 0.0  # a zero block is not "underflowed"
    x[3, 48:64] = 6.375  # 6.375/6 = 1.0625 ties to the E4M3 value 1: the block's max clips at 6
    s = operand_stats(x)
    assert s["amax"] == 2688.0
    assert s["underflow_pct"] == pytest.approx(100 / 96)
    q = quantize_nvfp4(x)
    assert torch.equal(q.dequantize()[3, 48:64], torch.full((16,), 6.0))  # the premise: clipped
    assert s["saturated_pct"] >= 100 / 96
    err = (x - q.dequantize()).square().sum()
    assert s["snr_db"] == pytest.approx(10 * math.log10(float(x.square().sum() / err)))
    assert operand_stats(torch.zeros(16, 32))["snr_db"] == float("inf")  # exact: no noise at all


def test_a_linear_measures_its_three_operands_on_the_measured_steps():
    counter = StepCounter()
    t = Telemetry(every=2, counter=counter)
    lin = NVFP4Linear(64, 32, recipe=NVFP4Recipe(gemm_backend="reference"), name="layers.0.wq")
    lin.telemetry = t
    x = torch.randn(4, 8, 64, requires_grad=True)
    lin(x).square().sum().backward()  # step 1: measured
    got = t.drain()
    assert {k.rsplit("/", 1)[0] for k in got} == {f"nvfp4/layers.0.wq/{o}" for o in ("weight", "input", "grad_output")}
    assert got["nvfp4/layers.0.wq/input/amax"] == float(x.detach().abs().max())
    assert got["nvfp4/layers.0.wq/weight/snr_db"] == pytest.approx(operand_stats(lin.weight, (16, 16))["snr_db"])
    counter.step()  # step 2: a multiple of 2, measured
    lin(x).sum().backward()
    assert t.drain()
    counter.step()  # step 3: not measured
    lin(x).sum().backward()
    assert t.drain() == {}


def test_pending_telemetry_reaches_torchtitans_metrics_log(monkeypatch):
    from torchtitan.components.metrics import MetricsProcessor

    seen = {}

    def fake_log(self, step, avg, mx, gn, extra_metrics=None):
        seen.update(extra_metrics or {})

    monkeypatch.setattr(MetricsProcessor, "log", fake_log)
    install_metrics_hook()
    drain_all()
    t = Telemetry(every=1)
    t.record("w1", "input", torch.ones(2, 16))
    MetricsProcessor.log(None, 1, 2.0, 2.0, 1.0, extra_metrics={"lr": 0.1})
    assert seen["lr"] == 0.1 and seen["nvfp4/w1/input/amax"] == 1.0
    assert t.pending == {}


def test_converter_wires_telemetry_and_validates_the_knob(tmp_path, monkeypatch):
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.protocols.model_converter import build_model_converters

    from test_converter import edited_toml, meta_llama, parse, world1

    monkeypatch.setattr(MetricsProcessor, "log", MetricsProcessor.log)  # restored after the test
    cfg = parse(toml=edited_toml(tmp_path, add=("telemetry_every = 50",)))
    model = meta_llama(cfg)
    build_model_converters(cfg, world1()).convert(model)
    t = model.layers["0"].attention.wq.telemetry
    assert t is model.layers["1"].feed_forward.w2.telemetry and t.every == 50 and t.active
    assert getattr(MetricsProcessor.log, "_nvfp4_telemetry", False)
    with pytest.raises(ValueError, match="telemetry_every must be a non-negative integer, got -1"):
        parse(toml=edited_toml(tmp_path, add=("telemetry_every = -1",)))
