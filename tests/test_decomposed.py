"""DecomposedLinear (lora_rank): the SVD split, forward/backward against float64, meta-device build
through TorchTitan's converter and init_weights, rank validation, refresh, checkpoint round trip and
the dense export."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest

import torch
from torch import nn

import titan_nvfp4.integration  # noqa: F401  (registers the converters)
from titan_nvfp4 import NVFP4Recipe
from titan_nvfp4.modules.decomposed_linear import DecomposedLinear
from titan_nvfp4.autograd.linear_function import nvfp4_linear
from titan_nvfp4.numerics.lowrank import check_rank, lowrank_merge, lowrank_split, project_moments
from titan_nvfp4.ops import quantize_rowwise, quantize_weight
from titan_nvfp4.tools.export_dense import fold_decomposed, main as export_main
from job_helpers import edited_toml, meta_llama, parse, world1

REF = NVFP4Recipe(gemm_backend="reference", stochastic_rounding=False)


def _weight(out_f=64, in_f=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, 5] += 2.0  # an outlier input feature: a strong rank-1 direction
    return w


def test_split_reproduces_the_weight_to_fp32_rounding():
    w = _weight()
    u, s, v, r = lowrank_split(w, 16)
    assert u.shape == (64, 16) and s.shape == (16,) and v.shape == (16, 96) and r.shape == w.shape
    err = (lowrank_merge(u, s, v, r) - w).abs().max()
    assert err <= 8 * torch.finfo(torch.float32).eps * w.abs().max()
    eye = torch.eye(16)
    assert torch.allclose(u.t() @ u, eye, atol=1e-5) and torch.allclose(v @ v.t(), eye, atol=1e-5)
    full = torch.linalg.svdvals(w.double())
    assert torch.allclose(s.double(), full[:16], rtol=1e-5) and bool((s[:-1] >= s[1:]).all())
    # the residual holds no more than the singular values past r: its outliers are gone
    assert torch.linalg.matrix_norm(r.double(), ord=2) <= full[16] * (1 + 1e-5)


@pytest.mark.parametrize("rank", [-16, 8, 24, 20, 1.5, True, "32"])
def test_invalid_ranks_are_rejected_with_key_and_value(rank):
    with pytest.raises(ValueError, match=rf"lora_rank must be 0 \(off\) or a positive multiple of 16, got {rank!r}"):
        check_rank(rank)


@pytest.mark.parametrize("value", ["-16", "8", "24", "20"])
def test_invalid_ranks_stop_the_job_at_parse_time(tmp_path, value):
    toml = edited_toml(tmp_path, add=(f"lora_rank = {value}",))
    with pytest.raises(Exception, match=rf"lora_rank must be .* got {value}"):
        parse(toml=toml)


def test_refresh_without_rank_and_bad_knobs_rejected(tmp_path):
    for add, needle in ((("lora_refresh_steps = 10",), "needs lora_rank"),
                        (("lora_rank = 16", "lora_nvfp4 = 1"), "lora_nvfp4"),
                        (("lora_nvfp4 = true",), r"lora_nvfp4 = true needs lora_rank > 0"),
                        (("lora_rank = 16", "lora_refresh_steps = -1"), "lora_refresh_steps"),
                        (("lora_rank = 16", 'lora_refresh_moments = "project"'), "needs lora_refresh_steps > 0"),
                        (("lora_rank = 16", "lora_refresh_steps = 2", 'lora_refresh_moments = "rotate"'),
                         r"lora_refresh_moments must be one of \['keep', 'project'\], got 'rotate'"),
                        (("lora_rank = 16", 'lora_dtype = "float64"'),
                         r"lora_dtype must be one of \['input', 'float32'\], got 'float64'"),
                        (("lora_rank = 16", "lora_nvfp4 = true", 'lora_dtype = "float32"'),
                         r"lora_dtype = 'float32' .* lora_nvfp4 = true")):
        with pytest.raises(Exception, match=needle):
            parse(toml=edited_toml(tmp_path, add=add))


def _float64_forward(mod: DecomposedLinear, x: torch.Tensor) -> torch.Tensor:
    """NVFP4(x, R) on dequantized operands plus the exact low-rank branch, all in float64."""
    xq = quantize_rowwise(x).dequantize(torch.float64)
    wq, _ = quantize_weight(mod.weight.detach(), True, "reference")
    y = xq @ wq.dequantize(torch.float64).t() + mod.bias.detach().double()
    x64 = x.double()
    u, s, v = (t.detach().double() for t in (mod.lora_u, mod.lora_sigma, mod.lora_v))
    return y + ((x64 @ v.t()) * s) @ u.t()


def test_forward_and_backward_against_float64():
    lin = nn.Linear(96, 64)
    with torch.no_grad():
        lin.weight.copy_(_weight())
    mod = DecomposedLinear.from_linear(copy.deepcopy(lin), REF, rank=16)
    assert torch.allclose(mod.dense_weight(), lin.weight, atol=1e-6)
    x = torch.randn(48, 96, requires_grad=True)
    y = mod(x)
    rel = (y.double() - _float64_forward(mod, x.detach())).norm() / y.double().norm()
    assert rel < 1e-6
    dy = torch.randn_like(y)
    y.backward(dy)
    # the branch: exact gradients (float64 autograd on the same values)
    u, s, v = (t.detach().double().requires_grad_() for t in (mod.lora_u, mod.lora_sigma, mod.lora_v))
    x64 = x.detach().double().requires_grad_()
    (((x64 @ v.t()) * s) @ u.t()).backward(dy.double())
    for got, want in ((mod.lora_u.grad, u.grad), (mod.lora_sigma.grad, s.grad), (mod.lora_v.grad, v.grad)):
        assert (got.double() - want).norm() <= 1e-6 * want.norm()  # fp32 sums of the same products
    # R: exactly what the NVFP4 linear of R gives; x: its dgrad plus the branch's
    r = mod.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    nvfp4_linear(xr, r, mod.bias.detach(), REF).backward(dy)
    assert torch.equal(mod.weight.grad, r.grad)
    want = xr.grad.double() + x64.grad
    assert (x.grad.double() - want).norm() <= 1e-6 * want.norm()


def test_branch_in_nvfp4():
    recipe = dataclasses.replace(REF, rht=False)
    lin = nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_weight())
    mod = DecomposedLinear.from_linear(lin, recipe, rank=32, lora_nvfp4=True)
    x = torch.randn(32, 96)
    want = (nvfp4_linear(x, mod.weight, None, recipe)
            + nvfp4_linear(nvfp4_linear(x, mod.lora_v, None, recipe) * mod.lora_sigma, mod.lora_u, None, recipe))
    assert torch.equal(mod(x), want)


def test_branch_in_the_factors_dtype_under_autocast():
    """lora_dtype = "float32" under BF16 autocast: the branch's GEMMs run in the factors' FP32 and are added to R's
    output in FP32 (one rounding to BF16), so the factors' gradients are FP32-exact; "input" runs them in BF16."""
    lin = nn.Linear(96, 64)
    with torch.no_grad():
        lin.weight.copy_(_weight())
    x = torch.randn(48, 96)
    dy = torch.randn(48, 64)
    grads, outs = {}, {}
    for mode in ("input", "float32"):
        mod = DecomposedLinear.from_linear(copy.deepcopy(lin), REF, rank=16)
        mod.lora_dtype = mode
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(x)
        assert y.dtype == torch.bfloat16
        y.backward(dy.to(y.dtype))
        outs[mode], grads[mode] = y, (mod.lora_u.grad, mod.lora_sigma.grad, mod.lora_v.grad)
        if mode == "float32":
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                r = nvfp4_linear(x, mod.weight, mod.bias, REF)
            branch = ((x @ mod.lora_v.t()) * mod.lora_sigma) @ mod.lora_u.t()
            assert torch.equal(y, (r.float() + branch).to(torch.bfloat16))
    u, s, v = (t.detach().double().requires_grad_() for t in (mod.lora_u, mod.lora_sigma, mod.lora_v))
    (((x.double() @ v.t()) * s) @ u.t()).backward(dy.to(torch.bfloat16).double())
    for mode, bound in (("float32", 1e-5), ("input", None)):
        err = max(float((g.double() - w.grad).norm() / w.grad.norm()) for g, w in zip(grads[mode], (u, s, v)))
        if bound:
            assert err <= bound, err
        else:
            assert err > 1e-4, err  # BF16 GEMMs: the knob changes what trains


def test_use_before_decomposition_fails_loudly():
    with torch.device("meta"):
        lin = nn.Linear(96, 64)
    mod = DecomposedLinear.from_linear(lin, REF, rank=16, name="layers.0.attention.wq")
    assert mod.lora_u.is_meta and mod.lora_u.shape == (64, 16)  # allocated on meta, no data read
    mod.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="before its weights were decomposed"):
        mod(torch.randn(4, 96))


def _converted_llama(tmp_path, *add):
    cfg = parse(toml=edited_toml(tmp_path, add=add))
    from torchtitan.protocols.model_converter import build_model_converters

    model = meta_llama(cfg)
    converters = build_model_converters(cfg, world1())
    converters.convert(model)
    return model, converters


def _initialized_llama(tmp_path, *add):
    """_converted_llama materialized on the CPU and initialized through TorchTitan's init_weights."""
    model, converters = _converted_llama(tmp_path, *add)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, converters


def test_lora_dtype_without_a_rank_is_refused(tmp_path):
    """lora_dtype = "float32" with no lora_rank in any listed converter would change nothing: refused when the
    converter is built, naming the knob."""
    from torchtitan.protocols.model_converter import build_model_converters

    cfg = parse(toml=edited_toml(tmp_path, add=('lora_dtype = "float32"',)))
    with pytest.raises(ValueError, match=r"lora_dtype = 'float32' needs a low-rank branch: set lora_rank > 0"):
        build_model_converters(cfg, world1())


def test_converter_sets_the_branch_dtype(tmp_path):
    model, _ = _converted_llama(tmp_path, "lora_rank = 16", 'lora_dtype = "float32"', 'gemm_backend = "reference"')
    mods = [m for m in model.modules() if isinstance(m, DecomposedLinear)]
    assert len(mods) == 6 * 7 and all(m.lora_dtype == "float32" for m in mods)
    model, _ = _converted_llama(tmp_path, "lora_rank = 16", 'gemm_backend = "reference"')
    assert all(m.lora_dtype == "input" for m in model.modules() if isinstance(m, DecomposedLinear))


def test_meta_conversion_then_torchtitan_init_decomposes(tmp_path):
    model, _ = _converted_llama(tmp_path, "lora_rank = 16", 'gemm_backend = "reference"')
    mods = {n: m for n, m in model.named_modules() if isinstance(m, DecomposedLinear)}
    assert len(mods) == 6 * 7 and all(m.lora_u.is_meta for m in mods.values())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # TorchTitan's protocol, with the split hooked in
    torch.manual_seed(0)
    plain = meta_llama()
    plain.to_empty(device="cpu")
    with torch.no_grad():
        plain.init_weights(buffer_device=None)
    dense = plain.state_dict()
    for name, m in mods.items():
        assert bool(m.lora_decomposed)
        assert torch.allclose(m.dense_weight(), dense[f"{name}.weight"], atol=1e-6), name
    tokens = torch.randint(0, 2000, (2, 32))
    model(tokens).float().mean().backward()
    assert all(m.lora_sigma.grad is not None and m.weight.grad is not None for m in mods.values())


def test_projected_moments_are_the_new_factors_gradients():
    """project_moments maps the residual's Adam moments (R's gradient is W's, G) onto a split's factors: the first
    moments are exactly the factors' gradients (autograd, float64), for any factors; the second moments are exact
    where each factor gradient is one term of G (factors that pick single rows and columns)."""
    g = torch.Generator().manual_seed(3)
    n, k, r = 32, 48, 16
    u, s, v, res = (t.double().requires_grad_() for t in lowrank_split(_weight(n, k).double(), r))
    x, c = torch.randn(8, k, generator=g, dtype=torch.float64), torch.randn(8, n, generator=g, dtype=torch.float64)
    ((x @ (res + (u * s) @ v).t()) * c).sum().backward()
    grad_w = res.grad
    moments = project_moments(grad_w, grad_w.square(), u.detach(), s.detach(), v.detach())
    for kind, p in (("u", u), ("sigma", s), ("v", v)):
        assert torch.allclose(moments[kind][0].double(), p.grad, rtol=1e-5, atol=1e-5), kind
        assert moments[kind][0].shape == p.shape and moments[kind][1].shape == p.shape
    # one term per gradient element: U, V select rows / columns, so v = g² exactly
    pick_u, pick_v = torch.eye(n, r, dtype=torch.float64), torch.eye(r, k, dtype=torch.float64)
    sig = torch.linspace(0.5, 2.0, r, dtype=torch.float64)
    m = project_moments(grad_w, grad_w.square(), pick_u, sig, pick_v)
    for kind in ("u", "sigma", "v"):
        assert torch.allclose(m[kind][1].double(), m[kind][0].double().square(), rtol=1e-5, atol=1e-9), kind
    # stacked experts [E, N, K]: matrix by matrix
    stacked = project_moments(torch.stack([grad_w, 2 * grad_w]), torch.stack([grad_w.square(), grad_w.abs()]),
                              torch.stack([u.detach(), pick_u]), torch.stack([s.detach(), sig]),
                              torch.stack([v.detach(), pick_v]))
    second = project_moments(2 * grad_w, grad_w.abs(), pick_u, sig, pick_v)
    for kind in ("u", "sigma", "v"):
        assert torch.equal(stacked[kind][0][0], moments[kind][0]) and torch.equal(stacked[kind][1][1], second[kind][1])


def test_refresh_keeps_the_weight_reorthogonalizes_and_projects_the_moments(tmp_path, caplog):
    """lora_refresh_steps = 2 with lora_refresh_moments = "project": the refresh after step 2 keeps W, makes U
    orthonormal again, and sets every factor's AdamW moments to those the residual's give on the new split (the
    optimizer found through torch.optim's step hook, as TorchTitan's optimizers step); the log counts them."""
    model, converters = _initialized_llama(tmp_path, "lora_rank = 16", "lora_refresh_steps = 2",
                                           'lora_refresh_moments = "project"', 'gemm_backend = "reference"')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    m = model.layers["0"].attention.wq
    for step in (1, 2):
        for p in model.parameters():  # gradients as a backward would leave them (a CPU backward takes a minute)
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()  # U no longer orthonormal, W changed
        if step == 1:
            converters.post_optimizer_hook([model])  # step 1: nothing
            continue
        w_before, u_before = m.dense_weight(), m.lora_u.detach().clone()
        adam_v = opt.state[m.lora_v]["exp_avg_sq"].clone()
        assert not torch.allclose(u_before.t() @ u_before, torch.eye(16), atol=1e-3)
        with caplog.at_level(logging.INFO):
            converters.post_optimizer_hook([model])  # step 2: the refresh
    n = sum(isinstance(x, DecomposedLinear) for x in model.modules())
    assert f"re-decomposed {n} low-rank modules after optimizer step 2, the factors' Adam moments of {n} weights " \
           "projected onto the new split" in caplog.text
    assert torch.allclose(m.dense_weight(), w_before, atol=1e-5)
    assert torch.allclose(m.lora_u.t() @ m.lora_u, torch.eye(16), atol=1e-5)
    new = project_moments(opt.state[m.weight]["exp_avg"], opt.state[m.weight]["exp_avg_sq"],
                          m.lora_u.detach(), m.lora_sigma.detach(), m.lora_v.detach())
    for kind, p in (("u", m.lora_u), ("sigma", m.lora_sigma), ("v", m.lora_v)):
        assert torch.equal(opt.state[p]["exp_avg"], new[kind][0]) and torch.equal(opt.state[p]["exp_avg_sq"], new[kind][1])
    assert not torch.allclose(opt.state[m.lora_v]["exp_avg_sq"], adam_v)


def test_a_refresh_that_finds_no_moments_says_so():
    """A projection that finds no optimizer state (an optimizer torch.optim's step hooks do not see) warns in the
    refresh's log line, not "projected"."""
    from titan_nvfp4.modules.decomposed_linear import Redecomposed, refresh_message

    assert refresh_message(Redecomposed(4, 4), 10, False) == \
        "NVFP4: re-decomposed 4 low-rank modules after optimizer step 10"
    assert "moments of 4 weights projected" in refresh_message(Redecomposed(4, 4), 10, True)
    assert "none found in any optimizer's state" in refresh_message(Redecomposed(4, 0), 10, True)


def test_checkpoint_round_trip_and_dense_export(tmp_path):
    recipe_keys = ("lora_rank = 16", 'gemm_backend = "reference"', "stochastic_rounding = false")
    model, _ = _initialized_llama(tmp_path, *recipe_keys)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DecomposedLinear):
                m.lora_sigma.mul_(1.5)  # "trained": differs from a fresh split
    tokens = torch.randint(0, 2000, (2, 32))
    y = model(tokens)
    state = model.state_dict()
    assert {"layers.0.attention.wq.lora_u", "layers.0.attention.wq.lora_decomposed"} <= set(state)

    again, _ = _initialized_llama(tmp_path, *recipe_keys)  # as TorchTitan: initialize (and split), then load
    again.load_state_dict(state)  # the checkpoint's decomposition replaces the fresh split
    assert torch.equal(again(tokens), y)

    path = tmp_path / "decomposed.pt"
    torch.save(state, path)
    export_main([str(path), str(tmp_path / "dense.pt")])
    dense = torch.load(tmp_path / "dense.pt")
    assert not any("lora" in k for k in dense)
    plain = meta_llama()
    plain.to_empty(device="cpu")
    plain.load_state_dict(dense)  # a BF16 model loads it: same keys
    wq = model.layers["0"].attention.wq
    assert torch.allclose(plain.layers["0"].attention.wq.weight, wq.dense_weight(), atol=1e-6)
    assert torch.equal(fold_decomposed(state)["output.weight"], state["output.weight"])

    # a DCP checkpoint directory, as TorchTitan writes them
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(tmp_path / "step-10"))
    export_main([str(tmp_path / "step-10"), str(tmp_path / "dense_dcp.pt")])
    from_dcp = torch.load(tmp_path / "dense_dcp.pt")
    assert from_dcp.keys() == dense.keys() and all(torch.equal(from_dcp[k], dense[k]) for k in dense)


def _fsdp_worker(rank: int, world: int, port: int, w_full: torch.Tensor, x: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        mesh = init_device_mesh("cpu", (world,))
        with torch.device("meta"):
            lin = nn.Linear(96, 64, bias=False)
        mod = DecomposedLinear.from_linear(lin, REF, rank=16)
        fully_shard(mod, mesh=mesh)
        mod.to_empty(device="cpu")
        with torch.no_grad():  # what init_weights does to the sharded weight
            mod.weight.copy_(distribute_tensor(w_full, mesh, [Shard(0)]))
        mod.decompose_()
        full = {n: p.full_tensor().detach().clone() for n, p in mod.named_parameters()}  # a collective: all ranks
        y = mod(x)
        if rank == 0:
            out.update(full, y=y.detach().clone())
    finally:
        dist.destroy_process_group()


def test_decompose_under_fsdp2_matches_one_process():
    """Sharded weights (FSDP2 over 2 gloo ranks): the SVD of the gathered weight, every rank holding
    shards of rank 0's factors; the same factors and outputs as one process."""
    import torch.multiprocessing as mp
    from dist_util import free_port, spawn

    w = _weight()
    x = torch.randn(8, 96)
    port = free_port()
    manager = mp.Manager()
    out = manager.dict()
    spawn(_fsdp_worker, (2, port, w, x, out), 2)
    lin = nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    ref = DecomposedLinear.from_linear(lin, REF, rank=16)
    for name in ("weight", "lora_u", "lora_sigma", "lora_v"):
        assert torch.equal(out[name], getattr(ref, name).detach()), name
    assert torch.equal(out["y"], ref(x).detach())


def test_float32_branch_refuses_factors_already_sharded_in_bf16():
    """lora_dtype = "float32" stores the factors in FP32 by swapping their data: a factor already sharded (a DTensor)
    in BF16 cannot be, and the error names it; FP32 DTensor factors need nothing and pass."""
    import torch.distributed as dist
    from dist_util import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_nvfp4.modules.decomposed_linear import set_lora_dtype

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        for dtype, fails in ((torch.bfloat16, True), (torch.float32, False)):
            root = nn.Module()
            with torch.device("meta"):
                root.add_module("wq", DecomposedLinear.from_linear(nn.Linear(96, 64, bias=False, dtype=dtype), REF,
                                                                   rank=16))
            fully_shard(root.wq, mesh=mesh)
            if fails:
                with pytest.raises(ValueError, match=r"lora_dtype = 'float32': wq\.lora_u is a torch\.bfloat16 DTensor"):
                    set_lora_dtype(root, "float32")
            else:
                assert set_lora_dtype(root, "float32") == 1 and root.wq.lora_dtype == "float32"
    finally:
        dist.destroy_process_group()
