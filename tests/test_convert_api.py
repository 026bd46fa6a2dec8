"""titan_nvfp4.convert, the framework-free entry point: the plain-PyTorch loop of docs/plain_pytorch_loop.py trains the
same bits as the TOML path (TorchTitan 0.2's converter from the job file, its post-optimizer hook) on the same model
and seed; its checkpoint resumes bit for bit; bad knobs get the job file's messages; models without TorchTitan
convert too."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

import titan_nvfp4
from titan_nvfp4 import NVFP4Linear
from titan_nvfp4.training.train_state import KEY, HISTORY_KEY
from torchtitan.protocols.model_converter import _registry_model_converter_cls

from job_helpers import ROOT, edited_toml, parse, world1

spec = importlib.util.spec_from_file_location("plain_pytorch_loop", ROOT / "docs" / "plain_pytorch_loop.py")
loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loop)

STEPS, SEQ, BATCH = 4, 32, 2
#: the job file's section plus knobs whose per-step state differs between steps: the late switch after step 2,
#: two-step amax windows; the reference backend (CPU)
SECTION = {"gemm_backend": '"reference"', "bf16_after_fraction": "0.5", "activation_amax_history": "2"}
KNOBS = dict(filter_fqns=["output"], eager_graphs="small", gemm_backend="reference", bf16_after_fraction=0.5,
             activation_amax_history=2)


class HookSteps:
    """The TOML path's per-step object: TorchTitan's post-optimizer hook of the converter (as its trainer calls it)."""

    def __init__(self, converter, model):
        self.converter, self.model, self.steps = converter, model, 0

    def step(self):
        self.steps += 1
        self.converter.post_optimizer_hook(self.model)


def _train(model, steps, **kw):
    return loop.train(model, steps, steps=STEPS, batch=BATCH, seq=SEQ, device="cpu", log_every=0, warmup=0, **kw)


@pytest.mark.long
def test_plain_loop_equals_the_toml_path_bit_for_bit(tmp_path):
    cfg = parse("--training.steps", str(STEPS), toml=edited_toml(tmp_path, add=tuple(f"{k} = {v}" for k, v in
                                                                                     SECTION.items())))
    converter = _registry_model_converter_cls["quantize.linear.nvfp4"](cfg, world1())
    toml_model = loop.build_model("debugmodel", SEQ)
    converter.convert(toml_model)
    toml = _train(toml_model, HookSteps(converter, toml_model))

    model, steps = titan_nvfp4.convert(loop.build_model("debugmodel", SEQ), "nvidia_paper", total_steps=STEPS, **KNOBS)
    plain = _train(model, steps)
    assert plain["losses"] == toml["losses"]  # bit for bit, every step
    assert all(m.high_precision for m in model.modules() if isinstance(m, NVFP4Linear))  # switched after step 2
    assert [type(m) for m in model.modules()] == [type(m) for m in toml_model.modules()]


@pytest.mark.long
def test_the_loops_checkpoint_resumes_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    model, steps = titan_nvfp4.convert(loop.build_model("debugmodel", SEQ), total_steps=STEPS, **KNOBS)
    whole = _train(model, steps, checkpoint=ckpt, save_at=2)["losses"]
    model, steps = titan_nvfp4.convert(loop.build_model("debugmodel", SEQ), total_steps=STEPS, **KNOBS)
    resumed = _train(model, steps, checkpoint=ckpt, resume=True)["losses"]
    assert steps.steps == STEPS and resumed == whole[2:]
    state = steps.state_dict()
    assert set(state) == {"steps", KEY, HISTORY_KEY} and state["steps"] == STEPS


def _toml_error(tmp_path, key: str, value: str) -> str:
    with pytest.raises(ValueError) as e:
        toml = edited_toml(tmp_path, replace={key: value}) if key == "recipe" else edited_toml(tmp_path, add=(
            f"{key} = {value}",))
        parse(toml=toml)
    return str(e.value)


@pytest.mark.parametrize("key, value, toml", [("block_scale_rule", "four", '"four"'), ("lora_rank", 24, "24"),
                                               ("bf16_after_fraction", 2.0, "2.0"), ("recipe", "nvidia", '"nvidia"')])
def test_bad_knobs_get_the_job_files_messages(tmp_path, key, value, toml):
    with pytest.raises(ValueError) as e:
        titan_nvfp4.convert(loop.build_model(), **{"recipe": "nvidia_paper", key: value})
    assert str(e.value) == _toml_error(tmp_path, key, toml) and "quantize.linear.nvfp4" in str(e.value)


def test_unknown_and_misplaced_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown key 'stochastic' .*valid keys: .*stochastic_rounding"):
        titan_nvfp4.convert(loop.build_model(), stochastic=True)
    with pytest.raises(ValueError, match=r"needs the run's total number of optimizer steps"):
        titan_nvfp4.convert(loop.build_model(), bf16_after_fraction=0.1)
    with pytest.raises(ValueError, match=r"total_steps must be a non-negative integer, got -1"):
        titan_nvfp4.convert(loop.build_model(), total_steps=-1)
    with pytest.raises(ValueError, match=r"lora_dtype = 'float32' needs a low-rank branch"):
        titan_nvfp4.convert(loop.build_model(), lora_dtype="float32")
    with pytest.raises(ValueError, match=r"no routed-expert module matched fqns \['experts'\]"):
        titan_nvfp4.convert(loop.build_model(), experts=True)


class _PlainMLP(nn.Module):
    """A model that knows nothing of TorchTitan (no init_weights)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("meta", [False, True])
def test_a_plain_model_converts_and_trains(meta, caplog):
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = _PlainMLP()
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        model, steps = titan_nvfp4.convert(model, filter_fqns=["head"], gemm_backend="reference", telemetry_every=1)
    assert "converted 2 Linear layers" in caplog.text and "kept head in high precision" in caplog.text
    assert [type(m) for m in (model.up, model.down, model.head)] == [NVFP4Linear, NVFP4Linear, nn.Linear]
    if meta:
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps.step()
    assert steps.steps == 2 and all(m.sr_calls == 2 for m in (model.up, model.down))
    stats = steps.telemetry()
    assert {k.split("/")[1] for k in stats} == {"up", "down"} and all(v == v for v in stats.values())
    with pytest.raises(ValueError, match=r"titan_nvfp4.convert: the model already holds NVFP4 layers \(e.g. 'up'\) "
                       "from an earlier convert"):  # its knobs would be ignored, its step counter lost
        titan_nvfp4.convert(model, filter_fqns=["head"], gemm_backend="reference")
    assert type(model.head) is nn.Linear


@pytest.mark.parametrize("preset", ["nvidia_paper", "quartet2", "tetrajet2"])
def test_a_sequential_keeps_its_children_and_switches_on_time(preset):
    """The step counter is an attribute, not a child: nn.Sequential calls every child (it raised
    NotImplementedError on the counter before), and the children and state-dict keys stay the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 32))
    keys, children = list(model.state_dict()), len(model)
    extra = {"outcontrol_start": 1, "outcontrol_steps": 1} if preset == "tetrajet2" else {}
    model, steps = titan_nvfp4.convert(model, preset, filter_fqns=["3"], gemm_backend="reference", total_steps=4,
                                       bf16_after_fraction=0.5, bf16_after_scope="forward", **extra)
    assert len(model) == children  # OutControl adds its selection to its layers' keys (0.outcontrol_index, ...)
    assert [k for k in model.state_dict() if "outcontrol" not in k] == keys
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    switched = []
    for _ in range(4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps.step()
        switched.append(model[0].precision_schedule.high_precision_forward)
    assert switched == [False, True, True, True]  # the last half (2 of 4 steps) from the forward after step 2


def test_a_bad_tune_thread_count_is_named_at_conversion(monkeypatch):
    # Not at the first autotuned launch, minutes into a job.
    monkeypatch.setenv("TITAN_NVFP4_TUNE_THREADS", "lots")
    with pytest.raises(ValueError, match="TITAN_NVFP4_TUNE_THREADS='lots'"):
        titan_nvfp4.convert(_PlainMLP(), filter_fqns=["head"], gemm_backend="auto")


def test_a_refused_conversion_leaves_the_model_as_it_was_and_a_retry_follows_its_advice():
    """Every layer is checked before the first swap: a retry with the error's own advice converts and schedules."""
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 100))
    with pytest.raises(ValueError, match=r"cannot convert Linear '2' to NVFP4: out_features=100 not a multiple of 16 "
                                         r"\(exclude it with filter_fqns\)"):
        titan_nvfp4.convert(model, gemm_backend="reference", total_steps=4, bf16_after_fraction=0.5)
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]
    model, steps = titan_nvfp4.convert(model, gemm_backend="reference", filter_fqns=["2"], total_steps=4,
                                       bf16_after_fraction=0.5)
    assert [type(m) for m in model] == [NVFP4Linear, nn.GELU, nn.Linear]
    for _ in range(2):
        model(torch.randn(16, 64)).square().mean().backward()
        steps.step()
    assert model[0].high_precision  # the schedule the retry asked for


def test_a_lora_rank_on_a_meta_model_without_init_weights_splits_when_the_user_redecomposes(caplog):
    """docs/plain_pytorch.md: no init_weights, so the user calls redecompose after initializing; a forward before
    that names the layer."""
    from titan_nvfp4.modules.decomposed_linear import DecomposedLinear, redecompose

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 32))
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        model, steps = titan_nvfp4.convert(model, gemm_backend="reference", filter_fqns=["3"], lora_rank=16)
    assert "call titan_nvfp4.modules.decomposed_linear.redecompose(model) after initializing" in caplog.text
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.Linear.reset_parameters(m)
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"DecomposedLinear '0' used before its weights were decomposed: .*"
                                           r"redecompose\(model\)"):
        model(x)
    full = model[0].weight.detach().clone()
    redecompose(model)
    assert isinstance(model[2], DecomposedLinear) and model[0].lora_u.abs().sum() > 0
    torch.testing.assert_close(model[0].dense_weight(), full, rtol=1e-5, atol=1e-6)  # W = R + U·diag(σ)·V
    model(x).square().mean().backward()
    assert model[0].lora_u.grad is not None


def test_a_cast_to_bf16_keeps_the_amax_windows_in_fp32_and_a_move_keeps_the_sr_counts():
    """model.to(bfloat16) casts parameters, not the per-layer fp32 state; a copied counter (a device move) is told
    apart from uninitialized memory (to_empty onto another device) by its streams' bases."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model, steps = titan_nvfp4.convert(model, gemm_backend="reference", activation_amax_history=2)
    x = torch.randn(16, 64) * 3.1
    for _ in range(2):
        model(x).square().mean().backward()
        steps.step()
    layer = model[2]
    window, counter = layer.x_amax_history.clone(), layer.sr_counter.clone()
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and layer.x_amax_history.dtype == torch.float32
    assert torch.equal(layer.x_amax_history, window) and torch.equal(layer.sr_counter, counter)
    assert layer._counter_copied() and layer.sr_calls == 2
    with torch.no_grad():
        layer.sr_counter.fill_(-7)  # what uninitialized memory may hold
    assert not layer._counter_copied()
