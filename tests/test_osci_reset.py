"""TetraJet-v2's OsciReset (modules/osci_reset.py, the osci_reset_* knobs): which weight elements count as oscillating
(their FP4 value moved more than osci_reset_threshold times as far as their master weight over the window), the reset
(the master set to the grid point the forward quantizes it to), the steps it happens at, its resume bit for bit, FSDP2
shards, and the parse-time refusals. The weights follow prescribed trajectories through the real per-step core
(titan_nvfp4.convert's TrainingSteps): each "optimizer step" writes the next weight, then ``steps.step()``."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch import nn

import titan_nvfp4
from titan_nvfp4.modules.osci_reset import OPEN, RESET, TRACK, OsciReset
from titan_nvfp4.ops.quantize import quantize_weight
from titan_nvfp4.training.train_state import OSCI_KEY

from dist_util import run_ranks
from job_helpers import toml_error

U = 0.875  # the decode scale of every tile below: tensor amax 6U = 5.25 gives S = 2688 / 5.25 = 512, e_b = 448
N = 32


class _Net(nn.Module):
    def __init__(self, out_features: int = N, in_features: int = N):
        super().__init__()
        self.lin = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x):
        return self.lin(x)


def _base() -> torch.Tensor:
    """All elements 1U (far from any rounding boundary), a 6U in every 16×16 tile: every tile's grid is U·E2M1."""
    w = torch.full((N, N), U)
    w[::16, ::16] = 6 * U
    return w


def _convert(total_steps: int = 0, **knobs):
    knobs = {"filter_fqns": [], "gemm_backend": "reference", **knobs}
    return titan_nvfp4.convert(_Net(), total_steps=total_steps, **knobs)


def _drive(trajectory: list[torch.Tensor], **knobs) -> list[torch.Tensor]:
    """The weight after each step of ``trajectory`` (step t writes trajectory[t - 1], then the per-step core runs)."""
    model, steps = _convert(**knobs)
    out = []
    for w in trajectory:
        with torch.no_grad():
            model.lin.weight.copy_(w)
        steps.step()
        out.append(model.lin.weight.detach().clone())
    return out


def _oscillate(steps: int, delta: float, centre: float = 2.5 * U, at=(3, 5)) -> list[torch.Tensor]:
    """Element ``at`` alternates centre + δ (odd steps) and centre − δ (even steps): with centre 2.5U, the boundary
    between the grid points 2U and 3U, its FP4 value moves U per step and its master 2δ."""
    out = []
    for t in range(1, steps + 1):
        w = _base()
        w[at] = centre + (delta if t % 2 else -delta)
        out.append(w)
    return out


def test_the_schedule_opens_tracks_and_resets_at_its_steps():
    o = OsciReset(every=10, window=3, threshold=8.0)
    phases = {s: o.phase(s) for s in range(0, 31)}
    assert [s for s, p in phases.items() if p == OPEN] == [10, 20, 30]
    assert [s for s, p in phases.items() if p == TRACK] == [11, 12, 13, 21, 22, 23]
    assert [s for s, p in phases.items() if p == RESET] == [14, 24]
    late = OsciReset(every=10, window=3, threshold=8.0, start_step=25)  # the first window opens at a multiple of 10
    assert [s for s in range(40) if late.phase(s) == RESET] == [34]
    with pytest.raises(ValueError, match="every = 4 leaves no step for the reset after a window of 3 steps"):
        OsciReset(every=4, window=3, threshold=8.0)


def test_an_oscillating_weight_is_reset_to_its_grid_point_a_steady_or_still_one_is_not():
    """every 6, window 3: opens after step 6, sums steps 7-9, resets after step 10. Element (3, 5) flips between 2U and
    3U by ±0.01 (ratio U / 0.02 = 43.75); (7, 1) climbs 0.3U a step through several grid points (ratio about 1);
    (9, 9) moves ±0.01 a step without leaving its grid point (its FP4 value never moves); the rest stand still."""
    traj = _oscillate(12, 0.01)
    for t, w in enumerate(traj, 1):
        w[7, 1] = (1.2 + 0.3 * t) * U
        w[9, 9] = 1.1 * U + 0.01 * (t % 2)
    after = _drive(traj, osci_reset_every=6, osci_reset_window=3)
    for t in range(1, 13):
        if t != 10:  # the core writes the weights at the reset step only
            assert torch.equal(after[t - 1], traj[t - 1]), t
    changed = (after[9] != traj[9]).nonzero().tolist()
    assert changed == [[3, 5]]
    assert after[9][3, 5] == 2 * U  # step 10 is even: 2.5U − 0.01 rounds to 2U, its grid point, exactly


@pytest.mark.parametrize("threshold, reset", [(6.0, {9, 7}), (8.0, {9}), (10.0, set())])
def test_the_threshold_is_the_ratio_of_fp4_to_master_movement(threshold, reset):
    """Two elements flip between 2U and 3U each step, one with master movement U / 9 (ratio 9), one U / 7 (ratio 7)."""
    traj = []
    for t in range(1, 13):
        w = _base()
        sign = 1 if t % 2 else -1
        w[2, 2] = 2.5 * U + sign * U / 18  # |ΔW| = U / 9
        w[20, 20] = 2.5 * U + sign * U / 14  # |ΔW| = U / 7
        traj.append(w)
    after = _drive(traj, osci_reset_every=6, osci_reset_window=3, osci_reset_threshold=threshold)
    ratios = {(2, 2): 9, (20, 20): 7}
    assert {ratios[tuple(i)] for i in (after[9] != traj[9]).nonzero().tolist()} == reset


@pytest.mark.parametrize("window, reset", [(2, True), (4, False)])
def test_only_the_windows_steps_count(window, reset):
    """every 8: the window opens after step 8. Element (3, 5) flips twice (steps 9, 10: ratio 43.75), then walks
    0.5 a step for two steps (FP4 value 2U, then 1.5U): over 2 steps it oscillates, over 4 its ratio is
    2.5U / 1.04 = 2.1. Before the window it flips at every step, which counts for nothing."""
    traj = _oscillate(8, 0.01)  # steps 1-8: flips
    base = 2.5 * U
    for w in (base + 0.01, base - 0.01, base - 0.51, base - 1.01, base - 1.01, base - 1.01):  # steps 9-14
        traj.append(_base())
        traj[-1][3, 5] = w
    after = _drive(traj, osci_reset_every=8, osci_reset_window=window)
    reset_step = 8 + window + 1
    changed = [t for t in range(1, 15) if not torch.equal(after[t - 1], traj[t - 1])]
    assert changed == ([reset_step] if reset else [])
    if reset:  # step 11 holds 2.5U − 0.51 = 1.6775, whose grid point is 2U
        assert after[reset_step - 1][3, 5] == 2 * U


def _reset_steps(traj: list[torch.Tensor], total_steps: int = 0, **knobs) -> list[int]:
    """The steps after which the core changed the weight the trajectory wrote."""
    model, steps = _convert(total_steps, osci_reset_every=4, osci_reset_window=1, **knobs)
    out = []
    for t, w in enumerate(traj, 1):
        with torch.no_grad():
            model.lin.weight.copy_(w)
        steps.step()
        if not torch.equal(model.lin.weight, w):
            out.append(t)
    return out


def test_resets_start_at_the_start_fraction_and_stop_at_the_precision_switch():
    """every 4, window 1: resets after steps 6, 10, 14; from half of 16 steps on (start step 8) after 10 and 14; with
    the layers in high precision after step 8 (bf16_after_fraction 0.5) only after 6."""
    traj = _oscillate(16, 0.01)
    assert _reset_steps(traj) == [6, 10, 14]
    assert _reset_steps(traj, 16, osci_reset_start_fraction=0.5) == [10, 14]
    assert _reset_steps(traj, 16, bf16_after_fraction=0.5) == [6]


@pytest.mark.parametrize("weight_2d, rule", [(True, "six"), (False, "six"), (True, "four_over_six"),
                                             (False, "four_over_six")])
def test_the_reset_lands_on_the_grid_the_forward_quantizes_to(weight_2d, rule):
    """Random weights (one 16×16 tile 8× larger), every element pushed ±δ each step: those within δ of a rounding
    boundary flip. At the reset they take the forward quantizer's value of that step (ops quantize_weight, the
    whole weight's tensor scale), which the next quantization leaves where it is; the others keep their bits."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(N, N, generator=g) * 0.05
    w0[:16, :16] *= 8
    signs = torch.randint(0, 2, (N, N), generator=g) * 2 - 1.0
    delta = 2e-4
    traj = [w0 + delta * signs * (1 if t % 2 else -1) for t in range(1, 8)]
    after = _drive(traj, osci_reset_every=4, osci_reset_window=2, weight_2d=weight_2d, block_scale_rule=rule)
    four_over_six = rule == "four_over_six"
    grid, _ = quantize_weight(traj[6], weight_2d, "reference", None, four_over_six=four_over_six)
    flagged = after[6] != traj[6]
    assert 0 < int(flagged.sum()) < N * N // 4
    assert torch.equal(after[6][flagged], grid.dequantize()[flagged])
    again, _ = quantize_weight(after[6], weight_2d, "reference", None, four_over_six=four_over_six)
    assert torch.equal(again.dequantize()[flagged], after[6][flagged])


# -- resume ------------------------------------------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _State:
    """A checkpoint's Stateful: model, optimizer and the NVFP4 per-step state, as docs/plain_pytorch_loop.py holds."""

    def __init__(self, model, opt, steps):
        self.model, self.opt, self.steps = model, opt, steps

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "nvfp4": self.steps.state_dict()}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.steps.load_state_dict(state["nvfp4"])


KNOBS = dict(filter_fqns=[], gemm_backend="reference", osci_reset_every=4, osci_reset_window=2)


def _run(first: int, last: int, ckpt=None, save_at: int = 0, resume: bool = False, drop_margins: bool = False):
    """AdamW steps first..last of a small NVFP4 MLP (SR on: its streams resume too); returns the losses and the
    final weights. Every step's batch comes from its step number."""
    torch.manual_seed(0)
    model, steps = titan_nvfp4.convert(_MLP(), **KNOBS)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    state = _State(model, opt, steps)
    if resume:
        if drop_margins:
            saved = torch.load(ckpt, weights_only=False)
            del saved["nvfp4"][OSCI_KEY]
            state.load_state_dict(saved)
        else:
            holder = {"train": state}
            dcp.load(holder, checkpoint_id=str(ckpt))
        assert steps.steps == first - 1
    losses = []
    for t in range(first, last + 1):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(t))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps.step()
        losses.append(loss.item())
        if t == save_at:
            if drop_margins:
                torch.save(state.state_dict(), ckpt)
            else:
                dcp.save({"train": state}, checkpoint_id=str(ckpt))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_resume_inside_a_window_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, caplog):
    """Windows open after steps 4 and 8 and reset after 7 and 11; the checkpoint of step 5 holds a half-summed window
    (DCP, the template of a fresh run asking for the margins)."""
    with caplog.at_level(logging.INFO, logger="titan_nvfp4"):
        whole, w_whole = _run(1, 11, tmp_path / "ckpt", save_at=5)
    resets = [r.getMessage() for r in caplog.records if "OsciReset after optimizer step" in r.getMessage()]
    assert [m.split("step ")[1].split(":")[0] for m in resets] == ["7", "11"]
    assert all(not m.split(": ")[1].startswith("0 of") for m in resets)  # both resets set some elements
    resumed, w_resumed = _run(6, 11, tmp_path / "ckpt", resume=True)
    assert resumed == whole[5:]
    assert all(torch.equal(a, b) for a, b in zip(w_whole, w_resumed))


def test_a_checkpoint_without_margins_restarts_the_open_window(tmp_path, caplog):
    _run(1, 5, tmp_path / "ckpt.pt", save_at=5, drop_margins=True)
    with caplog.at_level(logging.WARNING, logger="titan_nvfp4"):
        _run(6, 8, tmp_path / "ckpt.pt", resume=True, drop_margins=True)
    assert ("the checkpoint of step 5 has no OsciReset margin for 2 layers (e.g. 'up') inside an open window"
            in caplog.text)


# -- FSDP2 ---------------------------------------------------------------------------------------------------------

def _sharded_trajectory() -> list[torch.Tensor]:
    """A 48×32 weight (2 ranks: 24 rows each, so the 16×16 tiles of rows 16-31 straddle them), rank 0's rows 8×
    larger (a shard quantized with its own amax would get other scales), every element pushed ±δ each step."""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(48, 32, generator=g) * 0.05
    w0[:24] *= 8
    signs = torch.randint(0, 2, (48, 32), generator=g) * 2 - 1.0
    return [w0 + 2e-4 * signs * (1 if t % 2 else -1) for t in range(1, 8)]


def _fsdp_worker(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    model, steps = titan_nvfp4.convert(_Net(48, 32), filter_fqns=[], gemm_backend="reference", osci_reset_every=4,
                                       osci_reset_window=2)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    after = []
    for w in _sharded_trajectory():
        with torch.no_grad():
            model.lin.weight.copy_(distribute_tensor(w, mesh, [Shard(0)]))
        steps.step()
        after.append(model.lin.weight.detach().full_tensor().clone())
    margin = steps.state_dict()[OSCI_KEY]["lin"]
    if rank == 0:
        out.update(after=after, margin_is_dtensor=isinstance(margin, DTensor),
                   margin_local=tuple(margin.to_local().shape))


@pytest.mark.long
def test_fsdp2_shards_reset_as_the_whole_weight_does():
    out = run_ranks(_fsdp_worker, 2)
    model, steps = titan_nvfp4.convert(_Net(48, 32), filter_fqns=[], gemm_backend="reference", osci_reset_every=4,
                                       osci_reset_window=2)
    traj = _sharded_trajectory()
    for t, w in enumerate(traj, 1):
        with torch.no_grad():
            model.lin.weight.copy_(w)
        steps.step()
        assert torch.equal(out["after"][t - 1], model.lin.weight), t
    assert int((out["after"][6] != traj[6]).sum()) > 0  # the reset after step 7 set some elements
    assert out["margin_is_dtensor"] and out["margin_local"] == (24, 32)


# -- refusals --------------------------------------------------------------------------------------------------

S = r"\[quantize.linear.nvfp4\] "


@pytest.mark.parametrize("knobs, message", [
    ({"osci_reset_every": -1}, S + r"osci_reset_every must be a non-negative integer \(0 = off\), got -1"),
    ({"osci_reset_every": 100, "osci_reset_window": 0}, S + "osci_reset_window must be a positive integer, got 0"),
    ({"osci_reset_every": 100, "osci_reset_threshold": 0.0},
     S + "osci_reset_threshold must be a positive finite number, got 0.0"),
    ({"osci_reset_every": 100, "osci_reset_start_fraction": 1.0},
     S + r"osci_reset_start_fraction must be a number in \[0, 1\), got 1.0"),
    ({"osci_reset_every": 40}, S + "osci_reset_every = 40 needs to be at least osci_reset_window \\+ 2 = 52"),
    ({"osci_reset_window": 30}, S + "osci_reset_window = 30 needs osci_reset_every > 0"),
    ({"osci_reset_threshold": 16.0}, S + "osci_reset_threshold = 16.0 needs osci_reset_every > 0"),
    ({"osci_reset_every": 200, "fsdp_nvfp4_all_gather": True},
     S + "osci_reset_every = 200 cannot be combined with fsdp_nvfp4_all_gather = true"),
])
def test_bad_values_are_refused_at_parse_time_by_name(tmp_path, knobs, message):
    lines = [f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()]
    assert pytest.raises(ValueError, _convert, **knobs).match(message)
    assert str(pytest.raises(ValueError, _convert, **knobs).value) == toml_error(tmp_path, *lines)


def test_the_experts_refuse_it_and_a_start_fraction_needs_the_runs_length(tmp_path):
    message = ("[quantize.grouped_mm.nvfp4] osci_reset_every = 100: OsciReset applies to the dense Linears only (set "
               "it in [quantize.linear.nvfp4])")
    assert message in toml_error(tmp_path, "osci_reset_every = 100", grouped=True)
    with pytest.raises(ValueError) as e:
        _convert(experts={"osci_reset_every": 100})
    assert message in str(e.value)
    with pytest.raises(ValueError, match=r"osci_reset_start_fraction = 0.6 needs the run's total number of optimizer"):
        _convert(osci_reset_every=100, osci_reset_start_fraction=0.6)


# -- TorchTitan 0.2's CheckpointManager ----------------------------------------------------------------------------

@pytest.mark.long
def test_torchtitans_checkpoint_manager_resumes_a_window_and_runs_with_or_without_the_knob(tmp_path):
    """The TOML path: the margins ride in train_state, a resume inside a window is bit for bit; a run without the
    knob resumes that checkpoint (its margins unread), and a run with it resumes a checkpoint without them."""
    from checkpoint_helpers import REF, Job, tokens as _tokens

    osci = {**REF, "osci_reset_every": 3, "osci_reset_window": 1}  # opens after step 3, sums step 4, resets after 5
    a = Job(tmp_path, osci)
    for t in range(1, 5):
        a.step(_tokens(t))
    a.save()
    saved = {k: v.clone() for k, v in a.trainer.state_dict()[OSCI_KEY].items()}
    assert len(saved) == 7 and any(bool(v.any()) for v in saved.values())
    loss = a.step(_tokens(5))
    b = Job(tmp_path, osci)
    b.load()
    assert b.trainer.step == 4
    assert all(torch.equal(v, b.trainer.state_dict()[OSCI_KEY][k]) for k, v in saved.items())
    assert torch.equal(b.step(_tokens(5)), loss)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    plain = Job(tmp_path, REF)
    plain.load()
    assert plain.trainer.step == 4 and OSCI_KEY not in plain.trainer.state_dict()
    plain.step(_tokens(5))
    plain.save()
    c = Job(tmp_path, osci)  # step 5's checkpoint, written without the knob
    c.load()
    assert c.trainer.step == 5 and torch.isfinite(c.step(_tokens(6)))


def test_plain_local_tensor_parallel_shards_are_refused_by_name():
    model, steps = _convert(osci_reset_every=4, osci_reset_window=1)
    model.lin.local_tp = (0, None)  # as TorchTitan 0.3's spmd_types parallelize sets it
    with pytest.raises(NotImplementedError, match="NVFP4 Linear 'lin': osci_reset_every is not supported on plain"):
        steps.sections[0].attach([model], [[model.lin]])
