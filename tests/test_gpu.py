"""The reference path on a CUDA/ROCm GPU: same bits as on CPU, GEMM exact up to fp32 accumulation.
Skipped without a GPU."""

import pytest
import torch

from titan_nvfp4 import NVFP4Linear, NVFP4Recipe, quantize_nvfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 1), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_on_gpu_is_bit_identical_to_cpu(block_shape, dtype):
    x = (torch.randn(256, 512) * torch.exp(torch.randn(256, 1) * 2)).to(dtype)
    cpu = quantize_nvfp4(x, block_shape=block_shape)
    gpu = quantize_nvfp4(x.cuda(), block_shape=block_shape)
    assert torch.equal(cpu.data, gpu.data.cpu())
    assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.view(torch.uint8).cpu())
    assert torch.equal(cpu.global_scale, gpu.global_scale.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_forward_on_gpu_matches_float64(dtype):
    lin = NVFP4Linear(512, 256, bias=False, recipe=NVFP4Recipe()).cuda()
    x = torch.randn(4, 128, 512, device="cuda", dtype=dtype)
    y = lin(x)
    xq = quantize_nvfp4(x.reshape(-1, 512))
    wq = quantize_nvfp4(lin.weight.detach(), block_shape=(16, 16))  # quantization is not differentiable
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()
    rel = (y.reshape(-1, 256).double() - ref).norm() / ref.norm()
    assert y.dtype == dtype
    assert rel < (1e-5 if dtype == torch.float32 else 8e-3)  # bf16 output: one bf16 rounding


def test_linear_backward_on_gpu_runs_under_autocast():
    lin = NVFP4Linear(256, 256, bias=True).cuda()
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()
    assert lin.weight.grad.abs().sum() > 0


def test_inductor_compiled_nvfp4_mlp_matches_eager_and_has_no_graph_break():
    """The emulated kernels as custom ops under inductor (fullgraph=True): same bits as eager."""
    import copy

    torch.manual_seed(0)
    recipe = NVFP4Recipe(gemm_backend="emulated")
    eager = torch.nn.Sequential(NVFP4Linear(1024, 2048, recipe=recipe, layer_id=0), torch.nn.GELU(),
                                NVFP4Linear(2048, 1024, bias=False, recipe=recipe, layer_id=1)).cuda()
    comp = copy.deepcopy(eager)
    torch._dynamo.reset()
    run = torch.compile(comp, fullgraph=True)
    x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    for step in range(2):
        outs = []
        for model in (eager, run):
            xi = x.clone().requires_grad_(True)
            y = model(xi)
            y.backward(dy)
            outs.append((y, xi.grad, [p.grad.clone() for p in eager.parameters()] if model is eager
                         else [p.grad.clone() for p in comp.parameters()]))
        (ye, dxe, ge), (yc, dxc, gc) = outs
        # GELU is fused by inductor and may differ in the last bit; the NVFP4 GEMMs must not amplify it
        assert (ye.float() - yc.float()).abs().max() <= 1e-2 * ye.float().abs().max()
        assert (dxe.float() - dxc.float()).norm() <= 1e-2 * dxe.float().norm()
        for a, b in zip(ge, gc):
            assert (a.float() - b.float()).norm() <= 2e-2 * a.float().norm()
        eager.zero_grad(set_to_none=True)
        comp.zero_grad(set_to_none=True)
    assert [m.sr_calls for m in comp if isinstance(m, NVFP4Linear)] == [2, 2]


def test_grouped_kernels_on_gpu_match_the_reference_loop():
    """The grouped kernels with autotuned tiles and TMA (uneven aligned groups, empty experts, tail
    rows) against the per-expert reference loop on the same GPU. Same operands bit for bit; the fp32
    sums run in another order (tensor-core tiles vs cuBLAS), so: one bf16 rounding on y and dx, fp32
    rounding on dW."""
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 512, 48, 0, 1024, 16, 720, 1200]) // 16 * 16
    offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
    T, K, N, E = int(counts.sum()) + 64, 512, 384, len(counts)
    x = torch.randn(T, K, generator=g).cuda().bfloat16()
    w = (torch.randn(E, N, K, generator=g) * 0.05).cuda()
    b = torch.randn(E, N, generator=g).cuda()
    dy = torch.randn(T, N, generator=g).cuda().bfloat16()
    out = {}
    for backend in ("reference", "emulated"):
        recipe = NVFP4Recipe(gemm_backend=backend, stochastic_rounding=False)
        xi, wi, bi = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        y = nvfp4_grouped_mm(xi, wi, offsets, bi, recipe, aligned=True)
        y.backward(dy)
        out[backend] = (y, xi.grad, wi.grad, bi.grad)
    for name, ref, got, tol in zip(("y", "dx", "dw", "db"), out["reference"], out["emulated"], (4e-3, 4e-3, 1e-5, 1e-5)):
        rel = (ref.float() - got.float()).norm() / ref.float().norm()
        assert rel < tol, f"{name}: relative difference {rel:.2e}"
    assert not out["emulated"][0][int(offsets[-1]):].any() and not out["emulated"][2][0].any()
    # stochastic rounding on the grouped path stays close to nearest-even
    sr = NVFP4Recipe(gemm_backend="emulated")
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    nvfp4_grouped_mm(xi, wi, offsets, None, sr, aligned=True).backward(dy)
    rel = (wi.grad - out["emulated"][2]).norm() / out["emulated"][2].norm()
    assert 0 < rel < 0.5


def test_sr_block_scale_up_on_gpu_matches_the_reference_scales():
    """sr_block_scale = "up" through the compiled quantization kernel with autotuned tiles (2^22 elements), as
    the native backend quantizes dY: the dgrad rows' and the RHT'd wgrad columns' block scales equal the
    reference's on the same GPU, and every code is one of the two E2M1 grid neighbours of its value."""
    from titan_nvfp4.numerics.rht import rht_signs
    from titan_nvfp4.ops.quantize import quantize_gradient, quantize_wgrad_operand

    g = torch.Generator().manual_seed(3)
    dy = (torch.randn(2048, 2048, generator=g) * torch.exp(torch.randn(2048, 1, generator=g) * 2)).cuda()
    signs = rht_signs(0, "cuda")
    row, col = quantize_gradient(dy, True, True, signs, torch.tensor([5], device="cuda"), "native",
                                 sr_block_scale="up")
    for got, ref, x in ((row, quantize_nvfp4(dy, stochastic=True, seed=0, sr_block_scale="up"), dy),
                        (col, quantize_wgrad_operand(dy, signs, stochastic=True, sr_block_scale="up"), None)):
        assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8))
        assert torch.equal(got.global_scale, ref.global_scale)
        if x is not None:
            gap = 2.0 * ref.row_scales().float().repeat_interleave(16, 1) * ref.global_scale  # the largest E2M1 step
            assert ((got.dequantize() - x).abs() <= gap * (1 + 1e-6)).all()


@pytest.mark.parametrize("m, n", [(1024, 640), (640, 1024)])  # the first runs with its operands swapped
def test_grouped_wgrad_gemm_on_gpu_is_exact(m, n):
    """The wgrad kernel with autotuned tiles and TMA (BK 64: experts ending 16, 32 and 48 tokens past a
    whole step, empty experts, rows past the last expert) against float64, bit for bit: half-integer
    operands make every fp32 sum exact, whatever the order."""
    from titan_nvfp4.kernels import grouped_gemm

    g = torch.Generator().manual_seed(1)
    counts = [0, 512, 48, 0, 1040, 16, 720, 1200, 32, 96]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    t = int(offsets[-1]) + 16
    a = (torch.randint(-12, 13, (m, t), generator=g) * 0.5).half().cuda()
    b = (torch.randint(-12, 13, (n, t), generator=g) * 0.5).half().cuda()
    gs_a = (torch.rand(len(counts) + 1, generator=g) + 0.5).cuda()
    gs_b = (torch.rand(len(counts) + 1, generator=g) + 0.5).cuda()
    out = grouped_gemm.grouped_gemm_tokens(a, b, offsets, gs_a, gs_b, torch.float32)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        exact = a[:, start:end].double() @ b[:, start:end].double().T
        assert torch.equal(out[e], exact.float() * (gs_a[e] * gs_b[e])), e
        start = end


def test_grouped_experts_compile_without_graph_breaks():
    """nvfp4_grouped_mm under inductor (fullgraph=True), forward and backward with SR: the same bits
    as eager, and the SR counter advanced the same way."""
    from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm
    from titan_nvfp4.autograd.linear_function import sr_counter
    from titan_nvfp4.numerics.rht import rht_signs

    recipe = NVFP4Recipe(gemm_backend="emulated")
    offsets = torch.tensor([256, 256, 768, 1024], dtype=torch.int32, device="cuda")
    signs = rht_signs(0, "cuda")
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 512, 256, device="cuda") * 0.05

    def fn(x, w, counter):
        return nvfp4_grouped_mm(x, w, offsets, None, recipe, counter, signs, aligned=True)

    torch._dynamo.reset()
    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        xi, wi, c = x.clone().requires_grad_(), w.clone().requires_grad_(), sr_counter(recipe, 5, "cuda")
        y = f(xi, wi, c)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, wi.grad, c))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("job", ["llama3_nvfp4", "gpt_oss_nvfp4"])
def test_debug_model_trains_under_cuda_graph_trees_as_without(tmp_path, job):
    """A debug model with its blocks compiled, under inductor's CUDA-graph trees (TORCHINDUCTOR_CUDAGRAPHS=1,
    their memory-pool checks on): the same losses as compiled without graphs. The pool check once failed at
    the second block's backward: the reference cycles of the first Triton compiles kept pool tensors alive
    (kernels/launch.py now collects them under graph trees). gpt_oss failed in its first step: its second
    attention mask's build overwrote the first (torchtitan_fixes builds masks without the graphs)."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    losses = {}
    for graphs in ("0", "1"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
               "torchtitan.train",
               "--job.config_file", f"train_configs/{job}.toml", "--training.steps", "8",
               "--metrics.log_freq", "1", "--compile.enable", "--job.dump_folder", str(tmp_path / graphs)]
        r = subprocess.run(cmd, cwd=root, env=dict(os.environ, TORCHINDUCTOR_CUDAGRAPHS=graphs),
                           capture_output=True, text=True, timeout=600)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-4000:]
        losses[graphs] = re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", log)
    assert len(losses["1"]) == 8 and losses["1"] == losses["0"], losses


def test_debug_model_trains_eagerly_with_graphed_bodies_as_without(tmp_path):
    """The README's debug model in eager mode with ``eager_graphs = "small"`` (each NVFP4Linear's forward and
    backward replayed as CUDA graphs: body_graphs.py): the same losses at every step as launching the kernels
    one by one."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    losses = {}
    for mode in ("off", "small"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
               "torchtitan.train",
               "--job.config_file", "train_configs/llama3_nvfp4.toml", "--training.steps", "8",
               "--metrics.log_freq", "1", "--quantize.linear.nvfp4.eager_graphs", mode,
               "--job.dump_folder", str(tmp_path / mode)]
        r = subprocess.run(cmd, cwd=root, env=dict(os.environ), capture_output=True, text=True, timeout=600)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-4000:]
        losses[mode] = re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", log)
    assert len(losses["small"]) == 8 and losses["small"] == losses["off"], losses


@pytest.mark.parametrize("requant", [False, True], ids=["wt_kept", "wt_requantized"])
def test_grouped_experts_train_eagerly_with_graphs_as_without(requant):
    """The deepseek_v3 debug model's routed experts (8 of dim 256, 12,288 routed rows: 8 × 512 tokens, top-3)
    trained eagerly, bf16 autocast, AdamW, stochastic rounding on, with ``eager_graphs = "small"`` (their forward
    and backward bodies replayed as CUDA graphs: grouped_function.py) and with "off": the same outputs, input and
    weight gradients at every step and the same weights after them, bits included, while the token groups change
    every step (one of them empty); the two grouped GEMM calls each captured once forward and once backward, then
    replayed (forward from step 2, backward from step 3: its saved operands move into the forward graph's pool at
    step 2). The experts alone: the whole model's attention backward and token combine accumulate in a
    nondeterministic order on the GPU. Also with requantize_expert_weights (the backward graph reads the weights)."""
    from torchtitan.models.moe import utils as moe_utils

    import titan_nvfp4
    from moe_helpers import build_moe
    from titan_nvfp4.integration.experts import NVFP4GroupedExperts

    steps, align = 4, moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    moe_utils.set_token_group_alignment_size_m(16)  # as the grouped converter sets it: the grouped kernels
    runs = {}
    try:
        for mode in ("off", "small"):
            model, args = build_moe("deepseek_v3", seq=512, n_layers=2)  # a dense block, then a MoE block
            model, _ = titan_nvfp4.convert(model, eager_graphs=mode,
                                           experts={"eager_graphs": mode, "requantize_expert_weights": requant},
                                           filter_fqns=["output", "router.gate", "shared_experts"])
            experts = model.layers["1"].moe.experts
            assert isinstance(experts, NVFP4GroupedExperts)
            model.to_empty(device="cuda")
            torch.manual_seed(0)
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cuda"))
            params = [experts.w1, experts.w2, experts.w3]
            opt = torch.optim.AdamW(params, lr=1e-3)
            e, rows, dim = experts.w1.shape[0], 8 * 512 * args.moe_args.top_k, experts.w1.shape[2]
            g = torch.Generator(device="cuda").manual_seed(1)
            proj = torch.randn(rows, dim, device="cuda", generator=g)
            seen = []
            for step in range(steps):
                cuts = torch.randint(0, rows + 1, (e - 1,), device="cuda", generator=g).sort().values
                counts = torch.diff(cuts, prepend=cuts.new_zeros(1), append=cuts.new_full((1,), rows))
                if step == 2:  # an empty group: expert 3's tokens go to expert 4
                    counts[4] += counts[3]
                    counts[3] = 0
                x = torch.randn(rows, dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                with torch.autocast("cuda", torch.bfloat16):
                    y = experts(x, counts)
                (y.float() * proj).sum().backward()
                seen.append([y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in params])
                opt.step()
                opt.zero_grad(set_to_none=True)
            seen.append([p.detach().clone() for p in params])
            runs[mode] = seen, experts.__dict__.get("_graphs_by_slot", {})
    finally:
        moe_utils.set_token_group_alignment_size_m(align)
    (s_off, g_off), (s_small, g_small) = runs["off"], runs["small"]
    for step, (a, b) in enumerate(zip(s_off, s_small)):  # y, dx, dW1, dW2, dW3 of each step, then the weights
        assert all(torch.equal(u, v) for u, v in zip(a, b)), \
            (step + 1, [(u - v).abs().max().item() for u, v in zip(a, b)])
    assert not g_off and sorted(g_small) == ["w1", "w2"]
    assert all((b.captures, b.replays) == (2, (steps - 1) + (steps - 2)) for b in g_small.values()), \
        [(b.captures, b.replays, b.eager) for b in g_small.values()]


@pytest.mark.parametrize("size", [16, 32, 64, 128])
def test_ms_eden_operand_kernel_on_gpu_is_bit_identical_to_cpu_reference(size):
    """The compiled MS-EDEN kernels (codes, scales, s, staged values, amax) against the reference on the CPU,
    same Philox streams: a bf16 dY-like operand read through its transpose, columns padded, with a NaN
    group, subnormal-range block scales and a pre_scale."""
    from titan_nvfp4.numerics.ms_eden_operand import ms_eden_operand, ms_eden_operand_amax
    from titan_nvfp4.ops import quantize_ms_eden_operand
    from titan_nvfp4.ops import ms_eden_operand_amax as op_amax

    g = torch.Generator().manual_seed(size)
    x = torch.randn(1000, 300, generator=g) * torch.exp2(torch.randint(-8, 8, (1, 300), generator=g).float())
    x[:, 7] *= 0.002  # rows of xᵀ with subnormal-range block scales
    x[5, 11] = float("nan")
    values = x.to(torch.bfloat16).t()  # [300, 1000] strided
    pre = torch.tensor([0.37], dtype=torch.float32)
    amax = ms_eden_operand_amax(values, size=size, sign_seed=12, pre_scale=pre)
    assert bool(amax == float("inf"))
    finite = torch.tensor(700.0)
    ref = ms_eden_operand(values, size=size, sign_seed=12, draw_seed=34, pre_scale=pre, amax=finite)
    seeds = dict(size=size, sign_seed=torch.tensor([12], device="cuda"),
                 draw_seed=torch.tensor([34], device="cuda"), pre_scale=pre.cuda(), amax=finite.cuda())
    got = quantize_ms_eden_operand(values.cuda(), backend="emulated", **seeds)
    staged = quantize_ms_eden_operand(values.cuda(), backend="emulated", staged=True, **seeds)
    assert torch.equal(got.data.cpu(), ref.data)
    assert torch.equal(got.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8))
    assert torch.equal(got.global_scale.cpu(), ref.global_scale)
    want = ref.scaled_codes(torch.float16)
    nan = want.isnan()
    assert torch.equal(staged.values.isnan().cpu(), nan) and bool(nan.any())
    assert torch.equal(staged.values.cpu().view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    clean = values.nan_to_num()
    a_gpu = op_amax(clean.cuda(), size=size, sign_seed=12, backend="emulated", pre_scale=pre.cuda())
    assert torch.equal(a_gpu.cpu(), ms_eden_operand_amax(clean, size=size, sign_seed=12, pre_scale=pre))
    own = ms_eden_operand(clean, size=size, sign_seed=12, draw_seed=34, pre_scale=pre)
    got = quantize_ms_eden_operand(clean.cuda(), backend="emulated", **{**seeds, "amax": None})
    assert torch.equal(got.data.cpu(), own.data)
    assert torch.equal(got.scale.view(torch.uint8).cpu(), own.scale.view(torch.uint8))



@pytest.mark.parametrize("tiles", [False, True])
def test_ms_eden_codes_operand_on_gpu_is_bit_identical_to_cpu_reference(tiles):
    """The compiled kernels reading a saved X̂ / Ŵ as NVFP4 codes in place (1x16 blocks or 16x16 tiles), transposed
    as the backward reads X̂ᵀ and Ŵᵀ, against the reference on the CPU: codes, scales, s and amax."""
    from titan_nvfp4.numerics.ms_eden_operand import ms_eden_operand, ms_eden_operand_amax
    from titan_nvfp4.ops import quantize_ms_eden_operand
    from titan_nvfp4.ops import ms_eden_operand_amax as op_amax

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1000, 304, generator=g) * torch.exp2(torch.randint(-8, 8, (1000, 1), generator=g).float())
    q = quantize_nvfp4(x[:992] if tiles else x, block_shape=(16, 16) if tiles else (1, 16), four_over_six=True)
    pre = q.global_scale.reshape(1).float()
    qg = type(q)(q.data.cuda(), q.scale.cuda(), q.global_scale.cuda(), q.shape, q.block_shape)
    for size in (16, 128):
        ref = ms_eden_operand(q, size=size, sign_seed=12, draw_seed=34, pre_scale=pre, transposed=True)
        got = quantize_ms_eden_operand(qg, size=size, sign_seed=12, draw_seed=34, backend="emulated",
                                       pre_scale=pre.cuda(), transposed=True)
        assert torch.equal(got.data.cpu(), ref.data)
        assert torch.equal(got.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8))
        assert torch.equal(got.global_scale.cpu(), ref.global_scale)
        a = op_amax(qg, size=size, sign_seed=12, backend="emulated", pre_scale=pre.cuda(), transposed=True)
        assert torch.equal(a.cpu(), ms_eden_operand_amax(q, size=size, sign_seed=12, pre_scale=pre, transposed=True))

@pytest.mark.skipif(torch.version.hip is not None, reason="precompile manifests are for CUDA GPUs")
def test_precompiled_kernels_serve_a_real_step_without_compiling(tmp_path):
    """Record the kernels of an NVFP4 training step, precompile them into an empty Triton cache on a process pool
    (titan_nvfp4.tools.precompile_kernels), then run the step in a new process on that cache: it adds no entry,
    so every specialization it met was precompiled under the key it asked for, its C launcher included."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))  # the device's wheels too
    base = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0", "TITAN_NVFP4_PRECOMPILE": "0"}
    step = [sys.executable, str(root / "tests" / "precompile_first_use.py"), "--gpu"]
    manifest, recorded, cache = tmp_path / "m.json", tmp_path / "recorded", tmp_path / "pre"
    r = subprocess.run(step + ["--record", str(manifest)], env={**base, "TRITON_CACHE_DIR": str(recorded)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from titan_nvfp4.kernels import precompile
    doc = precompile.load(manifest)
    assert not doc["unfaithful"], doc["unfaithful"]  # each entry rebuilds the compile it was recorded from
    n = len(doc["kernels"])
    assert n >= 4
    r = subprocess.run([sys.executable, "-m", "titan_nvfp4.tools.precompile_kernels", str(manifest)],
                       env={**base, "TRITON_CACHE_DIR": str(cache)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"{n} of {n} kernel specializations" in r.stderr, r.stderr[-3000:]
    precompiled = r.stderr
    def kernels(folder):  # compiled kernels (autotuning choices are cached in the same folder)
        return {d for d in os.listdir(folder) if (folder / d).is_dir()
                and any(f.endswith(".cubin") for f in os.listdir(folder / d))}
    def launchers(folder):  # the kernels' C launchers (built with gcc)
        return {d for d in os.listdir(folder) if (folder / d).is_dir()
                and any(f.startswith("__triton_launcher") for f in os.listdir(folder / d))}
    filled, built = kernels(cache), launchers(cache)
    assert len(filled) == n
    r = subprocess.run(step, env={**base, "TRITON_CACHE_DIR": str(cache)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    added = kernels(cache) - filled
    def names(folders):  # the kernel each cache folder holds, from its metadata file
        import json
        return sorted(json.loads(next(f for f in (cache / d).iterdir() if f.suffix == ".json"
                                      and not f.name.startswith("__grp")).read_text())["name"] for d in folders)
    assert not added, (f"{len(added)} kernels compiled on first use despite the precompile: {names(added)}; "
                       f"precompile stderr: {precompiled[-1500:]}")
    assert launchers(cache) == built, "the first use built C launchers (gcc) the precompile had not built"


@pytest.mark.parametrize("compiled", [False, True])
def test_outcontrol_linear_on_the_gpu_kernels_matches_the_reference_backend(compiled):
    """TetraJet-v2's OutControl after its selection (autograd/outcontrol_linear.py) at a Linear's size, BF16, on the
    emulated backend's kernels (the MXFP8 addend GEMM autotuned: M·N ≥ 2²²), eager and under inductor, against the
    reference backend on the same GPU, nearest rounding: Y, dX, dW and db within 4e-3 relative (the quantized
    operands agree bit for bit; the GEMMs sum in other orders before their BF16 rounding, ~2e-3 apart at most; a
    wrong column or scale moves a result by far more), the rebuilt dgrad weight included."""
    from titan_nvfp4.autograd.linear_function import cached_rht_signs, sr_counter
    from titan_nvfp4.autograd.outcontrol_linear import outcontrol_linear
    from titan_nvfp4.recipe.nvfp4_recipe import build_recipe

    m, k, n = 4096, 1024, 2048
    g = torch.Generator(device="cuda").manual_seed(7)
    x0 = torch.randn(m, k, device="cuda", generator=g)
    x0[:, ::9] *= 30.0  # outlier channels
    w0 = torch.randn(n, k, device="cuda", generator=g) * 0.03
    b0 = torch.randn(n, device="cuda", generator=g)
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    sel = torch.arange(0, k, 9, device="cuda")[:96].sort().values
    taken = torch.zeros(k, dtype=torch.bool, device="cuda")
    taken[sel] = True
    rest = (~taken).nonzero().reshape(-1)
    out = {}
    for backend in ("reference", "emulated"):
        recipe = build_recipe("nvidia_paper", {"gemm_backend": backend, "stochastic_rounding": False})
        x, w, b = (t.bfloat16().requires_grad_() for t in (x0, w0, b0))
        counter, signs = sr_counter(recipe, 0, "cuda"), cached_rht_signs(recipe.rht_seed, x.device)

        def f(x, w, b):
            return outcontrol_linear(x, w, b, recipe, counter, signs, sel, rest)

        fn = torch.compile(f, fullgraph=True) if compiled and backend == "emulated" else f
        y = fn(x, w, b)
        y.backward(dy)
        out[backend] = (y.detach(), x.grad, w.grad, b.grad)
    for what, ref, got in zip(("Y", "dX", "dW", "db"), out["reference"], out["emulated"]):
        err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 4e-3, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("cudagraphs,tuned,low_memory", [(False, False, False), (True, False, False), (True, True, False),
                                                          (True, False, True)])
def test_compiled_experts_body_matches_eager_under_inductor(monkeypatch, cudagraphs, tuned, low_memory):
    """The deepseek_v3 debug MoE block's NVFP4 experts with their body compiled by inductor (as under TorchTitan's
    --compile.enable, which compiles BF16's expert GEMMs function: simulated here) against eager on the GPU: the same
    output, input and weight gradients, bits included, stochastic rounding on (integration/experts.py: _body).
    With CUDA graph trees too (TORCHINDUCTOR_CUDAGRAPHS=1), which refuse a tensor the body leaves alive in their pool
    (a cached constant first made during their warm-up failed the deepseek_v3 debug job, H200, 2026-12-06).
    ``tuned``: dim and expert hidden 1024 and 16k tokens, so that every grouped GEMM autotunes, with nothing shipped,
    stored or launched before: the tuning runs inside the trees' warm-up (its garbage once failed the 16B job there).
    ``low_memory``: ``requantize_expert_weights = true`` and ``staged_expert_activations = false`` in both runs (the
    knobs that keep the gpt-oss-20b-shaped job's memory below BF16's)."""
    from torchtitan.models.moe import moe as moe_module
    from torchtitan.models.moe import utils as moe_utils

    from job_helpers import parse, world1
    from moe_helpers import build_moe
    from titan_nvfp4.integration.converter import NVFP4GroupedMMConverter

    from titan_nvfp4.kernels import launch as L

    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    bf16_gemms = moe_module._run_experts_grouped_mm
    dims, batch, seq = (dict(dim=1024, moe_inter_dim=1024), 8, 2048) if tuned else ({}, 4, 512)
    runs = []
    try:
        for backend in (None, "inductor"):
            torch._dynamo.reset()
            args = []
            if low_memory:
                args = ["--quantize.grouped_mm.nvfp4.requantize_expert_weights", "True",
                        "--quantize.grouped_mm.nvfp4.staged_expert_activations", "False"]
            if backend:
                args += ["--compile.enable", "--compile.backend", backend]
                monkeypatch.setattr(moe_module, "_run_experts_grouped_mm", torch.compile(bf16_gemms, fullgraph=True))
                monkeypatch.setattr(torch._inductor.config.triton, "cudagraphs", cudagraphs)
                if tuned:  # every choice benchmarked again, in the compiled run
                    monkeypatch.setenv("TITAN_NVFP4_SHIPPED_TUNING", "0")
                    monkeypatch.setattr(L, "_LAUNCHERS", {})
                    for tuner in L.TUNERS:
                        monkeypatch.setattr(tuner, "cache", {})
                        monkeypatch.setattr(tuner, "cache_results", False)
            conv = NVFP4GroupedMMConverter(parse(*args), world1())
            model, margs = build_moe("deepseek_v3", n_layers=2, seq=seq, **dims)
            conv.convert(model)
            model.to_empty(device="cuda")
            torch.manual_seed(0)
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cuda"))
            moe = model.layers["1"].moe
            m = moe.experts
            x = torch.randn(batch, seq, margs.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            x.requires_grad_()
            for _ in range(3):  # later calls replay what the first compiled (graph trees: warm-up, record, replay)
                # gradients set to None each step, as a training loop's zero_grad does: graph outputs (dW) become
                # the .grad tensors, which the next replay overwrites, so each step's results are cloned
                x.grad = None
                model.zero_grad(set_to_none=True)
                y = moe(x)
                y.square().mean().backward()
                out = [t.detach().clone() for t in (y, x.grad, *(getattr(m, g).grad for g in m.GEMMS))]
            assert (m.__dict__.get("_compiled_run") is not None) == (backend is not None)
            assert (m.recipe.requantize_expert_weights, m.recipe.staged_expert_activations) == (low_memory,
                                                                                                not low_memory)
            runs.append((*out, m.sr_counter.clone()))
    finally:
        moe_utils.set_token_group_alignment_size_m(align)
        torch._dynamo.reset()
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), i


def test_a_device_move_keeps_the_per_step_state_and_to_empty_onto_another_device_resets_it():
    """.cpu() / .cuda() copy the SR call counts and amax windows (a checkpoint loaded on the CPU, then moved);
    to_empty() onto another device leaves uninitialized memory, which the layer refills as at step 0."""
    import titan_nvfp4
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda()
    model, steps = titan_nvfp4.convert(model, gemm_backend="reference", activation_amax_history=2)
    x = torch.randn(16, 64, device="cuda")
    for _ in range(3):
        model(x).square().mean().backward()
        steps.step()
    layer = model[2]
    counter, window = layer.sr_counter.cpu(), layer.x_amax_history.cpu()
    model.cpu()
    assert torch.equal(layer.sr_counter, counter) and torch.equal(layer.x_amax_history, window)
    model.cuda()
    assert layer.sr_calls == 3 and torch.equal(layer.x_amax_history.cpu(), window)
    model(x).square().mean().backward()  # the windows are ready: no amax of 0
    model.to_empty(device="cpu")
    assert layer.sr_calls == 0 and not layer.x_amax_history.any()
