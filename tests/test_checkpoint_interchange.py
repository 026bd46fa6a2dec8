"""Checkpoint interchange through TorchTitan's CheckpointManager (DCP, as the Trainer saves and loads):
BF16 ↔ NVFP4, low-rank ↔ plain (directly and through export_dense), the NVFP4 all-gather on ↔ off under
FSDP2, and resuming with a changed recipe knob. Each case is a row of docs/checkpoints.md."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import titan_nvfp4.integration  # noqa: F401  (registers the converters, patches the CheckpointManager)
from titan_nvfp4.modules.amax_history import layers_with_history
from titan_nvfp4.modules.decomposed_linear import DecomposedLinear
from titan_nvfp4.autograd.linear_function import sr_counter
from titan_nvfp4.modules.nvfp4_linear import NVFP4Linear
from titan_nvfp4.numerics.rht import rht_signs
from titan_nvfp4.tools.export_dense import main as export_main
from torchtitan.distributed import ParallelDims
from checkpoint_helpers import ARGS, BLOCK, Job, LORA, REF, parsed_job, tokens













def _dense(job: Job) -> dict[str, torch.Tensor]:
    """{block Linear: the weight it computes} (W = R + U·diag(σ)·V for a low-rank one)."""
    out = {}
    for name in BLOCK:
        m = job.linear(name)
        out[name] = m.dense_weight().detach() if isinstance(m, DecomposedLinear) else m.weight.detach().clone()
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A lora_rank 16 job: one step, saved (step-1), then a second step; what each test compares with."""
    tmp = tmp_path_factory.mktemp("lora")
    job = Job(tmp)
    job.step(tokens(1))  # the saved W must be this step's, not the one TorchTitan cached at start-up
    path = job.save()
    out = SimpleNamespace(tmp=tmp, path=path, dense=_dense(job), state=copy.deepcopy(job.model.state_dict()),
                          residual={n: job.linear(n).weight.detach().clone() for n in BLOCK},
                          exp_avg={n: job.opt.optimizers[0].state[job.linear(n).weight]["exp_avg"].clone()
                                   for n in BLOCK})
    out.loss2 = job.step(tokens(2))
    out.params2 = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    return out


# ------------------------------------------------------------------------------- low-rank -> plain

@pytest.mark.parametrize("keys", [None, REF], ids=["bf16", "nvfp4"])
def test_lowrank_checkpoint_loads_the_full_weight_into_a_model_without_the_branch(lora_run, keys):
    """A lora_rank run's checkpoint, model-only into BF16 or NVFP4 with lora_rank = 0: weight = W (the
    trained R + U·diag(σ)·V), never R alone; the same W export_dense writes."""
    tmp = lora_run.tmp
    plain = Job(tmp, keys, folder=f"plain_{keys is None}", initial=lora_run.path)
    plain.load()
    for name, w in lora_run.dense.items():
        got = plain.linear(name).weight.detach()
        assert torch.allclose(got, w, rtol=0, atol=1e-6), name
        assert (got - lora_run.residual[name]).norm() > 0.3 * w.norm(), f"{name}: R alone lacks the branch's share"
    out = tmp / f"dense_{keys is None}.pt"
    export_main([lora_run.path, str(out)])
    dense = torch.load(out, weights_only=False)  # TorchTitan's layout: model keys on top
    assert not any("lora" in k for k in dense)
    for name in BLOCK:
        assert torch.equal(dense[f"layers.0.{name}.weight"], plain.linear(name).weight), name


def test_lowrank_checkpoint_resumed_as_nvfp4_without_rank_is_refused(lora_run):
    """Full resume (optimizer, SR counts) of a lora_rank run with lora_rank = 0: refused, naming the knob."""
    plain = Job(lora_run.tmp, REF)  # the run's own folder: TorchTitan resumes its latest step
    with pytest.raises(ValueError, match=r"another \[quantize.linear.nvfp4\] lora_rank.*initial_load_model_only"):
        plain.load()


def test_lowrank_checkpoint_resumed_as_bf16_continues_from_the_full_weight(lora_run):
    """Full resume in a BF16 job: W, and R's AdamW moments (dL/dR = dL/dW) for ``weight``."""
    bf16 = Job(lora_run.tmp, None)
    bf16.load()
    assert bf16.trainer.step == 1
    for name, w in lora_run.dense.items():
        p = bf16.linear(name).weight
        assert torch.allclose(p, w, rtol=0, atol=1e-6), name
        assert torch.equal(bf16.opt.optimizers[0].state[p]["exp_avg"], lora_run.exp_avg[name]), name


def test_legacy_lowrank_state_dict_names_export_dense(lora_run):
    """A state dict with weight = R and factors but no lora_residual (written before this format): a
    direct load stops and names export_dense, which folds it; through the CheckpointManager (DCP) the
    message names the checkpoint folder."""
    state = lora_run.state
    legacy = {k: v for k, v in state.items() if not k.endswith("lora_residual")}
    legacy.update({k[: -len("lora_residual")] + "weight": v for k, v in state.items() if k.endswith("lora_residual")})
    import torch.distributed.checkpoint as dcp

    folder = str(lora_run.tmp / "legacy_dcp")  # the same, as TorchTitan's CheckpointManager saved it (flat model keys)
    dcp.save(legacy, checkpoint_id=folder)
    job = Job(lora_run.tmp, LORA, folder="legacy", initial=folder)
    with pytest.raises(ValueError, match="titan_nvfp4.tools.export_dense"):
        job.model.load_state_dict(legacy)
    pattern = (rf"checkpoint {folder} has layers\.0\.\S+\.lora_u but no \S+\.lora_residual.*"
               rf"titan_nvfp4\.tools\.export_dense {folder} dense\.pt")
    with pytest.raises(ValueError, match=pattern):
        job.load()
    torch.save(legacy, lora_run.tmp / "legacy.pt")
    export_main([str(lora_run.tmp / "legacy.pt"), str(lora_run.tmp / "legacy_dense.pt")])
    dense = torch.load(lora_run.tmp / "legacy_dense.pt")
    for name, w in lora_run.dense.items():
        assert torch.allclose(dense[f"layers.0.{name}.weight"], w, rtol=0, atol=1e-6), name


# ------------------------------------------------------------------------------- plain -> low-rank

def test_bf16_checkpoint_into_a_lowrank_model_is_decomposed_at_load(tmp_path):
    """Model-only: the BF16 weights load as W and are split at load; a full resume is refused naming
    lora_rank (the factors have no optimizer state)."""
    bf16 = Job(tmp_path, None, seed=3)
    bf16.step(tokens(1))
    path = bf16.save()
    lora = Job(tmp_path, LORA, folder="lora", initial=path)
    lora.load()
    for name, w in _dense(bf16).items():
        m = lora.linear(name)
        assert bool(m.lora_decomposed) and m._lora_ready, name
        assert torch.allclose(m.dense_weight(), w, rtol=0, atol=1e-5), name
        assert (m.weight - w).norm() > 0.3 * w.norm(), f"{name}: the top-16 directions moved to the branch"
    resumed = Job(tmp_path, LORA)  # bf16's own folder
    with pytest.raises(ValueError, match=r"no low-rank factors.*lora_rank.*initial_load_model_only = true"):
        resumed.load()


# ------------------------------------------------------------------------------------ BF16 <-> NVFP4

def test_bf16_and_nvfp4_resume_each_other(tmp_path):
    """Same model keys: a BF16 checkpoint resumes an NVFP4 job (SR streams start at zero) and an NVFP4
    one a BF16 job (its SR counts are not asked for); weights and AdamW state bit-exact."""
    bf16 = Job(tmp_path, None)
    bf16.step(tokens(1))
    bf16.save()
    nvfp4 = Job(tmp_path, REF)
    nvfp4.load()
    assert nvfp4.trainer.step == 1 and int(nvfp4.linear("attention.wq").sr_counter[1]) == 0
    for (n, p), q in zip(bf16.model.named_parameters(), nvfp4.model.parameters()):
        assert torch.equal(p, q), n
    assert torch.isfinite(nvfp4.step(tokens(2)))
    nvfp4.save()
    again = Job(tmp_path, None)
    again.load()
    assert again.trainer.step == 2
    for (n, p), q in zip(nvfp4.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), n


# ------------------------------------------------------------------------- resume with another knob

def test_lowrank_resume_through_the_checkpoint_manager_is_bit_exact(lora_run):
    """lora_rank 16 with SR: resumed from step-1, step 2 repeats the uninterrupted run's loss and weights."""
    resumed = Job(lora_run.tmp, LORA)
    resumed.load()
    assert torch.equal(resumed.step(tokens(2)), lora_run.loss2)
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, lora_run.params2[n]), n


KNOBS = [{"stochastic_rounding": False}, {"rht": False}, {"weight_2d": False}, {"block_scale_rule": "four_over_six"},
         {"rht_seed": 7, "sr_seed": 5, "rht_round_to_input_dtype": True}, {"backward": "mxfp8"}]


def test_resume_with_a_stateless_knob_changed_continues(tmp_path):
    """Knobs without state (the SR counts are kept whatever stochastic_rounding says): the resumed job
    has the checkpoint's weights, optimizer, step and SR call counts, and trains on with the new setting
    (its own sr_seed's streams and rht_seed's signs). gemm_backend: only 'reference' runs on CPU."""
    a = Job(tmp_path, REF)
    a.step(tokens(1))
    a.save()
    for knob in KNOBS:
        b = Job(tmp_path, {**REF, **knob})
        b.load()
        assert b.trainer.step == 1, knob
        wq = b.linear("attention.wq")
        assert int(wq.sr_counter[1]) == 1, knob
        assert int(wq.sr_counter[0]) == int(sr_counter(wq.recipe, wq.layer_id)[0]), knob  # this run's sr_seed
        assert wq.rht_signs is None or torch.equal(wq.rht_signs, rht_signs(wq.recipe.rht_seed)), knob
        for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
            assert torch.equal(p, q), (knob, n)
        assert torch.isfinite(b.step(tokens(2))), knob


def test_a_branch_from_another_runs_checkpoint_continues_that_run_bit_exactly(tmp_path):
    """A comparison arm that branches (compare: branch_from) loads another run's step folder with
    --checkpoint.initial_load_path and --checkpoint.no_initial_load_model_only into a fresh folder of its own:
    the whole training state (weights, AdamW moments, LR schedule, step, SR counts), so with the same recipe its
    next step is the other run's to the bit, and it saves into its own folder."""
    a = Job(tmp_path, REF, folder="parent")
    a.step(tokens(1))
    path = a.save()
    loss2 = a.step(tokens(2))
    b = Job(tmp_path, REF, folder="branch", initial=path, initial_model_only=False, seed=7)  # another init
    b.load()
    assert b.trainer.step == 1 and int(b.linear("attention.wq").sr_counter[1]) == 1
    assert torch.equal(b.step(tokens(2)), loss2)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    assert b.save() == str(tmp_path / "branch") + "/step-2"
    model_only = Job(tmp_path, REF, folder="model_only", initial=path, seed=7)  # TorchTitan's default: weights only
    model_only.load()
    assert model_only.trainer.step == 0


def test_resume_with_other_bf16_blocks_and_filter_fqns(tmp_path):
    """bf16_first_blocks and filter_fqns changed on resume (same model keys): a layer that became BF16
    drops its SR counts, a newly converted one starts its streams at zero, the others keep theirs."""
    args = dataclasses.replace(ARGS, n_layers=2)
    filters = list(parsed_job().quantize.linear.nvfp4.filter_fqns)
    a = Job(tmp_path, {**REF, "filter_fqns": filters + ["layers.1.attention.wq"]}, args=args)
    assert not isinstance(a.linear("attention.wq", "1"), NVFP4Linear)
    a.step(tokens(1))
    a.save()
    b = Job(tmp_path, {**REF, "bf16_first_blocks": 1, "filter_fqns": filters}, args=args)
    b.load()
    assert b.trainer.step == 1
    assert not any(isinstance(m, NVFP4Linear) for m in b.model.layers["0"].modules())  # now BF16: counts dropped
    assert int(b.linear("attention.wq", "1").sr_counter[1]) == 0  # newly converted: its streams start at zero
    assert int(b.linear("attention.wo", "1").sr_counter[1]) == 1
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def test_resume_with_another_amax_history(tmp_path):
    """activation_amax_history: another length is refused by name; 0 -> N starts empty windows (the
    next step uses X's own amax, as a fresh run's first); N -> 0 drops them."""
    a = Job(tmp_path, {**REF, "activation_amax_history": 4})
    a.step(tokens(1))
    a.save()
    with pytest.raises(ValueError, match="has 4 steps of activation amax window.*activation_amax_history = 2"):
        Job(tmp_path, {**REF, "activation_amax_history": 2}).load()
    none = Job(tmp_path, REF)
    none.load()
    assert torch.isfinite(none.step(tokens(2)))
    none.save()
    windows = Job(tmp_path, {**REF, "activation_amax_history": 4})
    windows.load()
    layers = layers_with_history(windows.model)
    assert windows.trainer.step == 2 and layers and not layers[0].amax_history.ready
    assert all(not m.x_amax_history.any() for m in layers)
    assert torch.isfinite(windows.step(tokens(3)))
    assert layers[0].amax_history.ready and layers[0].x_amax_history[0].all()


# ------------------------------------------------------------- FSDP2: NVFP4 all-gather off -> on -> off

def _fsdp_worker(rank, world, out, tmp, saved_off):
    """FSDP2 over 2 gloo ranks, lora_rank 16 and the NVFP4 all-gather: resume the 1-process checkpoint
    saved with the all-gather off (``saved_off``: its parameters), one step, a CheckpointManager save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight

    mesh = init_device_mesh("cpu", (world,))

    def shard(model):
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        for block in model.layers.values():
            block.set_force_sum_reduction_for_comms(True)

    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    job = Job(tmp, {**LORA, "fsdp_nvfp4_all_gather": True}, dims=dims, shard=shard)
    assert isinstance(job.linear("attention.wq").weight._local_tensor, NVFP4ShardedWeight)
    job.load()  # off -> on: ckpt/step-1, unsharded, plain weights
    assert job.trainer.step == 1 and int(job.linear("attention.wq").sr_counter[0, 1]) == 1  # R's stream
    for n, p in job.model.named_parameters():
        assert torch.equal(p.full_tensor(), saved_off[n]), n
    job.step(tokens(2))
    job.save()
    dense = _dense(job)  # gathers: every rank
    params = {n: p.full_tensor().detach().clone() for n, p in job.model.named_parameters()}
    if rank == 0:
        out.update(dense=dense, params=params)


def test_fsdp2_nvfp4_all_gather_off_and_on_resume_each_other(tmp_path):
    """A 1-process checkpoint saved with the all-gather off resumes under FSDP2 (2 ranks) with it on
    (lora_rank 16: R, factors, AdamW state, step, SR counts); what that saves sharded resumes in one
    process with the knob off bit for bit, and a BF16 model loads W from it."""
    from dist_util import run_ranks

    first = Job(tmp_path, LORA)
    first.step(tokens(1))
    first.save()
    saved_off = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    out = run_ranks(_fsdp_worker, 2, tmp_path, saved_off)
    off = Job(tmp_path, LORA)
    off.load()
    assert off.trainer.step == 2
    for n, p in off.model.named_parameters():
        assert torch.equal(p, out["params"][n]), n
    bf16 = Job(tmp_path, None, folder="bf16", initial=str(tmp_path / "ckpt" / "step-2"))
    bf16.load()
    for name, w in out["dense"].items():
        assert torch.allclose(bf16.linear(name).weight, w, rtol=0, atol=1e-6), name
    assert isinstance(off.linear("attention.wq"), NVFP4Linear)
