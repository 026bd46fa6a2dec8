"""The converters' optimizer-step schedule (schedule.py): bf16_after_fraction switches every NVFP4
layer to high precision at the right step, resumes from TorchTitan's restored train_state step, and
drives the low-rank refresh by that count; the high-precision twins compute exactly the plain products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_nvfp4.integration  # noqa: F401  (registers the converters)
from titan_nvfp4 import NVFP4Linear
from titan_nvfp4.modules.decomposed_linear import DecomposedLinear
from titan_nvfp4.training.schedule import GROUPED_STEPS, LINEAR_STEPS
from titan_nvfp4.integration.experts import NVFP4GptOssExperts, NVFP4GroupedExperts
from titan_nvfp4.modules.lowrank_experts import grouped_linear
from titan_nvfp4.training.schedule import PrecisionSchedule, StepCounter, switch_step
from job_helpers import llama_model, edited_toml, meta_llama, parse, world1
from moe_helpers import build_moe
from fake_trainer import FakeTrainer  # TorchTitan's Trainer checkpoint interface, with our extension


def test_switch_step():
    assert switch_step(0, 100) is None
    assert switch_step(0.2, 100) == 80
    assert switch_step(1, 10) == 0
    assert switch_step(0.25, 10) == 8  # round(2.5) = 2 steps in high precision
    s = PrecisionSchedule(3)
    assert [s.at_step(k) for k in range(5)] == [False, False, False, True, False]
    assert s.high_precision


@pytest.mark.parametrize("value", ["-0.1", "1.5", "true", '"0.5"'])
def test_bad_fraction_stops_the_job_at_parse_time(tmp_path, value):
    toml = edited_toml(tmp_path, add=(f"bf16_after_fraction = {value}",))
    with pytest.raises(Exception, match=r"bf16_after_fraction must be a number in \[0, 1\], got"):
        parse(toml=toml)


def _plain_output(model, tokens):
    """The same weights in TorchTitan's own (unconverted) Llama3."""
    plain = meta_llama()
    plain.to_empty(device="cpu")
    with torch.no_grad():
        plain.init_weights(buffer_device=None)  # the non-persistent RoPE table
    plain.load_state_dict(model.state_dict())  # the same keys: the step counter holds no tensors
    return plain(tokens)


def test_linears_switch_at_the_step_and_after_a_resume(tmp_path):
    keys = ("bf16_after_fraction = 0.5", 'gemm_backend = "reference"', "stochastic_rounding = false")
    model, converters = llama_model(tmp_path, *keys, steps=4)
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert linears and all(not m.high_precision for m in linears)
    tokens = torch.randint(0, 2000, (2, 32))
    want = _plain_output(model, tokens)
    assert not torch.equal(model(tokens), want)  # NVFP4 before the switch
    converters.post_optimizer_hook([model])
    assert not linears[0].high_precision  # after step 1 of 4: steps 3 and 4 run in high precision
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converters.post_optimizer_hook([model])
    assert all(m.high_precision for m in linears)
    assert torch.equal(model(tokens), want)  # every Linear is now F.linear on the same weights
    assert "high precision" in repr(linears[0])

    # resume from the step-1 checkpoint (TorchTitan restores its train_state step): same count, still
    # NVFP4, and the switch one step later
    again, conv2 = llama_model(tmp_path, *keys, steps=4)
    again.load_state_dict(state)
    FakeTrainer(again).load_state_dict({"step": 1, "ntokens_seen": 0})
    counter = getattr(again, LINEAR_STEPS)
    assert isinstance(counter, StepCounter) and counter.count == 1
    lin2 = [m for m in again.modules() if isinstance(m, NVFP4Linear)]
    assert not lin2[0].high_precision
    conv2.post_optimizer_hook([again])
    assert all(m.high_precision for m in lin2) and counter.count == 2

    # resuming after the switch switches before the first forward
    third, _ = llama_model(tmp_path, *keys, steps=4)
    third.load_state_dict(model.state_dict())
    FakeTrainer(third).load_state_dict({"step": 2, "ntokens_seen": 0})
    assert all(m.high_precision for m in third.modules() if isinstance(m, NVFP4Linear))
    assert torch.equal(third(tokens), want)


def test_fraction_one_is_high_precision_from_the_start_and_zero_adds_nothing(tmp_path):
    model, _ = llama_model(tmp_path, "bf16_after_fraction = 1.0", 'gemm_backend = "reference"')
    assert all(m.high_precision for m in model.modules() if isinstance(m, NVFP4Linear))
    assert set(model.state_dict()) == set(meta_llama().state_dict()), "the schedule adds no state-dict keys"
    off, _ = llama_model(tmp_path, 'gemm_backend = "reference"')
    assert not hasattr(off, LINEAR_STEPS)


def test_decomposed_linear_in_high_precision_is_its_dense_weight(tmp_path):
    model, _ = llama_model(tmp_path, "bf16_after_fraction = 1.0", "lora_rank = 16", 'gemm_backend = "reference"')
    m = model.layers["0"].attention.wq
    assert isinstance(m, DecomposedLinear) and m.high_precision
    x = torch.randn(8, m.in_features, dtype=torch.float64)
    with torch.no_grad():
        got = m.double()(x)
        want = F.linear(x, m.dense_weight().double())
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)  # dense_weight merges in fp32


def test_refresh_follows_the_saved_step_count(tmp_path):
    keys = ("lora_rank = 16", "lora_refresh_steps = 2", 'gemm_backend = "reference"')
    model, converters = llama_model(tmp_path, *keys)
    converters.post_optimizer_hook([model])  # step 1
    state = {k: v.clone() for k, v in model.state_dict().items()}
    again, conv2 = llama_model(tmp_path, *keys)
    again.load_state_dict(state)
    FakeTrainer(again).load_state_dict({"step": 1, "ntokens_seen": 0})
    m = again.layers["0"].attention.wq
    with torch.no_grad():
        m.lora_u.add_(0.01 * torch.randn_like(m.lora_u))  # no longer orthonormal
    conv2.post_optimizer_hook([again])  # step 2 of the resumed run: the refresh is due
    assert torch.allclose(m.lora_u.t() @ m.lora_u, torch.eye(16), atol=1e-5)


def test_grouped_linear_equals_per_expert_products():
    torch.manual_seed(0)
    counts = [5, 0, 3, 7]
    x = torch.randn(sum(counts) + 4, 32)  # 4 tail rows past the last expert
    w = torch.randn(4, 16, 32)
    b = torch.randn(4, 16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, offsets, b).double()  # torch._grouped_mm: fp32 at most; float64 reference
    x, w, b = x.double(), w.double(), b.double()
    start = 0
    for e, n in enumerate(counts):
        torch.testing.assert_close(y[start:start + n], x[start:start + n] @ w[e].T + b[e], rtol=1e-5, atol=1e-5)
        start += n
    assert not y[start:].any(), "tail rows are zero"


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_experts_switch_to_torchtitan_numerics(tmp_path, name, cpu_histc):
    """With bf16_after_fraction = 1 the converted experts compute what TorchTitan's own experts do."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.model_converter import build_model_converters

    job = tmp_path / "job.toml"
    job.write_text('[job]\ncustom_config_module = "titan_nvfp4.integration.job_config"\n'
                   f'[model]\nname = "{name}"\nflavor = "debugmodel"\nconverters = ["quantize.grouped_mm.nvfp4"]\n'
                   '[quantize.grouped_mm.nvfp4]\nbf16_after_fraction = 1.0\ngemm_backend = "reference"\n')
    cfg = ConfigManager().parse_args(["--job.config_file", str(job), "--training.steps", "10"])
    model, _ = build_moe(name)
    plain, _ = build_moe(name)
    converters = build_model_converters(cfg, world1())
    converters.convert(model)
    for m in (model, plain):
        m.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    plain.load_state_dict(model.state_dict())
    experts = [m for m in model.modules() if isinstance(m, (NVFP4GroupedExperts, NVFP4GptOssExperts))]
    assert experts and all(m.high_precision for m in experts)
    # the expert modules alone, in BF16 (TorchTitan's gpt-oss experts always compute in BF16)
    ours, ref = model.layers["1"].moe.experts.bfloat16(), plain.layers["1"].moe.experts.bfloat16()
    counts = torch.tensor([16, 0, 32] + [16] * (ours.num_experts - 3))
    x = torch.randn(int(counts.sum()), ours.GEMMS and getattr(ours, ours.GEMMS[0]).shape[-1], dtype=torch.bfloat16)
    got, want = ours(x, counts), ref(x, counts)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)  # the same BF16 grouped GEMMs and bias adds (NVFP4: ~20-25% off)
    converters.post_optimizer_hook([model])
    assert getattr(model, GROUPED_STEPS).count == 1
