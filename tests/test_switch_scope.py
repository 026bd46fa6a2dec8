"""bf16_after_scope, NVIDIA's precision switch with a scope (arXiv 2509.25149): "forward_backward" (the default)
switches all three GEMMs of the dense Linears to high precision after the bf16_after_fraction step; "forward"
switches the forward GEMM alone, whose output is then F.linear's bit for bit while dgrad and wgrad stay the
NVFP4 backward (same operands, same SR draws). Bad values stop the TOML parse and titan_nvfp4.convert naming the
key and the value; a resumed run switches at the same step with the scope of the job that resumes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import titan_nvfp4
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.autograd.body_graphs import BodyGraphs
from titan_nvfp4.autograd.linear_function import nvfp4_linear, sr_counter
from titan_nvfp4.modules.decomposed_linear import DecomposedLinear
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.ops.backends import interpreting
from titan_nvfp4.recipe.nvfp4_recipe import build_recipe
from titan_nvfp4.training.schedule import LINEAR_STEPS, PrecisionSchedule
from graph_helpers import StandInCapture
from job_helpers import edited_toml, parse, world1
from linear_helpers import assert_matches, reference
from fake_trainer import FakeTrainer  # TorchTitan's Trainer checkpoint interface, with our extension

K, N, STEPS = 64, 48, 4
QUARTET2 = Path(__file__).resolve().parents[1] / "configs" / "quartet2.toml"
REF = 'gemm_backend = "reference"'


def _grouped_toml(tmp_path, *lines):
    """The job file with a [quantize.grouped_mm.nvfp4] section of ``lines`` appended (after the linear section)."""
    path = edited_toml(tmp_path)
    path.write_text(path.read_text() + "[quantize.grouped_mm.nvfp4]\n" + "".join(f"{x}\n" for x in lines))
    return path


# ------------------------------------------------------------------------------ 1. parse time

@pytest.mark.parametrize("lines, needles", [
    (('bf16_after_fraction = 0.2', 'bf16_after_scope = "backward"'),
     ["[quantize.linear.nvfp4] bf16_after_scope must be one of ['forward_backward', 'forward'], got 'backward'"]),
    (('bf16_after_fraction = 0.2', 'bf16_after_scope = 1'), ["bf16_after_scope must be one of", "got 1"]),
    (('bf16_after_scope = "forward"',),
     ["[quantize.linear.nvfp4] bf16_after_scope = 'forward' needs bf16_after_fraction > 0"]),
], ids=["unknown_scope", "not_a_string", "scope_without_fraction"])
def test_bad_scope_stops_the_toml_parse(tmp_path, lines, needles):
    with pytest.raises(ValueError) as e:
        parse(toml=edited_toml(tmp_path, add=lines))
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_the_experts_refuse_the_forward_scope_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm.nvfp4\] bf16_after_scope = 'forward': the routed "
                                         r"experts switch forward and backward together"):
        parse(toml=_grouped_toml(tmp_path, "bf16_after_fraction = 0.2", 'bf16_after_scope = "forward"'))
    cfg = parse(toml=_grouped_toml(tmp_path, "bf16_after_fraction = 0.2", 'bf16_after_scope = "forward_backward"'))
    assert cfg.quantize.grouped_mm.nvfp4.bf16_after_scope == "forward_backward"


def test_the_toml_and_the_command_line_set_the_scope(tmp_path):
    cfg = parse(toml=edited_toml(tmp_path, add=("bf16_after_fraction = 0.2", 'bf16_after_scope = "forward"')))
    assert cfg.quantize.linear.nvfp4.bf16_after_scope == "forward"
    assert parse().quantize.linear.nvfp4.switch() == (0.0, "forward_backward")  # the default: no switch
    cli = parse("--quantize.linear.nvfp4.bf16_after_fraction", "0.2", "--quantize.linear.nvfp4.bf16_after_scope",
                "forward")
    assert cli.quantize.linear.nvfp4.bf16_after_scope == "forward"


class Tiny(nn.Module):
    """Two Linears (the converters add their step counter as a submodule, which nn.Sequential would call)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(K, N), nn.Linear(N, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _tiny():
    torch.manual_seed(0)
    return Tiny()


@pytest.mark.parametrize("knobs, experts, needle", [
    ({"bf16_after_fraction": 0.5, "bf16_after_scope": "fwd"}, False,
     "[quantize.linear.nvfp4] bf16_after_scope must be one of ['forward_backward', 'forward'], got 'fwd'"),
    ({"bf16_after_scope": "forward"}, False,
     "[quantize.linear.nvfp4] bf16_after_scope = 'forward' needs bf16_after_fraction > 0"),
    ({}, {"bf16_after_fraction": 0.5, "bf16_after_scope": "forward"}, "[quantize.grouped_mm.nvfp4] bf16_after_scope "
     "= 'forward': the routed experts switch forward and backward together"),
    ({"bf16_after_fraction": 0.5, "bf16_after_scope": "forward"}, True, "titan_nvfp4.convert: pass experts as a dict"),
], ids=["unknown_scope", "scope_without_fraction", "experts_dict", "experts_true_copies_it"])
def test_convert_refuses_bad_scopes_by_name(knobs, experts, needle):
    model = _tiny()
    with pytest.raises(ValueError) as e:
        titan_nvfp4.convert(model, total_steps=STEPS, experts=experts, gemm_backend="reference", **knobs)
    assert needle in str(e.value), str(e.value)
    assert all(type(m) is not NVFP4Linear for m in model.modules()), "a refused conversion converts nothing"


# ------------------------------------------------------------------------------ 2. the schedule

def test_the_schedule_flips_each_flag_once_at_the_switch_step():
    fwd = PrecisionSchedule(3, "forward")
    assert [fwd.at_step(k) for k in range(5)] == [False, False, False, True, False]
    assert (fwd.high_precision_forward, fwd.high_precision_backward, fwd.high_precision) == (True, False, False)
    both = PrecisionSchedule(3)
    assert [both.at_step(k) for k in range(5)] == [False, False, False, True, False]
    assert (both.high_precision_forward, both.high_precision_backward, both.high_precision) == (True, True, True)
    never = PrecisionSchedule(None, "forward")
    assert not never.at_step(10) and not never.high_precision_forward
    with pytest.raises(ValueError, match=r"scope must be one of \['forward_backward', 'forward'\], got 'both'"):
        PrecisionSchedule(3, "both")


# ------------------------------------------------------------------------------ 3. the numerics

def _converted(scope: str, **knobs):
    """_tiny() through titan_nvfp4.convert, switching after step 2 of 4 with ``scope`` (reference backend, SR and
    RHT on: nvidia_paper)."""
    log = logging.getLogger("test_switch_scope")
    model, steps = titan_nvfp4.convert(_tiny(), total_steps=STEPS, gemm_backend="reference", bf16_after_fraction=0.5,
                                       bf16_after_scope=scope, logger=log, **knobs)
    return model, steps


def _grads(fn, x, params, dy):
    """fn(x, *params) and the gradients of x and params for dY = ``dy``."""
    x = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in params]
    y = fn(x, *params)
    y.backward(dy)
    return y.detach(), [x.grad] + [p.grad for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "autocast_bf16"])
def test_forward_scope_runs_f_linear_forward_and_the_nvfp4_backward(dtype, caplog):
    caplog.set_level(logging.INFO, logger="test_switch_scope")
    model, steps = _converted("forward")
    assert "Linear layers switch the forward GEMMs to high precision after optimizer step 2 (bf16_after_fraction " \
           "= 0.5 of 4 steps, bf16_after_scope = forward; dgrad and wgrad stay NVFP4)" in caplog.text
    m = model.a
    assert isinstance(m, NVFP4Linear) and not m.high_precision_forward
    x = torch.randn(2, 8, K)
    dy = torch.randn(2, 8, N).to(dtype)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with autocast:
        assert not torch.equal(m(x), F.linear(x, m.weight, m.bias))  # NVFP4 before the switch
    steps.step()
    assert not m.high_precision_forward
    steps.step()
    assert "Linear layers switched the forward GEMMs to high precision after optimizer step 2 (bf16_after_scope = " \
           "forward)" in caplog.text
    assert m.high_precision_forward and not m.high_precision and "forward in high precision" in repr(m)

    call, counter = m.sr_calls, m.sr_counter.clone()
    xm = x.clone().requires_grad_(True)
    with autocast:
        y = m(xm)
    y.backward(dy)
    got = [xm.grad, m.weight.grad, m.bias.grad]
    assert m.sr_calls == call + 1, "the backward still draws its stochastic rounding"
    with autocast:
        want_y = F.linear(x, m.weight, m.bias)
        nvfp4_y, want = _grads(lambda x, w, b: nvfp4_linear(x, w, b, m.recipe, counter, m.rht_signs), x,
                               [m.weight, m.bias], dy)
    assert y.dtype == want_y.dtype == dtype and torch.equal(y.detach(), want_y), "the forward is F.linear's"
    assert not torch.equal(nvfp4_y, want_y)
    for name, a, b in zip(("dX", "dW", "db"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: not the NVFP4 backward's"
    if dtype == torch.float32:  # and that backward is the recipe's, from the high-precision W and X (test_linear.py)
        ref = reference(x.reshape(-1, K), m.weight.detach(), m.bias.detach(), dy.reshape(-1, N), m.recipe,
                        m.layer_id, call)
        assert_matches(got[0].reshape(-1, K), ref["dx"], "dX")
        assert_matches(got[1], ref["dw"], "dW")
        assert_matches(got[2], ref["db"], "db")


def test_full_switch_stops_the_sr_draws_and_runs_f_linear():
    model, steps = _converted("forward_backward")
    m = model.a
    x = torch.randn(16, K)
    model(x).square().sum().backward()
    drawn = m.sr_calls
    assert drawn == 1
    steps.step()
    steps.step()
    assert m.high_precision and m.high_precision_forward
    m.zero_grad()
    y = m(x)
    y.backward(torch.ones(16, N))
    assert torch.equal(y.detach(), F.linear(x, m.weight, m.bias)) and m.sr_calls == drawn, "no draws after it"
    assert torch.equal(m.weight.grad, torch.ones(16, N).t() @ x)  # F.linear's backward


def test_decomposed_linear_r_and_nvfp4_branch_follow_the_forward_scope():
    model, steps = _converted("forward", lora_rank=16, lora_nvfp4=True)
    m = model.a
    assert isinstance(m, DecomposedLinear)
    steps.step()
    steps.step()
    x = torch.randn(16, K)
    calls = m.sr_counter[:, 1].clone()
    y = m(x)
    h = F.linear(x, m.lora_v) * m.lora_sigma
    assert torch.equal(y, F.linear(x, m.weight, m.bias) + F.linear(h, m.lora_u)), "R and the branch: F.linear"
    y.square().sum().backward()
    assert torch.equal(m.sr_counter[:, 1], calls + 1), "each of the three GEMMs' backward still draws"


def test_emulated_backend_and_replayed_graphs_give_the_same_bits():
    """The forward-high-precision mode on the emulated kernels (the Triton interpreter on a CPU), eagerly and with its
    bodies replayed as graphs (eager_graphs; a stand-in capture on the CPU, test_body_graphs.py): F.linear's forward,
    the NVFP4 backward's gradients and SR draws, bit for bit."""
    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = NVFP4Recipe(gemm_backend="emulated")
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(32, 16, generator=g).to(dev), torch.randn(32, generator=g).to(dev)
    calls = [(torch.randn(16, 16, generator=g).to(dev), torch.randn(16, 32, generator=g).to(dev)) for _ in range(2)]
    runs = []
    for mode in ("nvfp4", "eager", "graphs"):
        weight, bias = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        counter, signs = sr_counter(recipe, 3, dev), rht_signs(recipe.rht_seed, dev)
        graphs = BodyGraphs(StandInCapture([counter]), check_device=False) if mode == "graphs" else None
        out = []
        for x, dy in calls:
            x = x.clone().requires_grad_(True)
            weight.grad = bias.grad = None
            y = nvfp4_linear(x, weight, bias, recipe, counter, signs, graphs=graphs,
                             high_precision_forward=mode != "nvfp4")
            y.backward(dy)
            out.append([y.detach(), x.grad, weight.grad, bias.grad, counter.clone()])
        runs.append(out)
        if graphs is not None:
            assert graphs.replays == 1  # the second forward (a backward replays from its third call)
    for (nv, eager, graphed), (x, _) in zip(zip(*runs), calls):
        assert torch.equal(eager[0], F.linear(x, w0, b0)) and not torch.equal(nv[0], eager[0])
        for name, a, b, c in zip(("y", "dX", "dW", "db", "SR counter"), nv, eager, graphed):
            assert torch.equal(b, c), f"{name}: graphs differ from eager"
            if name != "y":
                assert torch.equal(a, b), f"{name}: not the NVFP4 backward's"


# ------------------------------------------------------------------------------ 4. resume

def _toml_model(tmp_path, scope: str):
    """_tiny() converted by TorchTitan 0.2's converter from the job file (reference backend, 4 steps, switch after
    step 2 with ``scope``)."""
    from torchtitan.protocols.model_converter import build_model_converters

    toml = edited_toml(tmp_path, add=(REF, "bf16_after_fraction = 0.5", f'bf16_after_scope = "{scope}"'))
    cfg = parse("--training.steps", str(STEPS), toml=toml)
    converters = build_model_converters(cfg, world1())
    model = _tiny()
    converters.convert(model)
    return model, converters


def _flags(model) -> list[tuple[bool, bool]]:
    return [(m.high_precision_forward, m.high_precision) for m in model.modules() if isinstance(m, NVFP4Linear)]


def test_a_resumed_run_switches_at_the_same_step_with_its_scope(tmp_path):
    model, converters = _toml_model(tmp_path, "forward")
    converters.post_optimizer_hook([model])
    assert _flags(model) == [(False, False)] * 2  # after step 1 of 4
    converters.post_optimizer_hook([model])
    assert _flags(model) == [(True, False)] * 2  # forward only, after step 2

    # resume from step 1 (TorchTitan restores its train_state step): still NVFP4, the switch one step later
    again, conv2 = _toml_model(tmp_path, "forward")
    FakeTrainer(again).load_state_dict({"step": 1, "ntokens_seen": 0})
    assert getattr(again, LINEAR_STEPS).count == 1 and _flags(again) == [(False, False)] * 2
    conv2.post_optimizer_hook([again])
    assert _flags(again) == [(True, False)] * 2

    # resuming past the switch switches before the first forward, with the resumed job's scope: the scope is no
    # state, so a run saved with "forward" resumes with "forward_backward" (and back) from its first step
    for scope, flags in (("forward", (True, False)), ("forward_backward", (True, True))):
        third, _ = _toml_model(tmp_path, scope)
        FakeTrainer(third).load_state_dict({"step": 2, "ntokens_seen": 0})
        assert _flags(third) == [flags] * 2, scope


def test_the_plain_api_resume_switches_at_the_same_step():
    model, steps = _converted("forward")
    steps.step()
    state = steps.state_dict()
    again, steps2 = _converted("forward")
    steps2.load_state_dict(state)
    assert _flags(again) == [(False, False)] * 2
    steps2.step()
    assert _flags(again) == [(True, False)] * 2


# ------------------------------------------------------------------------------ 5. a preset that carries the switch

def _switch_preset(tmp_path, *lines, name="switched.toml"):
    """A recipe file: the quartet2 preset's plus ``lines`` (its precision switch), as `recommended` might be."""
    path = tmp_path / name
    path.write_text(QUARTET2.read_text() + "".join(f"{x}\n" for x in lines))
    return path


def test_a_preset_sets_the_switch_and_the_section_overrides_it(tmp_path):
    preset = _switch_preset(tmp_path, "bf16_after_fraction = 0.18", 'bf16_after_scope = "forward"')
    section = parse(toml=edited_toml(tmp_path, {"recipe": f'"{preset}"'})).quantize.linear.nvfp4
    assert section.switch() == (0.18, "forward")
    assert section.build_recipe() == build_recipe("quartet2", section.overrides()), "the switch stays out of it"
    cli = parse("--quantize.linear.nvfp4.recipe", str(preset), "--quantize.linear.nvfp4.bf16_after_scope",
                "forward_backward").quantize.linear.nvfp4
    assert cli.switch() == (0.18, "forward_backward")
    off = parse("--quantize.linear.nvfp4.recipe", str(preset), "--quantize.linear.nvfp4.bf16_after_fraction",
                "0").quantize.linear.nvfp4
    assert off.switch() == (0.0, "forward"), "fraction 0 turns the preset's switch off; its scope is then inert"
    assert parse("--quantize.linear.nvfp4.recipe", "quartet2").quantize.linear.nvfp4.switch() == \
        (0.0, "forward_backward")


def test_the_plain_api_runs_a_presets_switch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="test_switch_scope")
    preset = _switch_preset(tmp_path, "bf16_after_fraction = 0.5", 'bf16_after_scope = "forward"')
    log = logging.getLogger("test_switch_scope")
    model, steps = titan_nvfp4.convert(_tiny(), str(preset), total_steps=STEPS, gemm_backend="reference",
                                       rht_size=16, logger=log)
    assert "bf16_after_scope = forward; dgrad and wgrad stay NVFP4" in caplog.text
    steps.step()
    steps.step()
    assert _flags(model) == [(True, False)] * 2 and model.a.recipe.ms_eden
    with pytest.raises(ValueError, match=r"bf16_after_fraction = 0.5 needs the run's total number of optimizer "
                                         r"steps"):
        titan_nvfp4.convert(_tiny(), str(preset), gemm_backend="reference", rht_size=16)


@pytest.mark.parametrize("lines, needle", [
    (("bf16_after_fraction = 1.5",), "bf16_after_fraction must be a number in [0, 1], got 1.5 (from the recipe"),
    (("bf16_after_fraction = 0.2", 'bf16_after_scope = "fwd"'),
     "bf16_after_scope must be one of ['forward_backward', 'forward'], got 'fwd' (from the recipe"),
], ids=["fraction", "scope"])
def test_a_presets_bad_switch_is_refused_naming_the_recipe(tmp_path, lines, needle):
    preset = _switch_preset(tmp_path, *lines)
    with pytest.raises(ValueError) as e:
        parse(toml=edited_toml(tmp_path, {"recipe": f'"{preset}"'}))
    assert needle in str(e.value) and str(preset) in str(e.value), str(e.value)


def test_the_experts_refuse_a_presets_forward_scope_unless_turned_off(tmp_path):
    preset = _switch_preset(tmp_path, "bf16_after_fraction = 0.2", 'bf16_after_scope = "forward"')
    grouped = (f'recipe = "{preset}"', "ms_eden = false", "rht_size = 16")
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm.nvfp4\] bf16_after_scope = 'forward' \(from the "
                                         r"recipe .*switched.toml'\): the routed experts switch forward and backward"):
        parse(toml=_grouped_toml(tmp_path, *grouped))
    cfg = parse(toml=_grouped_toml(tmp_path, *grouped, "bf16_after_fraction = 0"))
    assert cfg.quantize.grouped_mm.nvfp4.switch() == (0, "forward")
