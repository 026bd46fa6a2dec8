"""NVFP4 Linears under tensor parallelism (distributed/tensor_parallel.py) on 2 and 4 gloo ranks with
torch's ColwiseParallel / RowwiseParallel: every rank quantizes its shards with the whole operand's
tensor amax, so outputs and gradients equal one process up to fp32 summation order (rowwise partial
sums, colwise dX); without the cross-rank amax they would not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import titan_nvfp4.integration  # noqa: F401
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.distributed.tensor_parallel import local
from titan_nvfp4.numerics.rht import rht_signs
from dist_util import run_ranks
from moe_helpers import histc_for_cpu

RNE = NVFP4Recipe(gemm_backend="reference", stochastic_rounding=False)


class MLP(nn.Module):
    def __init__(self, recipe: NVFP4Recipe, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.w1 = NVFP4Linear(dim, hidden, recipe=recipe, layer_id=0, name="w1")
        self.w2 = NVFP4Linear(hidden, dim, recipe=recipe, layer_id=1, name="w2")

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _weights(dim=64, hidden=128, world=2):
    """Weights whose shards have very different amaxes: a shard's own amax would change its scales."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(hidden, dim, generator=g) * 0.1
    w1[: hidden // world] *= 8.0  # rank 0's rows (colwise)
    w2 = torch.randn(dim, hidden, generator=g) * 0.1
    w2[:, -hidden // world:] *= 8.0  # the last rank's columns (rowwise)
    b1, b2 = torch.randn(hidden, generator=g) * 0.1, torch.randn(dim, generator=g) * 0.1
    x = torch.randn(2, 16, dim, generator=g)
    return dict(w1=w1, w2=w2, b1=b1, b2=b2), x


def _load(model: MLP, w: dict) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, value in (("w1.weight", w["w1"]), ("w2.weight", w["w2"]), ("w1.bias", w["b1"]),
                            ("w2.bias", w["b2"])):
            p = model.get_parameter(name)
            p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value)


def _grads(model: nn.Module) -> dict:
    """{parameter name: its whole gradient} (a collective for DTensors: every rank calls it), names without
    TorchTitan's activation-checkpoint and torch.compile wrappers."""
    from torch.distributed.tensor import DTensor

    return {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""):
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _tp_mlp(world: int, recipe: NVFP4Recipe, w: dict) -> MLP:
    """The MLP built on meta, w1 colwise and w2 rowwise over all ranks (torch's TP styles), materialized
    as TorchTitan does (its buffers become replicated DTensors) and loaded with ``w``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = MLP(recipe)
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    model.to_empty(device="cpu")
    _load(model, w)
    return model


def _tp_worker(rank, world, out, w, x, recipe, reduce_amax):
    if not reduce_amax:  # the control: each rank with its own shard's amax
        import titan_nvfp4.autograd.linear_function as lf

        lf.all_reduce_max = lambda a, group: a
    model = _tp_mlp(world, recipe, w)
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    y.square().sum().backward()
    grads = _grads(model)  # full_tensor() is a collective: every rank
    if rank == 0:
        out.update(y=y.detach().clone(), dx=xr.grad.clone(), **grads)
    try:  # bypassing the plan's input hook: a plain tensor is refused, not silently given a partial dX
        model.w1.forward(x)
        out[f"plain{rank}"] = None
    except ValueError as e:
        out[f"plain{rank}"] = str(e)
    out[f"signs{rank}"] = local(model.w1.rht_signs).clone()
    out[f"counter{rank}"] = local(model.w2.sr_counter).clone()


def _one_process(w, x, recipe):
    model = MLP(recipe)
    _load(model, w)
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    y.square().sum().backward()
    return dict(y=y.detach(), dx=xr.grad, **_grads(model))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("world", [2, 4])
def test_colwise_rowwise_equal_one_process(world):
    w, x = _weights(world=world)
    ref = _one_process(w, x, RNE)
    out = run_ranks(_tp_worker, world, w, x, RNE, True)
    for key in ("y", "dx", "w1.weight", "w1.bias", "w2.weight", "w2.bias"):
        assert _rel(out[key], ref[key]) < 1e-5, key  # fp32 summation order only
    assert "w1" in out["plain0"] and "needs a DTensor input" in out["plain0"]
    # the SR/RHT buffers were filled on every rank through the replicated DTensors
    signs = rht_signs(RNE.rht_seed)
    assert all(torch.equal(out[f"signs{r}"], signs) for r in range(world))


def test_without_cross_rank_amax_the_shards_quantize_differently():
    w, x = _weights()
    ref = _one_process(w, x, RNE)
    out = run_ranks(_tp_worker, 2, w, x, RNE, False)
    assert _rel(out["y"], ref["y"]) > 1e-3  # so the test above can fail


def _history_worker(rank, world, out, w, x, recipe):
    """Two steps on one X under autocast: step 1 quantizes w2's sharded X with the amax the tensor-parallel path
    reduces (linear_function._forward), step 2 with the one the amax history recorded (NVFP4Linear._history_amax),
    all-reduced by roll."""
    from titan_nvfp4.modules.amax_history import AmaxHistory, register_buffers, roll

    model = _tp_mlp(world, recipe, w)
    history = AmaxHistory(1)
    for m in (model.w1, model.w2):
        register_buffers(m, history)
    ys = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys.append(model(x).detach())  # grad enabled: the column amax (RHT'd Xᵀ) is the wgrad operand's
        roll([model.w1, model.w2])
    out[f"y{rank}"] = ys


def test_history_and_tensor_parallel_take_one_amax_of_x():
    """X's amaxes have one computation (linear_function.x_amaxes) for both of their users: a step that quantizes
    X with the history's window (holding the previous step's amax of the same X) gives the bits of the step
    that reduced X's amax across the tensor-parallel ranks itself, under autocast (X cast to BF16) with the
    transform rounded to BF16."""
    recipe = dataclasses.replace(RNE, rht_round_to_input_dtype=True)
    w, x = _weights()
    out = run_ranks(_history_worker, 2, w, x, recipe)
    for r in range(2):
        first, second = out[f"y{r}"]
        assert torch.equal(first, second), r


def test_stochastic_rounding_streams_differ_per_rank():
    recipe = dataclasses.replace(RNE, stochastic_rounding=True)
    w, x = _weights()
    out = run_ranks(_tp_worker, 2, w, x, recipe, True)
    c0, c1 = out["counter0"], out["counter1"]
    assert int(c0[1]) == int(c1[1]) == 1, "one backward call advanced each rank's counter in place"
    assert int(c0[0]) != int(c1[0]), "distinct SR streams per rank"
    ref = _one_process(w, x, recipe)
    assert _rel(out["w2.weight"], ref["w2.weight"]) < 0.2  # same gradient up to SR noise


# ------------------------------------------------------------- TorchTitan's Llama3 plan (TP, FSDP2 × TP)

LLAMA_KEYS = ('gemm_backend = "reference"', "stochastic_rounding = false")


def _llama_cfg(toml, tp: int, dp: int, *extra: str):
    from job_helpers import parse

    return parse("--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_shard_degree",
                 str(dp), "--training.seq_len", "32", "--training.mixed_precision_param", "float32",
                 "--training.mixed_precision_reduce", "float32", *extra, toml=toml)


def _llama(cfg, dims, n_layers: int | None = None, converters: list | None = None):
    """TorchTitan's Llama3 debug model (``n_layers`` of its blocks) on meta, converted per ``cfg``
    (the converters container appended to ``converters``, for its post-optimizer hook)."""
    import copy

    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.protocols.model_converter import build_model_converters

    args = copy.deepcopy(llama3_args["debugmodel"])
    args.update_from_config(cfg)
    if n_layers is not None:
        args.n_layers = n_layers
    with torch.device("meta"):
        model = Transformer(args)
    container = build_model_converters(cfg, dims)
    container.convert(model)
    if converters is not None:
        converters.append(container)
    return model


def _initialized_state(model: nn.Module) -> dict:
    """Materialize a converted meta model on the CPU, initialize it through TorchTitan's init_weights
    (seed 0) and return a copy of its state dict (what the ranks load)."""
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _cpu_meshes() -> None:
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"  # TorchTitan builds its meshes on the accelerator type; gloo here


def _materialize_parallel(model: nn.Module, state: dict) -> None:
    """After TorchTitan's parallelize function: materialize, initialize (buffers, low-rank splits) and
    load the full ``state`` onto the shards. FSDP2 sums gradients (gloo has no PREMUL_SUM)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def _llama_worker(rank, world, out, toml, tp, dp, state, tokens):
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    _cpu_meshes()
    cfg = _llama_cfg(toml, tp, dp)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world)
    model = _llama(cfg, dims)
    parallelize_llama(model, dims, cfg)  # TorchTitan's own TP plan (and FSDP2 when dp > 1)
    _materialize_parallel(model, state)
    logits = model(tokens)
    assert isinstance(logits, DTensor), "loss parallel: the LM head's output stays sharded"
    full = logits.full_tensor()
    full.float().square().mean().backward()
    grads = {n: g / dp for n, g in _grads(model).items()}  # every dp rank saw the same tokens
    types = {n: type(m).__name__ for n, m in model.named_modules() if "NVFP4" in type(m).__name__}
    if rank == 0:
        out.update(logits=full.detach().clone(), grads=grads, types=types)


@pytest.mark.long
@pytest.mark.parametrize("tp,dp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow(
    reason="4 ranks, 12 s on 2 cores; tp2 here, FSDP2 x TP2 in test_fsdp2_x_tp2_nvfp4_all_gather_equals_..."))],
    ids=["tp2", "fsdp2xtp2"])
def test_llama3_under_torchtitan_tp_plan_matches_one_process(tmp_path, tp, dp):
    from job_helpers import edited_toml, world1

    toml = edited_toml(tmp_path, add=LLAMA_KEYS)
    ref = _llama(_llama_cfg(toml, 1, 1), world1())
    state = _initialized_state(ref)
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = ref(tokens)
    logits.float().square().mean().backward()
    out = run_ranks(_llama_worker, tp * dp, toml, tp, dp, state, tokens)
    assert len(out["types"]) == 6 * 7, "every block Linear stayed an NVFP4Linear under the TP plan"
    # fp32 summation order differs (rowwise partial sums, colwise dX): measured 5e-8 on the logits and
    # at most 2.4e-4 on a gradient; an element that moves across a rounding boundary costs more than that
    assert _rel(out["logits"], logits) < 1e-6
    for name, p in ref.named_parameters():
        assert _rel(out["grads"][name], p.grad) < 2e-3, name


def _llama_ag_worker(rank, world, out, toml, state, tokens):
    """FSDP2 2 × TP2 over 4 ranks, the weights all-gathered in BF16 and then as NVFP4: each run's logits
    and gradients (rank 0's view), from the same state and tokens."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight

    _cpu_meshes()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=world)
    for nvfp4 in (False, True):
        cfg = _llama_cfg(toml, 2, 2, *(["--quantize.linear.nvfp4.fsdp_nvfp4_all_gather"] if nvfp4 else []))
        model = _llama(cfg, dims, n_layers=2)
        parallelize_llama(model, dims, cfg)
        _materialize_parallel(model, state)
        wrapped = sum(isinstance(getattr(p, "_local_tensor", None), NVFP4ShardedWeight) for p in model.parameters())
        logits = model(tokens).full_tensor()
        logits.float().square().mean().backward()
        grads = _grads(model)  # full tensors: a collective on every rank
        again = None
        if nvfp4:  # the post-optimizer path: scales precomputed over both groups, then the next forward
            from titan_nvfp4.distributed.fsdp_all_gather import precompute_scales

            assert precompute_scales(model) == 2 * 7
            with torch.no_grad():
                again = model(tokens).full_tensor()
        if rank == 0:
            out[nvfp4] = dict(logits=logits.detach().clone(), grads=grads, wrapped=wrapped, again=again)


@pytest.mark.long
def test_fsdp2_x_tp2_nvfp4_all_gather_equals_the_bf16_all_gather(tmp_path):
    """fsdp_nvfp4_all_gather under FSDP2 × TP: each rank encodes its FSDP shard of its TP shard with the
    tile amaxes all-reduced over the FSDP group and the tensor amax over the FSDP and TP groups, so the
    gathered codes are the TP shard's quantization with the whole weight's tensor scale, as the BF16
    all-gather's path computes it: logits and gradients bit for bit."""
    from job_helpers import edited_toml, world1

    toml = edited_toml(tmp_path, add=LLAMA_KEYS)
    ref = _llama(_llama_cfg(toml, 1, 1), world1(), n_layers=2)
    state = _initialized_state(ref)
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(3))
    out = run_ranks(_llama_ag_worker, 4, toml, state, tokens)
    bf16, nvfp4 = out[False], out[True]
    assert bf16["wrapped"] == 0 and nvfp4["wrapped"] == 2 * 7, "every block Linear's weight gathers as NVFP4"
    assert torch.equal(nvfp4["logits"], bf16["logits"])
    assert torch.equal(nvfp4["again"], bf16["logits"]), "precomputed scales (the post-optimizer hook's path)"
    for name, g in bf16["grads"].items():
        assert torch.equal(nvfp4["grads"][name], g), name


# ------------------------------------------------------------------- MoE: expert parallelism (EP)

def _moe_job(tmp_path):
    job = tmp_path / "moe.toml"
    job.write_text('[job]\ncustom_config_module = "titan_nvfp4.integration.job_config"\n'
                   '[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\n'
                   'converters = ["quantize.linear.nvfp4", "quantize.grouped_mm.nvfp4"]\n'
                   '[quantize.linear.nvfp4]\ngemm_backend = "reference"\nstochastic_rounding = false\n'
                   '[quantize.grouped_mm.nvfp4]\ngemm_backend = "reference"\nstochastic_rounding = false\n')
    return job


def _moe_model(job, ep: int, dp: int, score_before_experts: bool | None = None, n_layers: int | None = None):
    from moe_helpers import build_moe
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    cfg = ConfigManager().parse_args(["--job.config_file", str(job), "--training.seq_len", "32",
                                      "--parallelism.expert_parallel_degree", str(ep),
                                      "--parallelism.data_parallel_shard_degree", str(dp),
                                      "--training.mixed_precision_param", "float32"])
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=1, pp=1, ep=ep, etp=1, world_size=dp)
    model, _ = build_moe("deepseek_v3", score_before_experts=score_before_experts, n_layers=n_layers)
    build_model_converters(cfg, dims).convert(model)
    return model, cfg, dims


MOE_TEST_LAYERS = 3  # deepseek_v3 debug's dense first block and two MoE blocks (of 6): the same code paths


def _ep_worker(rank, world, out, job, state, tokens):
    from torch.distributed.tensor import DTensor
    from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3

    from titan_nvfp4.integration.experts import NVFP4GroupedExperts

    torch.histc = histc_for_cpu()
    _cpu_meshes()
    model, cfg, dims = _moe_model(job, ep=2, dp=world, n_layers=MOE_TEST_LAYERS)
    parallelize_deepseekv3(model, dims, cfg)  # EP over the experts (x FSDP2 over 4 ranks), FSDP2 over the rest
    _materialize_parallel(model, state)
    experts = [m for m in model.modules() if isinstance(m, NVFP4GroupedExperts)]
    assert experts and all(isinstance(m.w1, DTensor) and "ep" in m.w1.device_mesh.mesh_dim_names for m in experts)
    logits = model(tokens)
    logits.float().square().mean().backward()
    grads = _grads(model)  # TorchTitan's default activation checkpointing wraps the blocks: names unwrapped
    if rank == 0:
        out.update(logits=logits.detach().clone(), grads=grads)


@pytest.mark.long
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow(reason="16 s on 2 cores; ep2 in CI"))],
                         ids=["ep2", "ep2xfsdp2"])
def test_deepseek_v3_experts_under_expert_parallelism_match_one_process(tmp_path, cpu_histc, world):
    """EP = 2 with TorchTitan's parallelize function, on 2 gloo ranks (FSDP2 2 over the dense part) and on 4
    (the experts EP2 x FSDP2 2 on TorchTitan's efsdp mesh, the dense part FSDP2 4): each rank holds whole
    experts, so each expert's tensor amax is its own whole weight's. Every rank gets the same batch, so
    each expert sees its EP group's two copies of its tokens, rank 0's first: exactly what one process
    sees with the batch doubled. Logits and all gradients (summed over the ranks: divided by the world
    size) match it."""
    job = _moe_job(tmp_path)
    ref, _, _ = _moe_model(job, ep=1, dp=1, n_layers=MOE_TEST_LAYERS)
    state = _initialized_state(ref)
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = ref(torch.cat([tokens, tokens]))
    logits.float().square().mean().backward()
    out = run_ranks(_ep_worker, world, job, state, tokens)
    assert _rel(out["logits"], logits[:2]) < 1e-6
    for name, p in ref.named_parameters():
        # measured: at most 1.9e-7 (fp32 summation order), experts and the rest alike
        assert _rel(out["grads"][name] / world, p.grad) < 1e-5, name


def _moe_tp_worker_bf16(rank, world, out, job, state, tokens):
    _moe_tp_worker(rank, world, out, job, state, tokens, check_experts=False)


def _moe_tp_worker(rank, world, out, job, state, tokens, check_experts=True):
    from torch.distributed.tensor import DTensor
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3
    from torchtitan.protocols.model_converter import build_model_converters
    from moe_helpers import build_moe

    from titan_nvfp4.integration.experts import NVFP4GroupedExperts

    torch.histc = histc_for_cpu()
    _cpu_meshes()
    cfg = ConfigManager().parse_args(["--job.config_file", str(job), "--training.seq_len", "32",
                                      "--parallelism.tensor_parallel_degree", str(world),
                                      "--training.mixed_precision_param", "float32"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, etp=1, world_size=world)
    model, _ = build_moe("deepseek_v3", score_before_experts=True, n_layers=MOE_TEST_LAYERS)
    build_model_converters(cfg, dims).convert(model)
    parallelize_deepseekv3(model, dims, cfg)  # TorchTitan's TP plan: attention, dense MLPs and the experts
    _materialize_parallel(model, state)
    experts = [m for m in model.modules() if isinstance(m, NVFP4GroupedExperts)]
    assert not check_experts or (experts and all(isinstance(m.w1, DTensor) and "tp" in m.w1.device_mesh.mesh_dim_names
                                                 for m in experts))
    logits = model(tokens)
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    full.float().square().mean().backward()
    grads = _grads(model)  # a collective: every rank
    if rank == 0:
        out.update(logits=full.detach().clone(), grads=grads)


@pytest.mark.long
def test_deepseek_v3_under_torchtitan_tp_plan_matches_one_process(tmp_path, cpu_histc):
    """TP = 2 over a whole DeepSeek-V3 debug model with TorchTitan's parallelize function: NVFP4 Linears
    (colwise/rowwise) and NVFP4 experts (TorchTitan's expert TP) on 2 gloo ranks match one process.
    The router scales the tokens before the experts (score_before_experts): with the debug flavour's
    scaling after them, TorchTitan 0.2.2's TP leaves the router gate's gradient a per-rank partial sum
    (measured in BF16 too: 0.7 relative error), which is TorchTitan's, not ours."""
    job = _moe_job(tmp_path)
    ref, _, _ = _moe_model(job, ep=1, dp=1, score_before_experts=True, n_layers=MOE_TEST_LAYERS)
    state = _initialized_state(ref)
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = ref(tokens)
    logits.float().square().mean().backward()
    out = run_ranks(_moe_tp_worker, 2, job, state, tokens)
    assert _rel(out["logits"], logits) < 1e-6
    errs = {name: _rel(out["grads"][name], p.grad) for name, p in ref.named_parameters()}
    # Measured: most gradients within 1e-6 (fp32 summation order); a few within 1.1e-2 (layer 2's expert
    # W1/W3), where an ulp-level difference of dY, from the TP ranks' reduction order downstream, moves
    # an element across an NVFP4 rounding boundary of a small expert group. With identical inputs the
    # sharded experts equal the unsharded ones bit for bit (test_experts_under_tensor_parallelism_...).
    assert sorted(errs.values())[len(errs) // 2] < 1e-5
    for name, e in errs.items():
        assert e < 3e-2, name


def _experts(cls_name: str, recipe: NVFP4Recipe):
    from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts
    from torchtitan.models.moe.moe import GroupedExperts

    from titan_nvfp4.integration.experts import NVFP4GptOssExperts, NVFP4GroupedExperts

    torch.manual_seed(0)
    if cls_name == "gpt_oss":
        mod = GptOssGroupedExperts(dim=64, hidden_dim=64, num_experts=2, swiglu_limit=7.0, use_grouped_mm=True)
        nn.init.normal_(mod.mlp1_weight, std=0.1), nn.init.normal_(mod.mlp2_weight, std=0.1)
        nn.init.normal_(mod.mlp1_bias, std=0.1), nn.init.normal_(mod.mlp2_bias, std=0.1)
        return NVFP4GptOssExperts.convert(mod, recipe, layer_id=0, name="layers.0.moe.experts")
    mod = GroupedExperts(dim=64, hidden_dim=64, num_experts=2, use_grouped_mm=True)
    for w in (mod.w1, mod.w2, mod.w3):
        nn.init.normal_(w, std=0.1)
    return NVFP4GroupedExperts.convert(mod, recipe, layer_id=0, name="layers.0.moe.experts")


def _expert_inputs():
    g = torch.Generator().manual_seed(3)
    # uneven groups (19 and 13 tokens), each padded to a multiple of 16 by TorchTitan's alignment
    return torch.randn(32, 64, generator=g), torch.tensor([19, 13]), torch.randn(32, 64, generator=g)


def _run_experts(mod, x, counts, dy, reduce=None):
    xr = x.clone().requires_grad_(True)
    y = mod(xr, counts)
    y.backward(dy)
    if reduce is not None:  # the rowwise GEMM's output is a partial sum over the TP ranks
        y = y.detach().clone()
        reduce(y)
    grads = {n: local(p.grad).clone() for n, p in mod.named_parameters()}
    return y.detach(), xr.grad, grads


def _expert_tp_worker(rank, world, out, cls_name, recipe, state):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import TensorParallel
    from torchtitan.models.gpt_oss.infra.expert_parallel import GptossTensorParallel
    from torchtitan.models.moe import utils as moe_utils

    moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = 16  # what the grouped converter sets
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    mod = _experts(cls_name, recipe)
    mod.load_state_dict(state)
    parallelize_module(mod, mesh, GptossTensorParallel() if cls_name == "gpt_oss" else TensorParallel())
    x, counts, dy = _expert_inputs()
    y, dx, grads = _run_experts(mod, x, counts, dy, lambda t: torch.distributed.all_reduce(t))
    if rank == 0:
        out.update(y=y, dx=dx)
    out[f"grads{rank}"] = grads
    out[f"placements{rank}"] = {n: str(p.placements) for n, p in mod.named_parameters()}


_REQUANT_SLOW = pytest.mark.slow(reason="11 s on 2 cores; the kernels' amaxes in the case before it")


# both expert layouts on the reference backend; the kernels' cross-rank amaxes (shared by the layouts) on one
# (and once, in the slow tier, with the weights quantized again in backward, whose amaxes are all-reduced again)
@pytest.mark.parametrize("cls_name,backend,requant", [("deepseek_v3", "reference", False),
                                                      ("gpt_oss", "reference", False),
                                                      ("deepseek_v3", "emulated", False),
                                                      pytest.param("deepseek_v3", "emulated", True,
                                                                   marks=_REQUANT_SLOW)])
@pytest.mark.long
def test_experts_under_tensor_parallelism_match_one_process(cls_name, backend, requant):
    """TorchTitan's expert TP (TP without EP) on 2 gloo ranks: W1/W3 (gpt-oss mlp1) split along their
    output features, W2 (mlp2) along their input features. With the per-expert amaxes of the sharded
    operands all-reduced, every rank quantizes exactly the slices of the unsharded operands: the
    weight-gradient shards equal the one-process gradients bit for bit; the output (a sum of the two
    ranks' partial products) and dX match up to fp32 summation order."""
    recipe = dataclasses.replace(RNE, gemm_backend=backend, requantize_expert_weights=requant)
    from torchtitan.models.moe import utils as moe_utils

    moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = 16
    ref_mod = _experts(cls_name, recipe)
    state = {k: v.clone() for k, v in ref_mod.state_dict().items()}
    x, counts, dy = _expert_inputs()
    y_ref, dx_ref, g_ref = _run_experts(ref_mod, x, counts, dy)
    out = run_ranks(_expert_tp_worker, 2, cls_name, recipe, state)
    assert "Shard(dim=1)" in str(out["placements0"]), out["placements0"]
    assert _rel(out["y"], y_ref) < 1e-6 and _rel(out["dx"], dx_ref) < 1e-5
    for name, g in g_ref.items():
        shards = [out[f"grads{r}"][name] for r in range(2)]
        dim = next((d for d in (1, 2) if shards[0].shape[d] != g.shape[d]), None) if g.dim() == 3 else None
        if dim is None and g.dim() == 2 and shards[0].shape != g.shape:
            dim = 1  # gpt-oss mlp1_bias [E, 2·hidden] split with mlp1
        whole = torch.cat(shards, dim) if dim is not None else shards[0]
        if name == "mlp2_bias":  # added once per rank in forward, divided by the TP degree (TorchTitan)
            assert _rel(whole, g_ref[name]) < 1e-6, name
            continue
        assert torch.equal(whole, g), name


def test_experts_without_cross_rank_amax_quantize_differently(monkeypatch):
    """The all-reduces matter: with the expert TP groups dropped, ranks quantize their shards with local
    amaxes and the gradients move away from the one-process ones (so the test above can fail)."""
    from titan_nvfp4.integration import experts as experts_mod

    ref_mod = _experts("deepseek_v3", RNE)
    state = {k: v.clone() for k, v in ref_mod.state_dict().items()}
    x, counts, dy = _expert_inputs()
    _, _, g_ref = _run_experts(ref_mod, x, counts, dy)
    out = run_ranks(_expert_tp_worker_local_amax, 2, state)
    assert not torch.equal(torch.cat([out[f"grads{r}"]["w2"] for r in range(2)], 2), g_ref["w2"])


def _expert_tp_worker_local_amax(rank, world, out, state):
    from titan_nvfp4.integration import experts as experts_mod

    experts_mod._NVFP4Experts._tp_groups = lambda self: {}
    _expert_tp_worker(rank, world, out, "deepseek_v3", RNE, state)


def _compiled_tp_worker(rank, world, out, w, x, recipe):
    model = _tp_mlp(world, recipe, w)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # one graph: no breaks under TP
    xr = x.clone().requires_grad_(True)
    y = compiled(xr)
    y.square().sum().backward()
    grads = _grads(model)
    if rank == 0:
        out.update(y=y.detach().clone(), **grads)


@pytest.mark.long
def test_tensor_parallel_layers_compile_without_graph_breaks():
    """torch.compile(fullgraph=True) over the TP layers: the amax all-reduce is a functional collective
    and the kernels (emulated backend, Triton's interpreter on a CPU) are custom ops."""
    from titan_nvfp4.ops.backends import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU")
    recipe = dataclasses.replace(RNE, gemm_backend="emulated")
    w, x = _weights()
    ref = _one_process(w, x, recipe)
    out = run_ranks(_compiled_tp_worker, 2, w, x, recipe)
    for key in ("y", "w1.weight", "w2.weight", "w2.bias"):
        assert _rel(out[key], ref[key]) < 1e-5, key


def _compiled_fsdp_worker(rank, world, out, toml, state, tokens):
    """Llama3 (1 block) under TorchTitan's parallelize function with FSDP2 over ``world`` ranks and the
    NVFP4 all-gather: one backward eager, then one with the block compiled and checkpointed."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    _cpu_meshes()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    runs = {"eager": ("--activation_checkpoint.mode", "none"),
            "compiled": ("--compile.enable", "--compile.backend", "aot_eager", "--activation_checkpoint.mode",
                         "selective", "--activation_checkpoint.selective_ac_option", "op")}
    for name, extra in runs.items():
        cfg = _llama_cfg(toml, 1, world, *extra)
        model = _llama(cfg, dims, n_layers=1)
        parallelize_llama(model, dims, cfg)
        _materialize_parallel(model, state)
        logits = model(tokens)
        logits.float().square().mean().backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        grads = _grads(model) if not missing else {}
        if rank == 0:
            nvfp4 = sorted(n for n, m in model.named_modules() if isinstance(m, NVFP4Linear))
            out[name] = dict(logits=logits.detach().clone(), grads=grads, missing=missing, nvfp4=nvfp4)


@pytest.mark.long
def test_fsdp2_nvfp4_all_gather_under_compile_and_activation_checkpointing_matches_eager(tmp_path):
    """FSDP2 2 with fsdp_nvfp4_all_gather, the block compiled (fullgraph, aot_eager) and op-level
    selective activation checkpointing, as TorchTitan applies them: the same logits and weight gradients
    as the eager run. Before the gathered weight was a traceable subclass (__tensor_flatten__), the
    compiled blocks left the NVFP4 weights without a gradient, silently: a 2-GPU run trained only its
    BF16 layers."""
    from job_helpers import edited_toml, world1

    # the attention's Linears stay BF16: the compile then traces the reference backend's math 3 times, not 7
    toml = edited_toml(tmp_path, replace={"filter_fqns": '["output", "attention"]'},
                       add=LLAMA_KEYS + ("fsdp_nvfp4_all_gather = true",))
    state = _initialized_state(_llama(_llama_cfg(toml, 1, 1), world1(), n_layers=1))
    tokens = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(1))
    out = run_ranks(_compiled_fsdp_worker, 2, toml, state, tokens)
    eager, compiled = out["eager"], out["compiled"]
    # the compiled run's names go through the compile and checkpoint wrappers: proof that both were applied
    wrapped = "layers.0._orig_mod._checkpoint_wrapped_module.feed_forward."
    assert compiled["nvfp4"] == [wrapped + w for w in ("w1", "w2", "w3")], compiled["nvfp4"]
    assert eager["missing"] == [] and compiled["missing"] == [], compiled["missing"]
    assert _rel(compiled["logits"], eager["logits"]) < 1e-6
    for name, g in eager["grads"].items():
        assert _rel(compiled["grads"][name], g) < 1e-5, name


# --------------------------------------------------------------- distributed checkpoints (DCP) and resume

def _train_worker(rank, world, out, toml, tp, dp, state, batches, ckpt, phase):
    """Train len(batches) AdamW steps of the converted Llama3 under TorchTitan's plan. phase "save":
    checkpoint (model + optimizer, DCP) after the first step; "resume": load it first, train the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    _cpu_meshes()
    cfg = _llama_cfg(toml, tp, dp)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world)
    converters = []
    model = _llama(cfg, dims, n_layers=2, converters=converters)
    parallelize_llama(model, dims, cfg)
    _materialize_parallel(model, state)  # init_weights also splits the DecomposedLinears
    if dp > 1:
        from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight

        assert isinstance(model.layers["0"].attention.wq.weight._local_tensor, NVFP4ShardedWeight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from fake_trainer import FakeTrainer  # TorchTitan's train_state, with the SR call counts

    trainer = FakeTrainer(model)
    losses = []
    start = 0
    if phase == "resume":
        sd_model, sd_opt = get_state_dict(model, opt)
        sd = {"model": sd_model, "optim": sd_opt, "train_state": trainer}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = 1
    for i in range(start, len(batches)):
        logits = model(batches[i])
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # loss parallel under TP
        loss = logits.float().square().mean()
        loss.backward()
        opt.step()
        converters[0].post_optimizer_hook([model])  # as TorchTitan's optimizer step hook calls it
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if phase == "save" and i == 0:
            sd_model, sd_opt = get_state_dict(model, opt)
            dcp.save({"model": sd_model, "optim": sd_opt, "train_state": trainer}, checkpoint_id=ckpt)
    if rank == 0:
        out["losses"] = torch.stack(losses)


@pytest.mark.long
@pytest.mark.parametrize("tp,dp", [pytest.param(2, 1, marks=pytest.mark.slow(reason="18 s on 2 cores; fsdp2 in CI")),
                                   (1, 2)], ids=["tp2", "fsdp2"])
def test_dcp_checkpoint_resume_reproduces_the_run_bit_for_bit(tmp_path, tp, dp):
    """NVFP4 and DecomposedLinear layers (lora_rank 16) under TorchTitan's TP or FSDP2 plan, with
    stochastic rounding: a run resumed from a DCP checkpoint (model, AdamW state and the train_state
    with the SR call counts) repeats the uninterrupted run's losses exactly. Under FSDP2 the weights
    are all-gathered as NVFP4 (fsdp_nvfp4_all_gather), so their sharded wrapper goes through DCP too,
    and the converter's post-optimizer hook precomputes their scales (the resumed run's first forward
    reduces them itself: the load dropped them)."""
    from job_helpers import edited_toml, world1

    keys = ('gemm_backend = "reference"', "lora_rank = 16") + (("fsdp_nvfp4_all_gather = true",) if dp > 1 else ())
    toml = edited_toml(tmp_path, add=keys)  # SR on (the preset)
    state = _initialized_state(_llama(_llama_cfg(toml, 1, 1), world1(), n_layers=2))
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 2000, (2, 32), generator=g) for _ in range(3)]
    ckpt = str(tmp_path / "step-1")
    full = run_ranks(_train_worker, tp * dp, toml, tp, dp, state, batches, ckpt, "save")["losses"]
    resumed = run_ranks(_train_worker, tp * dp, toml, tp, dp, state, batches, ckpt, "resume")["losses"]
    assert torch.equal(resumed, full[1:]), (full, resumed)
    assert not torch.equal(full[1], full[2])  # the steps did train


def _ms_eden_tp_worker(rank, world, out, w, x, recipe):
    import titan_nvfp4.autograd.ms_eden_backward as meb

    calls = []
    reduce = meb.all_reduce_max
    meb.all_reduce_max = lambda a, group: calls.append(a.clone()) or reduce(a, group)
    model = _tp_mlp(world, recipe, w)
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    y.square().sum().backward()
    grads = _grads(model)
    out[f"reduced{rank}"] = len(calls)
    if rank == 0:
        out.update(y=y.detach().clone(), dx=xr.grad.clone(), **grads)


def test_ms_eden_under_tensor_parallelism_quantizes_with_the_whole_operands_amaxes():
    """quartet2's backward on sharded layers: the forward equals one process (nearest rounding, the whole operand's
    tensor amax); each backward operand's MS-EDEN amax is all-reduced over the ranks sharding it; the gradients are
    one process's up to MS-EDEN's own noise (each rank draws its own streams)."""
    from titan_nvfp4.recipe.nvfp4_recipe import build_recipe

    recipe = build_recipe("quartet2", {"gemm_backend": "reference", "rht_size": 32})
    w, x = _weights()
    ref = _one_process(w, x, recipe)
    out = run_ranks(_ms_eden_tp_worker, 2, w, x, recipe)
    assert _rel(out["y"], ref["y"]) < 1e-5
    assert out["reduced0"] == out["reduced1"] > 0
    for key in ("dx", "w1.weight", "w2.weight"):
        assert 0 < _rel(out[key], ref[key]) < 0.35, key
    assert _rel(out["w2.bias"], ref["w2.bias"]) < 1e-5  # db is the sum of dY, not quantized
