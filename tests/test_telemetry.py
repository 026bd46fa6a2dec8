"""Per-layer numerics telemetry (titan_nvfp4/modules/telemetry.py): the statistics on crafted blocks, the
measured steps, the three operands of a converted Linear, and the hand-off to TorchTitan's metrics."""

from __future__ import annotations

import math

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.numerics.nvfp4 import quantize_nvfp4
from titan_nvfp4.training.schedule import StepCounter
from titan_nvfp4.integration_common.metrics_hook import install_metrics_hook
from titan_nvfp4.modules.telemetry import Telemetry, drain_all, operand_stats
from moe_helpers import cpu_triton


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

    from job_helpers import edited_toml, meta_llama, parse, world1

    monkeypatch.setattr(MetricsProcessor, "log", MetricsProcessor.log)  # restored after the test
    cfg = parse(toml=edited_toml(tmp_path, add=("telemetry_every = 50",)))
    model = meta_llama(cfg)
    build_model_converters(cfg, world1()).convert(model)
    t = model.layers["0"].attention.wq.telemetry
    assert t is model.layers["1"].feed_forward.w2.telemetry and t.every == 50 and t.active
    assert getattr(MetricsProcessor.log, "_nvfp4_telemetry", False)
    with pytest.raises(ValueError, match="telemetry_every must be a non-negative integer, got -1"):
        parse(toml=edited_toml(tmp_path, add=("telemetry_every = -1",)))


def test_expert_weight_stats_quantize_each_expert_on_its_own():
    from titan_nvfp4.modules.telemetry import expert_weight_stats

    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 32, 64, generator=g)
    w[1] *= 1e-6  # a tensor scale shared by all experts would flush most of expert 1's blocks
    w[2, :16, :16] = 0  # a zero tile
    got = expert_weight_stats(w)
    per = [operand_stats(w[e], (16, 16)) for e in range(3)]
    assert got["amax"] == max(p["amax"] for p in per)
    assert got["snr_db_worst_expert"] == min(p["snr_db"] for p in per)
    assert got["underflow_pct"] == pytest.approx(sum(p["underflow_pct"] for p in per) / 3)  # equal block counts
    assert got["underflow_pct"] == 0 < operand_stats(w.reshape(96, 64), (16, 16))["underflow_pct"]
    sig = sum(float(w[e].square().sum()) for e in range(3))
    err = sum(float((w[e] - quantize_nvfp4(w[e], (16, 16)).dequantize()).square().sum()) for e in range(3))
    assert got["snr_db"] == pytest.approx(10 * math.log10(sig / err))


@cpu_triton
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_experts_measure_every_grouped_gemm(name, cpu_histc):
    from titan_nvfp4.conversion import convert_experts
    from titan_nvfp4.modules.telemetry import expert_weight_stats
    from moe_helpers import build_moe

    torch.manual_seed(0)
    model, args = build_moe(name)
    convert_experts(model, NVFP4Recipe(gemm_backend="reference"), ["experts"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    counter = StepCounter()
    t = Telemetry(every=5, counter=counter)
    block = model.layers["1"]
    block.moe.experts.telemetry = t
    fqn = "layers.1.moe.experts"
    block.moe.experts.layer_name = fqn
    x = torch.randn(2, 32, args.dim, dtype=block.moe.router.gate.weight.dtype, requires_grad=True)
    block.moe(x).float().square().mean().backward()  # step 1: measured
    got = t.drain()
    gemms = ("w1", "w2", "w3") if name == "deepseek_v3" else ("mlp1_weight", "mlp2_weight")
    want = {f"nvfp4/{fqn}/{g}/{o}" for g in gemms for o in ("weight", "input", "grad_output")}
    assert {k.rsplit("/", 1)[0] for k in got} == want
    w = getattr(block.moe.experts, gemms[0])
    assert got[f"nvfp4/{fqn}/{gemms[0]}/weight/snr_db"] == expert_weight_stats(w.detach())["snr_db"]
    assert all(v == v for v in got.values()), "no NaN statistic"
    counter.step()  # step 2: not a multiple of 5
    block.moe(x).float().sum().backward()
    assert t.drain() == {}


def test_grouped_section_wires_telemetry(tmp_path, monkeypatch):
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from moe_helpers import build_moe

    monkeypatch.setattr(MetricsProcessor, "log", MetricsProcessor.log)  # undo the hook after the test
    job = tmp_path / "job.toml"
    head = ('[job]\ncustom_config_module = "titan_nvfp4.integration.job_config"\n'
            '[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\n'
            'converters = ["quantize.grouped_mm.nvfp4"]\n[quantize.grouped_mm.nvfp4]\n')
    job.write_text(head + "telemetry_every = 25\n")
    cfg = ConfigManager().parse_args(["--job.config_file", str(job)])
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    converters = build_model_converters(cfg, dims)
    model, _ = build_moe("deepseek_v3")
    converters.convert(model)
    experts = [m for m in model.modules() if getattr(m, "GEMMS", None)]
    assert experts and all(m.telemetry is experts[0].telemetry and m.telemetry.every == 25 for m in experts)
    assert getattr(MetricsProcessor.log, "_nvfp4_telemetry", False)
    job.write_text(head + "telemetry_every = -2\n")
    with pytest.raises(Exception, match=r"\[quantize.grouped_mm.nvfp4\] telemetry_every must be a non-negative"):
        ConfigManager().parse_args(["--job.config_file", str(job)])
