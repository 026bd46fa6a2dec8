"""The TorchTitan 0.3 integration on CPU (skipped unless torchtitan 0.3 is installed; .ci/torchtitan03 runs it):
config parsing, the config-tree converters, the NVFP4 routed experts against the core's grouped functions, and
the llama3, qwen3, deepseek_v3 and gpt_oss debug models through their own parallelize on one gloo rank, forward
and backward with NVFP4 layers; llama3 and deepseek_v3 under tensor parallelism on 2 gloo ranks against one
process."""

import math
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import logging

import pytest

from titan_nvfp4.integration_common.torchtitan_version import installed_generation

if installed_generation() != "0.3":
    pytest.skip("needs torchtitan 0.3 (.ci/torchtitan03)", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention, FusedQKVLinear, ScaledDotProductAttention, VarlenAttention)
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu  # noqa: E402

from dist_util import PRELOAD_V03, run_ranks  # noqa: E402
from titan_nvfp4.modules.expert_groups import experts_layer_id, pad_token_groups  # noqa: E402
from titan_nvfp4.autograd.grouped_function import nvfp4_grouped_mm_shared, nvfp4_grouped_swiglu  # noqa: E402
from titan_nvfp4.modules.decomposed_linear import DecomposedLinear, redecompose  # noqa: E402
from titan_nvfp4.integration_v03.converter import NVFP4GroupedMMConfigConverter  # noqa: E402
from titan_nvfp4.integration_v03.decomposed import TitanDecomposedLinear  # noqa: E402
from titan_nvfp4.integration_v03.experts import TitanNVFP4GptOssExperts, TitanNVFP4GroupedExperts  # noqa: E402
from titan_nvfp4.integration_v03.modules import TitanNVFP4Linear  # noqa: E402
from titan_nvfp4.integration_v03.trainer import (NVFP4Trainer, after_optimizer_step, apply_quantize,  # noqa: E402
                                                 attach_sections)
from titan_nvfp4.training.schedule import LINEAR_STEPS  # noqa: E402
from titan_nvfp4.training.step_state import SectionSteps  # noqa: E402
from titan_nvfp4.modules.lowrank_experts import LowRankExperts, grouped_lowrank  # noqa: E402

MODULE = "titan_nvfp4.integration_v03.configs"
DOC = Path(__file__).resolve().parents[1] / "docs" / "torchtitan03.md"
SEQ, BATCH = 64, 2


def parse(config: str = "llama3_debug_nvfp4", *overrides: str):
    return ConfigManager().parse_args(["--module", MODULE, "--config", config, *overrides])


def block_linears(model_config) -> dict[str, type]:
    return {fqn: type(cfg) for fqn, cfg, _, _ in model_config.traverse(Linear.Config) if fqn.startswith("layers.")}


def test_config_parses_with_overrides():
    c = parse("llama3_debug_nvfp4", "--quantize.linear.recipe", "naive_rtn", "--quantize.linear.gemm_backend",
              "reference", "--quantize.linear.filter_fqns", "lm_head,wo", "--training.seq_len", str(SEQ))
    assert isinstance(c, NVFP4Trainer.Config) and c.quantize.linear.enable
    assert c.quantize.linear.filter_fqns == ["lm_head", "wo"] and c.training.seq_len == SEQ
    recipe = c.quantize.linear.build_recipe()
    assert recipe.gemm_backend == "reference" and not recipe.stochastic_rounding  # naive_rtn
    assert (c.dataloader.dataset, c.training.disable_cuda_graphs) == ("pystdlib", True)
    assert c.hf_assets_path.endswith("assets/pystdlib")
    bf16 = parse("llama3_debug_bf16")
    assert not bf16.quantize.linear.enable and bf16.quantize.linear.filter_fqns[0] == "lm_head"


def test_eager_graphs_parses_in_both_sections():
    """One knob, one name (test_grouped_graphs.py on 0.2): the experts' eager CUDA graphs are asked for in
    quantize.grouped_mm as the Linears' in quantize.linear."""
    q = parse("deepseek_v3_debug_nvfp4", "--quantize.linear.eager_graphs", "small",
              "--quantize.grouped_mm.eager_graphs", "small").quantize
    assert q.linear.build_recipe().eager_graphs == q.grouped_mm.build_recipe().eager_graphs == "small"
    assert parse("deepseek_v3_debug_nvfp4").quantize.grouped_mm.build_recipe().eager_graphs == "off"


def test_documented_configs_parse():
    """Every --config of docs/torchtitan03.md's run commands parses through ConfigManager; the MoE NVFP4 entries
    enable both sections, the others the Linears only."""
    names = re.findall(r"--module titan_nvfp4\.integration_v03\.configs --config (\w+)", DOC.read_text())
    assert len(names) >= 7 and "deepseek_v3_debug_nvfp4" in names and "gpt_oss_debug_nvfp4" in names
    for name in names:
        q = parse(name).quantize
        nvfp4 = name.endswith("_nvfp4")
        moe = name.split("_debug")[0] in ("deepseek_v3", "gpt_oss", "qwen3_moe")
        assert (q.linear.enable, q.grouped_mm.enable) == (nvfp4, nvfp4 and moe), name


@pytest.mark.parametrize("args, words", [
    (["--quantize.linear.gemm_backend", "bogus"], ["quantize.linear", "gemm_backend", "bogus"]),
    (["--quantize.linear.recipe", "no_such_preset"], ["unknown recipe", "no_such_preset"]),
    (["--quantize.linear.lora_rank", "-16"], ["[quantize.linear] lora_rank must be 0 (off) or a positive multiple of "
                                              "16, got -16"]),
    (["--quantize.linear.lora_refresh_steps", "2"], ["[quantize.linear] lora_refresh_steps = 2 needs lora_rank > 0"]),
    (["--quantize.linear.bf16_after_fraction", "1.5"], ["bf16_after_fraction", "1.5"]),
    (["--quantize.linear.no_such_knob", "1"], ["Unrecognized options", "--quantize.linear.no_such_knob"]),
    (["--quantize.grouped_mm.lora_rank", "24"], ["[quantize.grouped_mm] lora_rank must be 0 (off) or a positive "
                                                  "multiple of 16, got 24"]),
    (["--quantize.grouped_mm.backward", "mxfp8"], ["quantize.grouped_mm", "the experts run an NVFP4 backward only"]),
    (["--quantize.linear.bf16_after_fraction", "0.5", "--quantize.linear.bf16_after_scope", "fwd"],
     ["[quantize.linear] bf16_after_scope must be one of ['forward_backward', 'forward'], got 'fwd'"]),
    (["--quantize.linear.bf16_after_scope", "forward"],
     ["[quantize.linear] bf16_after_scope = 'forward' needs bf16_after_fraction > 0"]),
    (["--quantize.grouped_mm.bf16_after_fraction", "0.5", "--quantize.grouped_mm.bf16_after_scope", "forward"],
     ["[quantize.grouped_mm] bf16_after_scope = 'forward': the routed experts switch forward and backward together"]),
    (["--quantize.linear.recipe", "quartet2", "--quantize.linear.rht_size", "48"],
     ["[quantize.linear] rht_size must be one of [16, 32, 64, 128], got 48"]),
    (["--quantize.linear.ms_eden", "True"], ["[quantize.linear] ms_eden = true replaces stochastic rounding"]),
    (["--quantize.grouped_mm.recipe", "quartet2"],
     ["[quantize.grouped_mm] ms_eden = true (from the recipe 'quartet2'): the grouped GEMMs have no MS-EDEN"]),
    (["--quantize.grouped_mm.eager_graphs", "on"],
     ["[quantize.grouped_mm] eager_graphs must be one of ['off', 'small'], got 'on'"]),
])
def test_bad_knob_stops_the_parse_naming_it(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        parse("llama3_debug_nvfp4", *args)
    assert e.value.code != 0
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    for w in words:
        assert w in err, (w, err[-1500:])


def test_converter_swaps_every_block_linear_on_meta():
    c = parse("llama3_debug_nvfp4")
    apply_quantize(c)
    types = block_linears(c.model_spec.model)
    assert len(types) == 6 * 5 and set(types.values()) == {TitanNVFP4Linear.Config}  # wqkv, wo, w1, w2, w3
    ids = [cfg.layer_id for _, cfg, _, _ in c.model_spec.model.traverse(TitanNVFP4Linear.Config)]
    assert ids == list(range(30)) and type(c.model_spec.model.lm_head) is Linear.Config
    apply_quantize(c)  # converting twice is a no-op
    assert [cfg.layer_id for _, cfg, _, _ in c.model_spec.model.traverse(TitanNVFP4Linear.Config)] == ids
    bf16 = parse("llama3_debug_bf16")
    apply_quantize(bf16)
    assert set(block_linears(bf16.model_spec.model).values()) == {Linear.Config}


class EagerAttention(ScaledDotProductAttention):
    """Causal attention in eager math that hands its log-sum-exp to an out_transform (gpt_oss's sinks): a CPU
    stand-in for VarlenAttention, which needs CUDA."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        s = s.masked_fill(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1), float("-inf"))
        out = (torch.softmax(s, -1) @ v).transpose(1, 2)
        return out if out_transform is None else out_transform(out, s.logsumexp(-1).transpose(1, 2))


def build_parallelized(c, monkeypatch, blocks: int | None = None):
    """The model of ``c`` on meta, through its parallelize_fn on the 1-rank gloo mesh, then materialized; with
    ``blocks``, only the first ``blocks`` transformer blocks."""
    import torchtitan.distributed.parallel_dims as pd_module

    monkeypatch.setattr(pd_module, "device_type", "cpu")
    return build_on_ranks(c, 1, blocks)[0]


def build_on_ranks(c, world: int, blocks: int | None = None):
    """(model, ParallelDims): build_parallelized on a ``world``-rank gloo group (TorchTitan's meshes on the CPU)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    spec, mc = c.model_spec, c.model_spec.model
    if blocks is not None:
        mc.layers = mc.layers[:blocks]
    for _, _, parent, attr in list(mc.traverse(FlexAttention.Config)):  # CPU: FlexAttention has no backward
        setattr(parent, attr, ScaledDotProductAttention.Config())
    for _, _, parent, attr in list(mc.traverse(VarlenAttention.Config)):  # CUDA only
        setattr(parent, attr, EagerAttention.Config())
    mc.update_from_config(config=c)
    dist_utils.set_spmd_backend(c.parallelism.spmd_backend)
    pd = ParallelDims.from_config(c.parallelism, world)
    with torch.device("meta"):
        model = mc.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(model, parallel_dims=pd, training=c.training, parallelism=c.parallelism,
                                compile_config=c.compile, ac_config=c.activation_checkpoint, dump_folder=c.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, pd


@pytest.fixture
def gloo_rank():
    """A 1-rank gloo group, on one intra-op thread (the tiny GEMMs run 5x slower on oversubscribed cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.mark.long
@pytest.mark.parametrize("model_name, blocks", [("llama3", 6), ("qwen3", 2)])
def test_debugmodel_forward_backward_in_nvfp4(gloo_rank, monkeypatch, tmp_path, model_name, blocks):
    """The registry's <model>_debug_nvfp4 through the model's own parallelize_fn (llama3's whole debug model, the
    first 2 of qwen3's 8 blocks): every block Linear (fused wqkv, wo, w1, w2, w3) in NVFP4, a finite loss near
    uniform at init, gradients and one SR call per layer, and the checkpoint keys of the BF16 twin."""
    torch.manual_seed(0)
    c = parse(f"{model_name}_debug_nvfp4", "--quantize.linear.gemm_backend", "reference", "--training.seq_len",
              str(SEQ), "--training.local_batch_size", str(BATCH), "--dump_folder", str(tmp_path))
    apply_quantize(c)
    model = build_parallelized(c, monkeypatch, blocks=blocks)
    nvfp4 = {n: m for n, m in model.named_modules() if isinstance(m, TitanNVFP4Linear)}
    assert len(nvfp4) == blocks * 5
    lin = model.layers["0"].feed_forward.w1
    assert lin.recipe.gemm_backend == "reference" and int(lin.sr_counter[1]) == 0
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (BATCH, SEQ))
    out = model(tokens, positions=torch.arange(SEQ).repeat(BATCH, 1), attention_masks=None)
    loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    value = float(loss.detach())
    assert math.isfinite(value) and abs(value - math.log(vocab)) < 1.5  # near uniform at init
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad.full_tensor()
               if hasattr(m.weight.grad, "full_tensor") else m.weight.grad).all() for m in nvfp4.values())
    assert all(m.sr_calls == 1 for m in nvfp4.values())  # one backward drew one SR call per layer
    keys = set(model.state_dict())
    bf16 = parse(f"{model_name}_debug_bf16")
    bf16.model_spec.model.layers = bf16.model_spec.model.layers[:blocks]
    with torch.device("meta"):
        assert keys == set(bf16.model_spec.model.build().state_dict())  # the same checkpoint keys as BF16


# ------------------------------------------------------------------------------------------- routed experts

EXPERTS = (TitanNVFP4GroupedExperts, TitanNVFP4GptOssExperts)


def expert_configs(model_config) -> dict[str, object]:
    return {fqn: cfg for fqn, cfg, _, _ in model_config.traverse(GroupedExperts.Config)}


@pytest.mark.parametrize("model_name, nvfp4, blocks, linears", [
    ("deepseek_v3", TitanNVFP4GroupedExperts, range(1, 6), 6 * 4 + 3),  # wq, wkv_a, wkv_b, wo; layer 0's FFN
    ("gpt_oss", TitanNVFP4GptOssExperts, range(4), 4 * 2),  # wqkv, wo
    ("qwen3_moe", TitanNVFP4GroupedExperts, range(8), 8 * 2),  # wqkv, wo
])
def test_grouped_converter_swaps_the_routed_experts_on_meta(model_name, nvfp4, blocks, linears):
    """The MoE entries convert every routed-expert config (SR streams apart from the Linears') and the block
    Linears but the router gates and shared experts; converting twice is a no-op; the BF16 twins convert nothing."""
    c = parse(f"{model_name}_debug_nvfp4")
    assert c.quantize.grouped_mm.enable and c.quantize.linear.enable
    apply_quantize(c)
    experts = expert_configs(c.model_spec.model)
    assert list(experts) == [f"layers.{i}.moe.routed_experts.inner_experts" for i in blocks]
    assert {type(cfg) for cfg in experts.values()} == {nvfp4.Config}
    assert [cfg.layer_id for cfg in experts.values()] == [experts_layer_id(i) for i in range(len(experts))]
    assert [cfg.name for cfg in experts.values()] == list(experts)
    assert len(list(c.model_spec.model.traverse(TitanNVFP4Linear.Config))) == linears
    apply_quantize(c)
    assert [cfg.layer_id for cfg in expert_configs(c.model_spec.model).values()] == [
        experts_layer_id(i) for i in range(len(experts))]
    bf16 = parse(f"{model_name}_debug_bf16")
    apply_quantize(bf16)
    assert not any(isinstance(cfg, tuple(e.Config for e in EXPERTS)) for cfg in expert_configs(
        bf16.model_spec.model).values())


EP_UPSTREAM = {"deepseek_v3_16b": 8}  # the flagships' expert parallelism in TorchTitan 0.3.0's configs


@pytest.mark.parametrize("name, linears, experts", [
    ("llama3_8b", 32 * 5, 0),  # wqkv, wo, w1, w2, w3
    ("qwen3_30b_a3b", 48 * 2, 48),  # wqkv, wo; 128 experts per block
    ("deepseek_v3_16b", 27 * 4 + 3, 26),  # wq, wkv_a, wkv_b, wo; layer 0's dense FFN
    ("gpt_oss_20b", 24 * 2, 24),  # wqkv, wo
])
def test_flagship_entries_convert_on_meta(name, linears, experts):
    """Each flagship entry parses, reads the offline corpus with upstream's parallelism, and converts every block
    Linear and routed-expert config (its BF16 twin none); the Llama3 8B model builds on meta with NVFP4 modules."""
    c = parse(f"{name}_nvfp4")
    assert (c.dataloader.dataset, c.parallelism.expert_parallel_degree) == ("pystdlib", EP_UPSTREAM.get(name, 1))
    assert c.hf_assets_path.endswith("assets/pystdlib") and c.quantize.grouped_mm.enable == bool(experts)
    apply_quantize(c)
    assert len(list(c.model_spec.model.traverse(TitanNVFP4Linear.Config))) == linears
    converted = [cfg for cfg in expert_configs(c.model_spec.model).values() if isinstance(cfg, tuple(e.Config for e in EXPERTS))]
    assert len(converted) == experts
    bf16 = parse(f"{name}_bf16")
    apply_quantize(bf16)
    assert not list(bf16.model_spec.model.traverse(TitanNVFP4Linear.Config))
    if name == "llama3_8b":
        with torch.device("meta"):
            model = c.model_spec.model.build()
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.startswith("layers.") and n.count(".") == 3}
        assert "TitanNVFP4Linear" in kinds and "Linear" not in kinds, kinds


def test_grouped_converter_refuses_a_model_without_experts():
    c = parse("llama3_debug_nvfp4", "--quantize.grouped_mm.enable")
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm\] no routed-expert config matched fqns \['experts'\]"):
        apply_quantize(c)


def test_pad_token_groups_aligns_every_group_and_maps_rows_back():
    """Each expert's rows at the start of a slot of round_up(count, 16) rows, zeros elsewhere, tail rows (no
    expert's) after the last slot, a fixed row count; y[rows] undoes it, gradients included."""
    counts = torch.tensor([5, 0, 19, 16])
    x = torch.randn(43, 4, requires_grad=True)  # 40 routed rows and 3 of no expert
    p = pad_token_groups(x, counts)
    assert p.counts.tolist() == [16, 0, 32, 16] and p.counts.dtype == counts.dtype
    assert p.x.shape == (112, 4)  # round_up(43 + 4 * 15, 16)
    assert p.rows.tolist() == [*range(5), *range(16, 35), *range(48, 64), 64, 65, 66]
    assert torch.equal(p.x[p.rows], x) and not p.x[p.valid(torch.float32)[:, 0] == 0].any()
    p.x[p.rows].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


E, D, F = 4, 32, 48
COUNTS = [5, 0, 19, 8]  # groups not aligned to 16, an empty expert
#: TorchTitan's expert modules and their parameters, by the SwiGLU they run
EXPERT_KINDS = {
    "swiglu": (GroupedExperts, ("w1_EFD", "w2_EDF", "w3_EFD")),
    "gpt_oss": (GptOssGroupedExperts, ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")),
}


def build_experts(upstream, names, **recipe):
    """``upstream`` (GroupedExperts, GptOssGroupedExperts) under a RoutedExperts config, converted by the
    grouped converter with ``recipe`` overrides, built and initialized on the CPU."""
    init = {n: partial(torch.nn.init.normal_, std=0.2) for n in names}
    root = RoutedExperts.Config(inner_experts=upstream.Config(dim=D, hidden_dim=F, num_experts=E, param_init=init),
                                token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=2))
    root = NVFP4GroupedMMConfigConverter.Config(gemm_backend="reference", **recipe).build().convert(root)
    module = root.inner_experts.build()
    module.init_states()
    return module


def experts_reference(kind, x, p, counts, limit=7.0):
    """The experts in float64, expert after expert: SwiGLU (w1, w2, w3) or gpt_oss's (mlp1, mlp2, biases)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        start += n
        if kind == "swiglu":
            out.append((torch.nn.functional.silu(xe @ p[0][e].T) * (xe @ p[2][e].T)) @ p[1][e].T)
        else:
            out.append(swiglu(xe @ p[0][e].T + p[1][e], limit=limit) @ p[2][e].T + p[3][e])
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clamped_swiglu_is_torchtitan03s_swiglu_bit_for_bit(dtype):
    """0.3's gpt-oss swiglu ends in addcmul (one rounding): clamped_swiglu(addcmul=True), which keeps only its input
    for backward, gives its output and input gradient bits under autograd, clamp bounds, signed zeros, infinities
    and NaN included (tests/test_clamped_swiglu.py: the same against 0.2's formula)."""
    from clamped_swiglu_cases import bits, case

    from titan_nvfp4.autograd.clamped_swiglu import clamped_swiglu

    for scale in (0.5, 3.0, 8.0, 30.0):
        x, dy = case((3, 50, 96), dtype, scale, seed=int(scale * 10), device="cpu")
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = swiglu(a), clamped_swiglu(b, addcmul=True)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(bits(ya), bits(yb)) and torch.equal(bits(a.grad), bits(b.grad)), scale


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_experts_equal_the_core_grouped_functions_on_unpadded_groups(kind):
    """The converted experts (groups padded to 16 inside) against the core's grouped functions on the unpadded
    groups with the same weights, counters and signs: without stochastic rounding the same bits for y, dx and
    every weight gradient (bias gradients to fp32 summation order); with it the same forward. Both within
    NVFP4's error of a float64 reference."""
    upstream, names = EXPERT_KINDS[kind]
    counts = torch.tensor(COUNTS)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    for sr in (False, True):
        torch.manual_seed(0)
        m = build_experts(upstream, names, stochastic_rounding=sr)
        assert type(m) is {"swiglu": TitanNVFP4GroupedExperts, "gpt_oss": TitanNVFP4GptOssExperts}[kind]
        assert [n for n, _ in m.named_parameters()] == list(names)
        c = m.sr_counter.clone()
        x = torch.randn(sum(COUNTS), D, requires_grad=True)
        dy = torch.randn(sum(COUNTS), D)
        y = m(x, counts)
        y.backward(dy)
        assert bool((m.sr_counter[:, 1] == int(sr)).all())  # one SR call per GEMM, if it rounds stochastically
        got = [y.detach(), x.grad, *(getattr(m, n).grad for n in names)]

        xc = x.detach().clone().requires_grad_()
        p = [getattr(m, n).detach().clone().requires_grad_() for n in names]
        r, signs = m.recipe, m.rht_signs
        if kind == "swiglu":
            h, _ = nvfp4_grouped_swiglu(xc, p[0], p[2], offsets, r, (c[0], c[2]), signs)
            (yc,) = nvfp4_grouped_mm_shared(h, (p[1],), offsets, (None,), r, (c[1],), signs)
        else:
            (h,) = nvfp4_grouped_mm_shared(xc, (p[0],), offsets, (p[1],), r, (c[0],), signs)
            (yc,) = nvfp4_grouped_mm_shared(swiglu(h, limit=m.swiglu_limit), (p[2],), offsets, (p[3],), r, (c[1],),
                                            signs)
        yc.backward(dy)
        want = [yc.detach(), xc.grad, *(t.grad for t in p)]
        assert torch.equal(got[0], want[0])
        if not sr:
            for name, a, b in zip(("y", "dx", *names), got, want):
                assert (torch.allclose(a, b, rtol=1e-6, atol=1e-6) if "bias" in name else torch.equal(a, b)), name

        x64 = x.detach().double().requires_grad_()
        p64 = [getattr(m, n).detach().double().requires_grad_() for n in names]
        y64 = experts_reference(kind, x64, p64, COUNTS)
        y64.backward(dy.double())
        for name, a, b in zip(("y", "dx", *names), got, [y64.detach(), x64.grad, *(t.grad for t in p64)]):
            err = float((a.double() - b).norm() / b.norm())
            assert err < 0.35, (name, sr, err)  # K = 32: two blocks a row, 4-bit elements


@pytest.mark.parametrize("model_name, blocks, n_experts", [("deepseek_v3", 2, 1), ("gpt_oss", 1, 1)])
def test_moe_debugmodel_forward_backward_in_nvfp4(gloo_rank, monkeypatch, tmp_path, model_name, blocks, n_experts):
    """The registry's <model>_debug_nvfp4 through the model's own parallelize_fn (deepseek_v3 with its selective
    activation checkpointing), its first ``blocks`` blocks (deepseek_v3's dense block 0 and a MoE block): the
    routed experts and block Linears in NVFP4, a finite loss near uniform at init, a finite gradient on every
    parameter, one SR call per GEMM, and the checkpoint keys of the BF16 twin (the whole model)."""
    torch.manual_seed(0)
    args = ["--quantize.linear.gemm_backend", "reference", "--quantize.grouped_mm.gemm_backend", "reference",
            "--training.seq_len", str(SEQ // 2), "--training.local_batch_size", str(BATCH),
            "--dump_folder", str(tmp_path)]
    full = parse(f"{model_name}_debug_nvfp4", *args)
    apply_quantize(full)
    with torch.device("meta"):
        keys = set(full.model_spec.model.build().state_dict())
        bf16 = parse(f"{model_name}_debug_bf16")
        assert keys == set(bf16.model_spec.model.build().state_dict())
    c = parse(f"{model_name}_debug_nvfp4", *args)
    apply_quantize(c)
    model = build_parallelized(c, monkeypatch, blocks)
    experts = [m for m in model.modules() if isinstance(m, EXPERTS)]
    assert len(experts) == n_experts and experts[0].recipe.gemm_backend == "reference"
    linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (BATCH, SEQ // 2))
    out = model(tokens, positions=torch.arange(SEQ // 2).repeat(BATCH, 1), attention_masks=None)
    loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    value = float(loss.detach())
    assert math.isfinite(value) and abs(value - math.log(vocab)) < 1.5
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g.full_tensor() if hasattr(g, "full_tensor") else g).all()
               for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(bool((m.sr_counter[:, 1] == 1).all()) for m in experts)
    assert all(m.sr_calls == 1 for m in linears)


# ------------------------------------------------------------------------------------------- tensor parallelism

TP_BLOCKS = 2
TP_ARGS = ("--quantize.linear.gemm_backend", "reference", "--quantize.linear.stochastic_rounding", "False",
           "--training.local_batch_size", str(BATCH),
           "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32")


def tp_config(tp: int, backend: str, tmp_path, model_name: str = "llama3", *overrides: str):
    """<model>_debug_nvfp4 at TP degree ``tp`` on ``backend``, reference GEMMs, no SR, fp32 params, converted."""
    moe = () if model_name == "llama3" else ("--quantize.grouped_mm.gemm_backend", "reference",
                                              "--quantize.grouped_mm.stochastic_rounding", "False")
    seq = SEQ if model_name == "llama3" else SEQ // 2  # the MoE blocks cost 3x per token on the CPU
    c = parse(f"{model_name}_debug_nvfp4", *TP_ARGS, *moe, "--training.seq_len", str(seq),
              "--parallelism.tensor_parallel_degree", str(tp),
              "--parallelism.spmd_backend", backend, "--dump_folder", str(tmp_path), *overrides)
    apply_quantize(c)
    return c


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def tp_step(model, pd, tokens):
    """Forward and backward in TorchTitan's SPMD context (the trainer's train_context). The loss is the mean square
    of the whole logits, summed from each rank's vocab shard (the LM head's output stays sharded). Returns this
    rank's logits."""
    from torchtitan.distributed import utils as dist_utils

    with dist_utils.get_spmd_context(parallel_dims=pd)():
        positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
        logits = _local(model(tokens, positions=positions, attention_masks=None))
        (logits.float().square().sum() / (logits.numel() * pd.tp)).backward()
    return logits.detach()


def _gather(t: torch.Tensor, full_shape, world: int) -> torch.Tensor:
    """The whole tensor from each rank's contiguous shard (along the dim whose size differs), or ``t`` if whole."""
    dims = [d for d, (a, b) in enumerate(zip(t.shape, full_shape)) if a != b]
    if not dims:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dims[0])


def _tp_dim(m: TitanNVFP4Linear) -> int | None:
    """The weight dim a TP layer's weight is sharded along (a DTensor's TP mesh dim is its last)."""
    if m.local_tp is not None:
        return m.local_tp[0]
    return getattr(getattr(m.weight, "placements", [None])[-1], "dim", None)


def _tp_worker(rank, world, out, backend, tmp_path, state, tokens, model_name="llama3",
               control=None, overrides=(), blocks=TP_BLOCKS, refresh=False):
    import torchtitan.distributed.parallel_dims as pd_module
    import torchtitan.models.llama3.parallelize as llama_parallelize

    torch.set_num_threads(1)
    import titan_nvfp4.autograd.grouped_function as gf
    import titan_nvfp4.autograd.linear_function as lf

    c = tp_config(world, backend, tmp_path, model_name, *overrides)
    if backend == "spmd_types":  # two upstream gaps on this torch, the BF16 model's too: fully_shard refuses
        # spmd_types's plain TP shards (at dp 1 it would only set the fp32 precision policy), and the fused wqkv's
        # param_init copies the whole fused weight into the local shard (the state below replaces it anyway)
        llama_parallelize.apply_fsdp_to_decoder = lambda *a, **k: None
        for _, cfg, _, _ in c.model_spec.model.traverse(FusedQKVLinear.Config):
            cfg.wqkv.param_init = None
    pd_module.device_type = "cpu"
    model, pd = build_on_ranks(c, world, blocks)
    experts = [m for m in model.modules() if isinstance(m, EXPERTS)]
    params = dict(model.named_parameters())
    with torch.no_grad():  # the one-process model's initial state, sliced as TorchTitan shards it
        for name, p in params.items():
            full, p_local = state[name], _local(p)
            dims = [d for d, (a, b) in enumerate(zip(p_local.shape, full.shape)) if a != b]
            p_local.copy_(full.chunk(world, dims[0])[rank] if dims else full)
    def whole_grads():
        grads = {n: _gather(_local(p.grad), state[n].shape, world) for n, p in params.items()}
        if backend == "spmd_types":  # the parameters typed R on the TP axis (the sequence-parallel norms' weights,
            for n in tp_replicated(model):  # low-rank factors beside a sharded weight) hold a partial gradient on
                dist.all_reduce(grads[n])  # each rank, which fully_shard would all-reduce
        return grads

    logits = tp_step(model, pd, tokens)
    grads = whole_grads()
    logits = _gather(logits, (*logits.shape[:-1], logits.shape[-1] * world), world)
    nvfp4 = {n: m for n, m in model.named_modules() if isinstance(m, TitanNVFP4Linear)}
    if rank == 0:
        out.update(logits=logits, grads=grads, layouts={n.split(".")[-1]: _tp_dim(m) for n, m in nvfp4.items()},
                   expert_groups=[sorted(m.tp_groups) for m in experts])
    if control:  # the same step again, the experts (control "experts") or every layer ("all") quantizing their
        model.zero_grad(set_to_none=True)  # shards with their own amaxes
        gf.all_reduce_max = lambda a, group: a
        if control == "all":
            lf.all_reduce_max = gf.all_reduce_max
        tp_step(model, pd, tokens)
        grads = whole_grads()
        if rank == 0:
            out["control_grads"] = grads
    first = next(iter(nvfp4.values()))
    out[f"counter{rank}"] = _local(first.sr_counter).clone()
    if refresh:  # lora_refresh_steps's re-split on the shards
        redecompose(model)
        state = {n: _gather(_local(p).detach(), state[n].shape, world) for n, p in model.named_parameters()}
        if rank == 0:
            out["refreshed"] = state


def tp_replicated(model) -> list[str]:
    """The parameters of ``model`` its sharding configs type R (replicated, gradient pending a sum) on the TP axis."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    names = []
    for mname, m in model.named_modules():
        sc = getattr(m, "_sharding_config", None)
        for pname, _ in m.named_parameters(recurse=False):
            layout = sc.state_shardings.get(pname) if sc is not None else None
            if layout is not None and layout.per_axis_spmd_types().get(MeshAxisName.TP) is spmd.R:
                names.append(f"{mname}.{pname}" if mname else pname)
    return names


_REFERENCES: dict = {}


def tp_reference_cached(model_name: str, tmp_path, overrides=(), blocks=TP_BLOCKS, copies: int = 1) -> SimpleNamespace:
    """_tp_reference, computed once per worker process for each set of arguments (tests only read it)."""
    key = (model_name, tuple(overrides), blocks, copies)
    if key not in _REFERENCES:
        _REFERENCES[key] = _tp_reference(model_name, tmp_path, overrides, blocks, copies)
    return _REFERENCES[key]


def _tp_reference(model_name: str, tmp_path, overrides=(), blocks=TP_BLOCKS, copies: int = 1) -> SimpleNamespace:
    """The one-process model (TP 1, its first ``blocks`` blocks): its initial state, tokens, logits and gradients
    (of a step on ``copies`` copies of the tokens: what ``copies`` data-parallel ranks given them see together)."""
    import torchtitan.distributed.parallel_dims as pd_module

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pd_module, "device_type", "cpu")
            torch.manual_seed(0)
            c = tp_config(1, "partial_dtensor", tmp_path, model_name, *overrides)
            model, pd = build_on_ranks(c, 1, blocks)
            state = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
            vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
            tokens = torch.randint(0, vocab, (BATCH, c.training.seq_len), generator=torch.Generator().manual_seed(1))
            logits = tp_step(model, pd, torch.cat([tokens] * copies))
            grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
            redecompose(model)  # a no-op without low-rank layers
            refreshed = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return SimpleNamespace(state=state, tokens=tokens, logits=logits, grads=grads, refreshed=refreshed)


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory):
    return _tp_reference("llama3", tmp_path_factory.mktemp("tp1"))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.long
def test_llama3_under_tensor_parallelism_matches_one_process(tp_reference, tmp_path):
    """llama3_debug_nvfp4 (2 blocks) at TP degree 2 through llama3's parallelize (TorchTitan's colwise wqkv, w1,
    w3 and rowwise wo, w2, sequence parallel) on 2 gloo ranks, from the one-process model's initial state: the
    logits and every gradient equal one process's up to fp32 summation order, as on 0.2 (the rowwise GEMMs sum 2
    partial products, colwise dX too, so an element can move across an NVFP4 rounding boundary). spmd_types (the
    default backend) hands the layers plain local shards (NVFP4Linear.local_tp); partial_dtensor's DTensors
    (NVFP4Linear's DTensor path) run the same NVFP4 GEMMs in the lora_rank test below, on both backends. Each rank
    quantizes with the whole operands' amaxes. The SR streams differ per rank. The control, the same step again with
    each rank's own shard amaxes (no all-reduce): the gradients move by NVFP4's rounding error, far above the
    tolerance."""
    ref = tp_reference
    out = run_ranks(_tp_worker, 2, "spmd_types", tmp_path, ref.state, ref.tokens, "llama3", "all",
                    preload=PRELOAD_V03)
    assert out["layouts"] == {"wqkv": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0}  # colwise 0, rowwise 1
    # measured on both backends: 3.3e-8 on the logits; on the gradients at most 1.3e-3 (layer 1's w3: an element
    # across a rounding boundary), 16 of 17 not bit-equal; the control moves them by 0.17
    assert _rel(out["logits"], ref.logits) < 1e-6
    assert out["grads"].keys() == ref.grads.keys()
    for name, g in ref.grads.items():
        assert _rel(out["grads"][name], g) < 2e-3, name
    assert int(out["counter0"][0]) != int(out["counter1"][0])  # a stochastic-rounding stream per rank
    worst = max(_rel(out["control_grads"][n], g) for n, g in ref.grads.items() if "layers." in n)
    assert worst > 1e-2, worst


@pytest.mark.long
@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_lora_rank_under_tensor_parallelism_matches_one_process(tmp_path, backend):
    """lora_rank 16 at TP degree 2 (llama3, 2 blocks, 2 gloo ranks), from the one-process model's initial state
    (factors and R included): U sharded like a colwise W, V like a rowwise one, σ and the other factor whole, as
    TorchTitan's own LoRA adapters. The logits and every gradient (the whole factors' summed over the ranks on
    spmd_types, as fully_shard would) equal one process's up to fp32 summation order, as the plain NVFP4 layers
    do (R runs through the same NVFP4 Linear path, local shards or DTensors). The re-split on the shards (gathered,
    split, sliced) gives one process's split: σ and R within 1e-5, U·diag(σ)·V within 1e-5."""
    extra = ("--quantize.linear.lora_rank", "16")
    ref = tp_reference_cached("llama3", tmp_path / "one", overrides=extra)
    out = run_ranks(_tp_worker, 2, backend, tmp_path, ref.state, ref.tokens, "llama3", None, extra, TP_BLOCKS, True,
                    preload=PRELOAD_V03)
    assert out["layouts"] == {"wqkv": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0}
    assert sum(n.endswith("lora_u") for n in ref.grads) == 10
    assert _rel(out["logits"], ref.logits) < 1e-6
    assert out["grads"].keys() == ref.grads.keys()
    for name, g in ref.grads.items():
        assert _rel(out["grads"][name], g) < 2e-3, name
    for name, w in ref.refreshed.items():
        if "lora_u" in name:
            prefix = name[: -len("u")]
            tp, one = (((f[prefix + "u"] * f[prefix + "sigma"]) @ f[prefix + "v"]) for f in (out["refreshed"], ref.refreshed))
            assert _rel(tp, one) < 1e-5, name
        elif "lora_v" not in name:
            assert _rel(out["refreshed"][name], w) < 1e-5, name
    assert not torch.equal(out["counter0"][:, 0], out["counter1"][:, 0])  # SR streams per rank (a row per GEMM)


@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_lora_nvfp4_under_tensor_parallelism_is_refused(tmp_path, backend):
    """An NVFP4 branch under tensor parallelism stops at parallelize, naming the knob and the Linear (measured on
    partial_dtensor: its gradients 1% away from one process's; on spmd_types it would quantize partial sums)."""
    c = tp_config(2, backend, tmp_path, "llama3", "--quantize.linear.lora_rank", "16", "--quantize.linear.lora_nvfp4")
    c.model_spec.model.update_from_config(config=c)
    with torch.device("meta"):
        wo = c.model_spec.model.layers[0].attention.wo.build()
    with pytest.raises(NotImplementedError, match=r"\[quantize.linear\] lora_nvfp4 = true: Linear "
                                                  "'layers.0.attention.wo' is tensor-parallel"):
        wo.parallelize(SimpleNamespace(tp_enabled=True, spmd_backend=backend))


@pytest.mark.long
def test_deepseek_v3_experts_under_tensor_parallelism_match_one_process(tmp_path):
    """deepseek_v3_debug_nvfp4's dense block and first MoE block at TP degree 2 through its parallelize
    (partial_dtensor): the routed experts' hidden dim sharded (W1, W3 colwise, W2 rowwise, per-expert amaxes
    all-reduced), MLA's Linears and the shared experts as in llama3: logits and every gradient equal one
    process's up to fp32 summation order. The control: the experts' own shard amaxes move their gradients."""
    ref = _tp_reference("deepseek_v3", tmp_path / "ref")
    out = run_ranks(_tp_worker, 2, "partial_dtensor", tmp_path, ref.state, ref.tokens, "deepseek_v3", "experts",
                    preload=PRELOAD_V03)
    assert out["expert_groups"] == [["w1_EFD", "w2_EDF", "w3_EFD"]]
    assert out["layouts"] == {"wq": 0, "wkv_a": None, "wkv_b": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0}
    # measured: 6.5e-8 on the logits, at most 5.4e-7 on a gradient
    assert _rel(out["logits"], ref.logits) < 1e-6
    for name, g in ref.grads.items():
        assert _rel(out["grads"][name], g) < 1e-5, name
    experts = [n for n in ref.grads if "routed_experts" in n]
    assert len(experts) == 3 and min(_rel(out["control_grads"][n], ref.grads[n]) for n in experts) > 1e-2


@pytest.mark.long
@pytest.mark.slow(reason="17 s on 2 cores; deepseek_v3's experts under TP in CI")
def test_gpt_oss_experts_under_tensor_parallelism_match_one_process(tmp_path):
    """gpt_oss_debug_nvfp4's first block at TP degree 2 through its parallelize (partial_dtensor): each expert's mlp1
    colwise (its bias with it), mlp2 rowwise with the bias added as b2 / 2 on each rank (TorchTitan's
    ScaleBiasForward), per-expert amaxes all-reduced: the logits and every gradient equal one process's up to fp32
    summation order (measured: 3e-7 on the logits; the gradients at most 2.0e-4, mlp2's weight, where an ulp of dY
    crosses an NVFP4 rounding boundary). The control (each rank's own shard amaxes) moves every expert gradient by
    6% to 12%."""
    keep = ("--quantize.linear.filter_fqns", "lm_head,router.gate,wo")  # wo: a rowwise Linear with a bias (refused)
    ref = _tp_reference("gpt_oss", tmp_path / "ref", keep, 1)
    out = run_ranks(_tp_worker, 2, "partial_dtensor", tmp_path, ref.state, ref.tokens, "gpt_oss", "experts", keep, 1,
                    preload=PRELOAD_V03)
    assert out["expert_groups"] == [["mlp1_weight_EGD", "mlp2_weight_EDF"]]
    assert _rel(out["logits"], ref.logits) < 1e-6
    experts = [n for n in ref.grads if "routed_experts" in n]
    for name, g in ref.grads.items():
        if name.endswith("attention.wo.bias"):  # TorchTitan's own BF16 module, half of one process's in this
            continue                            # harness (its rowwise bias gradient; upstream's, not ours)
        assert _rel(out["grads"][name], g) < 1e-3, name
    assert len(experts) == 4 and min(_rel(out["control_grads"][n], ref.grads[n]) for n in experts) > 5e-2


def _ep_worker(rank, world, out, model_name, blocks, tmp_path, state, tokens, tp=1):
    import torchtitan.distributed.parallel_dims as pd_module

    torch.set_num_threads(1)
    pd_module.device_type = "cpu"
    c = tp_config(tp, "partial_dtensor", tmp_path, model_name, "--parallelism.expert_parallel_degree", str(world // tp))
    model, pd = build_on_ranks(c, world, blocks)
    for m in model.modules():  # gloo has no PREMUL_SUM: FSDP2 sums the ranks' gradients
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    params = dict(model.named_parameters())
    with torch.no_grad():  # the one-process model's initial state, this rank's experts and FSDP shards
        for name, p in params.items():
            full, p_local = state[name], _local(p)
            p_local.copy_(_local(torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
                          if hasattr(p, "placements") else full)
    logits = tp_step(model, pd, tokens)  # the whole logits' mean square
    if tp > 1:  # the LM head's vocab shards, over this rank's TP group
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=pd.get_mesh("tp").get_group())
        logits = torch.cat(parts, -1)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in params.items()}
    if rank == 0:
        experts = [m for m in model.modules() if isinstance(m, EXPERTS)]
        out.update(logits=logits, grads=grads, local_experts=[_local(getattr(m, m.GEMMS[0])).shape[0] for m in experts],
                   expert_shapes=[tuple(_local(getattr(m, m.GEMMS[0])).shape) for m in experts],
                   expert_groups=[sorted(m.tp_groups) for m in experts])


@pytest.mark.long
@pytest.mark.parametrize("model_name, blocks", [("deepseek_v3", 2), ("gpt_oss", 1)])
def test_experts_under_expert_parallelism_match_one_process(tmp_path, model_name, blocks):
    """EP = 2 through the model's own parallelize (partial_dtensor; FSDP2 2 over the dense part) on 2 gloo ranks:
    each rank holds half the experts whole, so each expert's tensor amaxes are its own weight's and those of all
    the tokens routed to it, from both ranks. Both ranks get the same batch, so each expert sees two copies of its
    tokens, rank 0's first: what one process sees with the batch doubled. The logits equal it, and so do the
    gradients (summed over the ranks: halved), the experts' bit for bit."""
    ref = tp_reference_cached(model_name, tmp_path / "ref", (), blocks, copies=2)
    out = run_ranks(_ep_worker, 2, model_name, blocks, tmp_path, ref.state, ref.tokens, preload=PRELOAD_V03)
    experts = [n for n in ref.grads if "routed_experts" in n]
    assert out["local_experts"] == [4] and experts  # one MoE block: 8 experts, 4 per rank
    assert torch.equal(out["logits"], ref.logits[:BATCH])  # measured: equal
    for name, g in ref.grads.items():
        if name in experts:
            assert torch.equal(out["grads"][name] / 2, g), name
        else:  # measured: at most 2e-7 (FSDP2's summation order)
            assert _rel(out["grads"][name] / 2, g) < 1e-6, name


@pytest.mark.long
@pytest.mark.slow(reason="4 ranks, 27 s on 2 cores; EP and TP each run in CI")
def test_experts_under_expert_and_tensor_parallelism(tmp_path):
    """EP 2 × TP 2 on 4 gloo ranks (deepseek_v3's first 2 blocks, partial_dtensor, sequence parallel): TorchTitan 0.3
    spreads the 8 experts over all 4 ranks, each rank holding 2 whole experts (no TP groups: every expert's scales
    are its own whole weight's and its routed tokens'). The logits equal one process's with the batch doubled, and
    so does every gradient outside the experts (they read the experts' dX: within fp32 summation order). The
    experts' own weight gradients come out 15-16% apart (measured), which we attribute to their 16-token blocks:
    wgrad quantizes dY and X along the tokens, and under sequence parallelism each TP rank routes half of every
    sequence, so each expert gets its tokens in another order than one process and its blocks hold other tokens.
    A gradient off by a factor 2 would be 50-100% apart."""
    ref = tp_reference_cached("deepseek_v3", tmp_path / "ref", (), 2, copies=2)
    out = run_ranks(_ep_worker, 4, "deepseek_v3", 2, tmp_path, ref.state, ref.tokens, 2, preload=PRELOAD_V03)
    assert out["expert_shapes"] == [(2, 256, 256)] and out["expert_groups"] == [[]]
    assert _rel(out["logits"], ref.logits[:BATCH]) < 1e-6  # measured 7.9e-8
    experts = [n for n in ref.grads if "routed_experts" in n]
    assert len(experts) == 3
    for name, g in ref.grads.items():
        bound = 0.25 if name in experts else 2e-6  # measured 0.16, and at most 5.7e-7
        assert _rel(out["grads"][name] / 2, g) < bound, name


def _debug_step_model(monkeypatch, tmp_path, *overrides, blocks=2):
    """llama3_debug_nvfp4's first ``blocks`` blocks (reference backend) built through its parallelize_fn, and a
    training step: forward, loss, backward on fixed tokens; returns (config, model, step)."""
    torch.manual_seed(0)
    c = parse("llama3_debug_nvfp4", "--quantize.linear.gemm_backend", "reference", "--training.seq_len", str(SEQ),
              "--training.local_batch_size", str(BATCH), "--dump_folder", str(tmp_path), *overrides)
    apply_quantize(c)
    model = build_parallelized(c, monkeypatch, blocks=blocks)
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad()
        out = model(tokens, positions=torch.arange(SEQ).repeat(BATCH, 1), attention_masks=None)
        torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return c, model, step


def test_late_switch_and_amax_windows_follow_the_optimizer_steps(gloo_rank, monkeypatch, tmp_path):
    """bf16_after_fraction and activation_amax_history on 0.3: the step hook pushes each NVFP4 step's amaxes into the
    windows and switches every NVFP4 Linear to high precision after step 2 of 4 (no SR draws, no amaxes after it)."""
    c, model, step = _debug_step_model(monkeypatch, tmp_path, "--quantize.linear.bf16_after_fraction", "0.5",
                                       "--quantize.linear.activation_amax_history", "4")
    sections = attach_sections([model], c.quantize, total_steps=4)
    counters = sections[0].counters
    assert len(counters) == 1 and getattr(model, LINEAR_STEPS) is counters[0]
    linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt.register_step_post_hook(lambda *a, **k: after_optimizer_step([model], sections))
    assert all(not m.x_amax_history.any() for m in linears)
    for i in range(3):
        step()
        opt.step()
        # the step's amaxes enter the window, newest first; a step run in high precision records none
        assert [bool(m.x_amax_history[0].gt(0).all()) for m in linears] == [i < 2] * len(linears), i
        assert [m.high_precision for m in linears] == [i >= 1] * len(linears), i
    assert all(m.x_amax_history[1:3].gt(0).all() and not m.x_amax_history[3].any() for m in linears)
    assert all(m.sr_calls == 2 for m in linears)  # the third backward ran in high precision: no SR call


def test_forward_scope_switches_the_forward_alone(gloo_rank, monkeypatch, tmp_path):
    """bf16_after_scope = "forward" on 0.3, through the same core as 0.2 (no integration code of its own): after step 1
    of 2 the Linears' forward runs in high precision while their backward keeps drawing its stochastic rounding."""
    c, model, step = _debug_step_model(monkeypatch, tmp_path, "--quantize.linear.bf16_after_fraction", "0.5",
                                       "--quantize.linear.bf16_after_scope", "forward")
    sections = attach_sections([model], c.quantize, total_steps=2)
    linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
    for i in range(2):
        step()
        after_optimizer_step([model], sections)
    assert all(m.high_precision_forward and not m.high_precision for m in linears)
    assert all(m.sr_calls == 2 for m in linears)  # the second backward ran after the switch and still drew


def test_outcontrol_selects_each_linears_channels_through_the_core(gloo_rank, monkeypatch, tmp_path):
    """outcontrol_fraction on 0.3, through the same core as 0.2: the window sums the forward of step 1, every Linear
    selects after it (replicated buffers, declared for 0.3's sharding configs), and step 2 trains on the split."""
    c, model, step = _debug_step_model(monkeypatch, tmp_path, "--quantize.linear.outcontrol_fraction", "0.1",
                                       "--quantize.linear.outcontrol_start", "0", "--quantize.linear.outcontrol_steps",
                                       "1")
    sections = attach_sections([model], c.quantize, total_steps=2)
    linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
    assert linears and all(m.outcontrol.recording and not m._outcontrol_on for m in linears)
    step()
    after_optimizer_step([model], sections)
    assert all(m._outcontrol_on and m.outcontrol_index.shape[0] % 32 == 0 for m in linears)
    grads = step()
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_the_new_presets_run_through_the_03_configs(gloo_rank, monkeypatch, tmp_path):
    """recipe = quartet2 (MS-EDEN backward) and tetrajet2 (OutControl, OsciReset) on 0.3: the config registry's
    fields carry the presets to every Linear, which trains a step (bad values: test_bad_knob_stops_the_parse_naming_it)."""
    for preset, extra in (("quartet2", ("--quantize.linear.rht_size", "32")),
                          ("tetrajet2", ("--quantize.linear.outcontrol_start", "0"))):
        c, model, step = _debug_step_model(monkeypatch, tmp_path, "--quantize.linear.recipe", preset, *extra)
        linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
        if preset == "quartet2":
            assert linears and all(m.recipe.ms_eden and m.recipe.rht_size == 32 for m in linears)
        else:
            assert all(m.recipe.osci_reset_every == 200 and m.recipe.outcontrol_fraction == 0.1 for m in linears)
        grads = step()
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
        assert all(m.sr_calls == 1 for m in linears)


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_experts_switch_to_torchtitans_own_experts_after_the_fraction(kind):
    """The experts' bf16_after_fraction on 0.3: the optimizer step hook switches them after step 1 of 2; then they
    compute what TorchTitan's own module computes on the same weights (its grouped GEMMs, exactly) and draw no
    stochastic-rounding numbers."""
    upstream, names = EXPERT_KINDS[kind]
    section = NVFP4GroupedMMConfigConverter.Config(gemm_backend="reference", bf16_after_fraction=0.5)
    torch.manual_seed(0)
    m = build_experts(upstream, names, bf16_after_fraction=0.5)
    part = torch.nn.Module()
    part.add_module("experts", m)
    steps = SectionSteps(section, 2, logging.getLogger("test"))
    assert len(steps.attach([part], [[m]])) == 1
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), D)
    outs = []
    for _ in range(2):
        outs.append(m(x, counts))
        outs[-1].square().sum().backward()
        after_optimizer_step([part], [steps])  # as the optimizer's step post hook
    assert m.high_precision and bool((m.sr_counter[:, 1] == 1).all())  # the second step drew nothing
    plain = upstream.__new__(upstream)
    plain.__dict__.update(m.__dict__)  # the same parameters in TorchTitan's own module
    assert torch.equal(m(x, counts), upstream.forward(plain, x, counts))
    assert not torch.equal(outs[0], upstream.forward(plain, x, counts))  # NVFP4 before the switch


def test_linear_telemetry_measures_the_steps_it_names(gloo_rank, monkeypatch, tmp_path):
    """telemetry_every on 0.3: the Linears' step counter picks steps 1 and every 2nd, each measured step leaves W's,
    X's and dY's statistics per layer for the next metrics log (TorchTitan 0.3's MetricsProcessor.log adds them),
    an unmeasured step none."""
    from torchtitan.components.metrics import MetricsProcessor

    from titan_nvfp4.modules.telemetry import drain_all

    c, model, step = _debug_step_model(monkeypatch, tmp_path, "--quantize.linear.telemetry_every", "2")
    sections = attach_sections([model], c.quantize, total_steps=4)
    counters = sections[0].counters
    assert len(counters) == 1 and getattr(MetricsProcessor.log, "_nvfp4_telemetry", False)
    linears = [m for m in model.modules() if isinstance(m, TitanNVFP4Linear)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt.register_step_post_hook(lambda *a, **k: after_optimizer_step([model], sections))
    drain_all()
    measured = []
    for _ in range(3):
        step()
        opt.step()
        measured.append(drain_all())
    assert [bool(m) for m in measured] == [True, True, False]  # steps 1 and 2 (every 2nd), not 3
    keys = {k.rsplit("/", 2)[0] for k in measured[0]}
    assert keys == {f"nvfp4/{m.layer_name}" for m in linears}
    assert {k.split("/")[-2] for k in measured[0]} == {"weight", "input", "grad_output"}
    assert not any(m.high_precision for m in linears)  # counted, never switched


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_expert_telemetry_measures_every_grouped_gemm_and_changes_no_bit(kind):
    """The experts' telemetry on 0.3: a measured step records each grouped GEMM's weight (per expert), routed tokens
    and dY, and computes the same bits as an unmeasured one (the SwiGLU experts then run W1 and W3 unfused)."""
    from titan_nvfp4.modules.telemetry import Telemetry, drain_all

    upstream, names = EXPERT_KINDS[kind]
    torch.manual_seed(0)
    m = build_experts(upstream, names, stochastic_rounding=False)
    counts = torch.tensor(COUNTS)
    x, dy = torch.randn(sum(COUNTS), D), torch.randn(sum(COUNTS), D)
    runs = []
    for measured in (False, True):
        m.telemetry = Telemetry(1) if measured else None
        drain_all()
        m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = m(xg, counts)
        y.backward(dy)
        runs.append(([y.detach(), xg.grad, *(getattr(m, n).grad for n in names)], drain_all()))
    (plain, none), (measured, stats) = runs
    assert not none and all(torch.equal(a, b) for a, b in zip(plain, measured))
    assert {k.rsplit("/", 2)[0] for k in stats} == {f"nvfp4/{m.layer_name}/{g}" for g in m.GEMMS}
    assert {k.split("/")[-2] for k in stats} == {"weight", "input", "grad_output"}
    assert all(f"nvfp4/{m.layer_name}/{g}/weight/snr_db_worst_expert" in stats for g in m.GEMMS)


def test_train_state_resumes_the_sr_streams_bitwise(gloo_rank, monkeypatch, tmp_path):
    """DCP on NVFP4Trainer's train_state: a model resumed from step 2 (weights and train_state) computes the
    uninterrupted run's third-step gradients bit for bit; without the SR counts (the control) they differ."""
    import torch.distributed.checkpoint as dcp

    def shell(model, step=0):  # NVFP4Trainer as far as its checkpoint is concerned
        t = NVFP4Trainer.__new__(NVFP4Trainer)
        t.model_parts, t.step, t.ntokens_seen = [model], step, 0
        return t

    _, a, step_a = _debug_step_model(monkeypatch, tmp_path)
    step_a(), step_a()
    sd = shell(a, 2).state_dict()
    assert sd["step"] == 2 and len(sd["nvfp4_sr_calls"]) == 10 and all(int(v[0]) == 2 for v in sd["nvfp4_sr_calls"].values())
    dcp.save({"train_state": shell(a, 2), "model": a.state_dict()}, checkpoint_id=str(tmp_path / "step-2"))
    want = step_a()

    _, b, step_b = _debug_step_model(monkeypatch, tmp_path)
    trainer = shell(b)
    state = {"train_state": trainer, "model": b.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-2"))
    b.load_state_dict(state["model"])
    assert trainer.step == 2
    assert all(torch.equal(g, w) for g, w in zip(step_b(), want, strict=True))

    _, ctrl, step_c = _debug_step_model(monkeypatch, tmp_path)
    ctrl_state = {"model": ctrl.state_dict()}
    dcp.load(ctrl_state, checkpoint_id=str(tmp_path / "step-2"))
    ctrl.load_state_dict(ctrl_state["model"])
    assert not all(torch.equal(g, w) for g, w in zip(step_c(), want, strict=True))


def _train_03(dump: Path, assets: Path, steps: int, *overrides: str) -> str:
    """``-m torchtitan.train --module ... --config llama3_debug_nvfp4`` as one torchrun process on the CPU
    (tests/cpu_train03.py; the model's first 2 blocks), a short job checkpointing every step (full checkpoints: model, optimizer, train_state, dataloader); its log."""
    import subprocess
    import sys

    import socket

    with socket.socket() as sock:  # torchrun's environment for one process, without its start-up
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, str(Path(__file__).with_name("cpu_train03.py")), "--module", MODULE, "--config", "llama3_debug_nvfp4",
           "--training.steps", str(steps), "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.no-last_save_model_only",
           "--metrics.log_freq", "1", "--dump_folder", str(dump), *overrides]
    env = {**os.environ, "TITAN_NVFP4_DATA_DIR": str(assets), "OMP_NUM_THREADS": "1", "CPU_TRAIN03_BLOCKS": "2",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return log


def _dcp_flat(path: Path) -> dict:
    """A DCP checkpoint as {dotted key: value}, pickled entries (the dataloader's state) unpickled."""
    import pickle

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path) + ".pt")
    out = {}

    def walk(v, key):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, bytes):
            out[key] = pickle.loads(v)
        else:
            out[key] = v

    walk(torch.load(str(path) + ".pt", weights_only=False), "")
    return out


@pytest.mark.long
@pytest.mark.slow(reason="two TorchTitan jobs, 48 s on 2 cores; test_train_state_resumes_the_sr_streams_bitwise in CI")
def test_nvfp4_trainer_resumed_from_a_checkpoint_repeats_the_run(tmp_path):
    """The whole NVFP4Trainer through TorchTitan 0.3's entry point on the CPU (llama3_debug_nvfp4's first 2 blocks with SR, a low-rank
    branch refreshed every 2 steps and 2-step amax windows, on a small offline corpus): 3 steps checkpointing every
    step, then a second job started from the step-1 checkpoint. The resumed job logs the same losses for steps 2 and
    3 and writes the same step-3 checkpoint, every tensor bit for bit (weights, factors, AdamW moments, the SR call
    counts, the amax windows), and a dataloader state that continues the same token stream. On torch 2.13 this also needs NVFP4Trainer's
    provide_set_timeout (TorchTitan 0.3.0 calls a torch.distributed.set_timeout that torch 2.13 lacks)."""
    import itertools
    import shutil

    from titan_nvfp4.data.assets import recipe, write_assets
    from titan_nvfp4.data.corpus import Corpus, iter_stdlib_sources

    docs = [text for _, text in itertools.islice(iter_stdlib_sources(), 80)]
    write_assets(tmp_path / "assets", Corpus(train=docs[:70], validation=docs[70:]), recipe())
    extra = (*LORA, "--quantize.linear.lora_refresh_steps", "2", "--quantize.linear.activation_amax_history", "2")
    full = _train_03(tmp_path / "full", tmp_path / "assets", 3, *extra)
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-1", tmp_path / "resumed" / "checkpoint" / "step-1")
    resumed = _train_03(tmp_path / "resumed", tmp_path / "assets", 3, *extra)
    assert "Training starts at step 2" in resumed and "re-decomposed 10 low-rank modules after optimizer step 2" in resumed

    def losses(log):
        return dict(re.findall(r"step:\s+(\d+)\s+\S*loss:\s+([\d.]+)", log))

    assert len(losses(full)) == 3 and {k: v for k, v in losses(full).items() if k != "1"} == losses(resumed)
    a, b = (_dcp_flat(tmp_path / d / "checkpoint" / "step-3") for d in ("full", "resumed"))
    assert a.keys() == b.keys()
    loader = "dataloader.dp_rank_0"
    for k, v in a.items():
        if k != loader:
            assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k
    # TorchTitan's text dataset reads the next document into its token buffer as soon as it resumes, the
    # uninterrupted run only once the buffer runs short: the same token stream, the resumed run buffered further
    da, db = a[loader]["dataset_state"], b[loader]["dataset_state"]
    assert db["sample_idx"] >= da["sample_idx"]
    for buf in ("inputs_buffer", "labels_buffer", "positions_buffer"):
        assert db[buf][: len(da[buf])] == da[buf], buf
    sr = {k: int(v[0]) for k, v in a.items() if ".nvfp4_sr_calls." in k}
    assert len(sr) == 10 and set(sr.values()) == {3}
    assert sum(".nvfp4_amax_history." in k for k in a) > 0 and sum(k.endswith("lora_u") for k in a) == 10


# ------------------------------------------------------------------------------------------- DecomposedLinear

LORA = ("--quantize.linear.lora_rank", "16")
FACTORS = ("lora_u", "lora_sigma", "lora_v", "weight")


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_lora_rank_splits_each_initialized_weight_as_the_02_module(gloo_rank, monkeypatch, tmp_path):
    """lora_rank on 0.3: every block Linear config becomes a TitanDecomposedLinear (the LM head stays BF16), and after
    TorchTitan's init_states each holds the split DecomposedLinear.from_linear makes of the weight the NVFP4 twin
    (same seed) initialized: U, σ, V and R bit for bit, R + U·diag(σ)·V within fp32 rounding of W. The checkpoint
    keys are the twin's plus the factors'."""
    lora, plain = (parse("llama3_debug_nvfp4", "--quantize.linear.gemm_backend", "reference", *extra)
                   for extra in (LORA, ()))
    apply_quantize(lora)
    assert set(block_linears(lora.model_spec.model).values()) == {TitanDecomposedLinear.Config}
    assert type(lora.model_spec.model.lm_head) is Linear.Config
    apply_quantize(plain)
    models = []
    for c in (lora, plain):
        torch.manual_seed(0)
        models.append(build_parallelized(c, monkeypatch, blocks=1))
    twin = dict(models[1].named_modules())
    decomposed = {n: m for n, m in models[0].named_modules() if isinstance(m, TitanDecomposedLinear)}
    assert len(decomposed) == 5 and all(m.rank == 16 and m._lora_ready for m in decomposed.values())
    for name, m in decomposed.items():
        w = _full(twin[name].weight).detach()
        linear = torch.nn.Linear(m.in_features, m.out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(w)
        ref = DecomposedLinear.from_linear(linear, m.recipe, m.layer_id, name, rank=16)
        for f in FACTORS:
            assert torch.equal(_full(getattr(m, f)).detach(), getattr(ref, f).detach()), (name, f)
        assert torch.allclose(m.dense_weight().detach(), w, rtol=0, atol=1e-6), name
    extra = {k for k in models[0].state_dict() if "lora_" in k}
    assert set(models[0].state_dict()) - extra == set(models[1].state_dict())
    assert len(extra) == 5 * 5  # lora_u, lora_sigma, lora_v, lora_residual, lora_decomposed


def test_lora_knobs_reach_every_linear_and_a_rank_that_does_not_fit_is_refused():
    """lora_rank and lora_nvfp4 reach every converted Linear's config; a lora_rank above a Linear's smaller dim stops
    the conversion, naming the key and the Linear (0.2's words)."""
    c = parse("llama3_debug_nvfp4", "--quantize.linear.lora_rank", "512")
    with pytest.raises(ValueError, match=r"\[quantize.linear\] lora_rank 512 does not fit Linear "
                                         r"'layers.0.attention.qkv_linear.wqkv' \(768x256\)"):
        apply_quantize(c)
    c = parse("llama3_debug_nvfp4", "--quantize.linear.lora_rank", "32", "--quantize.linear.lora_nvfp4")
    apply_quantize(c)
    configs = [cfg for _, cfg, _, _ in c.model_spec.model.traverse(TitanDecomposedLinear.Config)]
    assert len(configs) == 30 and {(cfg.lora_rank, cfg.lora_nvfp4) for cfg in configs} == {(32, True)}


def test_lora_factors_train_refresh_and_resume(gloo_rank, monkeypatch, tmp_path):
    """The factors are parameters of TorchTitan's optimizer and an AdamW step moves them; the trainer's step hook
    re-splits W after step 2 of lora_refresh_steps = 2 (σ then the top singular values of W, R + U·diag(σ)·V still
    W), not after step 1. A DCP round trip through TorchTitan's ModelWrapper into a fresh model brings R, U, σ and V
    back bit for bit, and saves the full W under ``weight``."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    overrides = (*LORA, "--quantize.linear.lora_refresh_steps", "2")
    c, model, step = _debug_step_model(monkeypatch, tmp_path, *overrides, blocks=1)
    assert c.quantize.linear.lora_refresh_steps == 2
    sections = attach_sections([model], c.quantize, total_steps=4)
    opt = c.optimizer.build(model_parts=[model])
    opt.register_step_post_hook(lambda *a, **k: after_optimizer_step([model], sections))
    mods = [m for m in model.modules() if isinstance(m, TitanDecomposedLinear)]
    trained = {id(p) for g in opt.optimizers[0].param_groups for p in g["params"]}
    assert all(id(getattr(m, f)) in trained for m in mods for f in FACTORS)
    m = model.layers["0"].feed_forward.w2

    def singular_values():
        return torch.linalg.svdvals(m.dense_weight().detach())[:16]

    for i in range(2):
        before = {f: _full(getattr(m, f)).detach().clone() for f in FACTORS}
        step()
        opt.step()
        assert all(not torch.equal(_full(getattr(m, f)).detach(), before[f]) for f in FACTORS), i
        refreshed = torch.allclose(_full(m.lora_sigma).detach(), singular_values(), rtol=0, atol=1e-5)
        assert refreshed == (i == 1), i

    saved = ModelWrapper([model]).state_dict()
    key = next(k for k in saved if k.endswith("feed_forward.w2.weight"))
    assert torch.equal(_full(saved[key]), m.dense_weight().to(saved[key].dtype))  # the full W
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"))
    torch.manual_seed(1)  # another initialization
    fresh = build_parallelized(c, monkeypatch, blocks=1)
    wrapper = ModelWrapper([fresh])
    state = wrapper.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    wrapper.load_state_dict(state)
    mine = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(_full(p), _full(mine[name])), name



# ------------------------------------------------------------------------------------------- experts' lora_rank

GROUPED_LORA = ("--quantize.grouped_mm.lora_rank", "16")


def split_02(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """{parameter name: value} that 0.2's expert modules hold after converting materialized experts with these
    ``weights`` and ``rank`` (their convert runs the core's LowRankExperts: factors, then decompose_)."""
    cls = type("Experts02", (LowRankExperts, torch.nn.Module), {"GEMMS": tuple(weights)})
    m = cls()
    for g, w in weights.items():
        m.register_parameter(g, torch.nn.Parameter(w.detach().clone()))
    m._init_lowrank_experts(rank)
    m.decompose_()
    return {n: p.detach() for n, p in m.named_parameters()}


def _moe_model(monkeypatch, tmp_path, *overrides):
    """deepseek_v3_debug_nvfp4's first 2 blocks (a dense and a MoE block) with only the routed experts in NVFP4
    (reference backend) and no activation checkpointing, built through its parallelize_fn; returns (config, model)."""
    torch.manual_seed(0)
    c = parse("deepseek_v3_debug_nvfp4", "--quantize.linear.no-enable", "--quantize.grouped_mm.gemm_backend",
              "reference", "--training.seq_len", str(SEQ // 2), "--training.local_batch_size", str(BATCH),
              "--dump_folder", str(tmp_path), *overrides)
    apply_quantize(c)
    c.activation_checkpoint = None
    return c, build_parallelized(c, monkeypatch, blocks=2)


def test_grouped_lora_rank_splits_the_deepseek_v3_experts_as_02_and_trains(gloo_rank, monkeypatch, tmp_path):
    """quantize.grouped_mm.lora_rank on 0.3: every routed-expert config gets the rank, and after init_states the
    experts hold the split 0.2's module makes of the weights the NVFP4 twin (same seed) initialized, bit for bit,
    R + U·diag(σ)·V within fp32 rounding of W; the state dict is the twin's plus the factors, the residuals and
    the flag. TorchTitan's optimizer holds the factors and an AdamW step moves every one of them."""
    _, plain = _moe_model(monkeypatch, tmp_path)
    c, model = _moe_model(monkeypatch, tmp_path, *GROUPED_LORA)
    assert {cfg.lora_rank for cfg in expert_configs(c.model_spec.model).values()} == {16}
    twin = dict(plain.named_modules())
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TitanNVFP4GroupedExperts)}
    assert len(experts) == 1 and all(m.lora_rank == 16 and m._lora_ready for m in experts.values())
    name, m = next(iter(experts.items()))
    full = {g: _full(getattr(twin[name], g)).detach() for g in m.GEMMS}
    want = split_02(full, 16)
    for n, p in m.named_parameters():
        assert torch.equal(_full(p).detach(), want[n]), n
    for g, w in m.dense_weights().items():
        assert torch.allclose(w, full[g], rtol=0, atol=1e-6), g
    extra = {k for k in model.state_dict() if "lora_" in k}
    assert set(model.state_dict()) - extra == set(plain.state_dict())
    assert len(extra) == 3 * 4 + 1  # u, sigma, v, residual per weight; lora_decomposed

    opt = c.optimizer.build(model_parts=[model])
    factors = [n for n, _ in m.named_parameters() if "_lora_" in n]
    assert {id(getattr(m, n)) for n in factors} <= {id(p) for g in opt.optimizers[0].param_groups for p in g["params"]}
    before = {n: _full(getattr(m, n)).detach().clone() for n in factors}
    vocab = next(e for e in model.modules() if isinstance(e, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (BATCH, SEQ // 2), generator=torch.Generator().manual_seed(1))
    out = model(tokens, positions=torch.arange(SEQ // 2).repeat(BATCH, 1), attention_masks=None)
    torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    assert all(not torch.equal(_full(getattr(m, n)).detach(), before[n]) for n in factors)


def test_grouped_lora_refresh_follows_the_linear_sections_steps():
    """As on 0.2, the Linears' lora_refresh_steps re-splits the experts too: the trainer's step hook re-decomposes
    them after step 2 of lora_refresh_steps = 2 (σ then the top singular values of each expert's W), not after 1."""
    from titan_nvfp4.integration_v03.converter import NVFP4LinearConfigConverter

    torch.manual_seed(0)
    m = build_experts(*EXPERT_KINDS["swiglu"], lora_rank=16)
    part = torch.nn.Module()
    part.add_module("experts", m)
    section = NVFP4LinearConfigConverter.Config(lora_rank=16, lora_refresh_steps=2)
    steps = SectionSteps(section, 4, logging.getLogger("test"))
    steps.attach([part], [[]])  # the Linears' section of a part with no Linear: its counter drives the refresh
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)
    opt.register_step_post_hook(lambda *a, **k: after_optimizer_step([part], [steps]))
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), D)

    def resplit() -> bool:
        return all(torch.allclose(getattr(m, f"{g}_lora_sigma").detach(), torch.linalg.svdvals(w)[:, :16], rtol=0,
                                  atol=1e-5) for g, w in m.dense_weights().items())

    for i in range(2):
        opt.zero_grad()
        m(x, counts).square().sum().backward()
        opt.step()
        assert resplit() == (i == 1), i


def test_lora_dtype_reaches_the_experts_branch():
    """The dense section's lora_dtype = "float32" reaches the experts' branches (as on 0.2), and under BF16 autocast
    the experts then add an FP32 branch: the output moves against "input"; "input" sets nothing."""
    from titan_nvfp4.integration_v03.converter import NVFP4LinearConfigConverter
    from titan_nvfp4.integration_v03.trainer import apply_lora_dtype

    torch.manual_seed(0)
    m = build_experts(*EXPERT_KINDS["swiglu"], lora_rank=16)
    part = torch.nn.Module()
    part.add_module("experts", m)
    assert apply_lora_dtype([part], NVFP4LinearConfigConverter.Config(lora_rank=16)) == 0 and m.lora_dtype == "input"
    x = torch.randn(sum(COUNTS), D)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = m(x, torch.tensor(COUNTS))
        assert apply_lora_dtype([part], NVFP4LinearConfigConverter.Config(lora_rank=16, lora_dtype="float32")) == 1
        after = m(x, torch.tensor(COUNTS))
    assert m.lora_dtype == "float32" and before.dtype == after.dtype and not torch.equal(before, after)
    plain = torch.nn.Module()
    plain.add_module("experts", build_experts(*EXPERT_KINDS["swiglu"]))  # no rank: nothing for the knob to change
    with pytest.raises(ValueError, match=r"lora_dtype = 'float32' needs a low-rank branch"):
        apply_lora_dtype([plain], NVFP4LinearConfigConverter.Config(lora_dtype="float32"))


def test_grouped_lora_state_dict_is_02s_and_loads_back():
    """The experts' state dict on 0.3 is 0.2's: each weight's key holds the full W (R + U·diag(σ)·V in R's dtype) and
    ``<weight>_lora_residual`` R; experts initialized otherwise load R and the factors back bit for bit, and a state
    dict of the weights alone (BF16 experts) is split anew on load."""
    upstream, names = EXPERT_KINDS["swiglu"]
    torch.manual_seed(0)
    m = build_experts(upstream, names, lora_rank=16)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    for g, w in m.dense_weights().items():
        assert torch.equal(sd[g], w.to(sd[g].dtype)) and torch.equal(sd[f"{g}_lora_residual"], getattr(m, g))
    torch.manual_seed(1)
    fresh = build_experts(upstream, names, lora_rank=16)
    fresh.load_state_dict(sd)
    assert fresh._lora_ready and all(torch.equal(getattr(fresh, n), p) for n, p in m.named_parameters())
    fresh.load_state_dict({g: sd[g] for g in names})
    assert fresh._lora_ready and all(torch.allclose(getattr(fresh, f"{g}_lora_sigma").detach(),
                                                    torch.linalg.svdvals(sd[g])[:, :16], rtol=0, atol=1e-5)
                                     for g in names)


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_grouped_lora_experts_run_nvfp4_on_r_plus_the_branch(kind):
    """The 0.3 experts with a lora_rank against the core's functions (0.2's forward) on the same padded groups: each
    GEMM NVFP4 on R plus the per-expert branch (grouped_lowrank), without stochastic rounding the same bits for y,
    dx and every weight, bias and factor gradient. After the late switch they compute the experts of W = R + U·diag(σ)·V
    to fp32 rounding; the forward refuses to run before the split."""
    upstream, names = EXPERT_KINDS[kind]
    torch.manual_seed(0)
    m = build_experts(upstream, names, stochastic_rounding=False, lora_rank=16)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), D, requires_grad=True)
    dy = torch.randn(sum(COUNTS), D)
    m(x, counts).backward(dy)
    params = [n for n, _ in m.named_parameters()]
    got = [x.grad, *(getattr(m, n).grad for n in params)]

    xc = x.detach().clone().requires_grad_()
    p = {n: getattr(m, n).detach().clone().requires_grad_() for n in params}
    r, c, signs = m.recipe, m.sr_counter, m.rht_signs
    pg = pad_token_groups(xc, counts)  # as the module runs them (the branch's fp32 GEMMs round per group size)
    offsets = torch.cumsum(pg.counts, 0, dtype=torch.int32)

    def branch(g, t):
        return grouped_lowrank(t, p[f"{g}_lora_u"], p[f"{g}_lora_sigma"], p[f"{g}_lora_v"], offsets)

    if kind == "swiglu":
        h1, h3 = nvfp4_grouped_mm_shared(pg.x, (p["w1_EFD"], p["w3_EFD"]), offsets, (None, None), r, (c[0], c[2]),
                                         signs, True)
        h = torch.nn.functional.silu(h1 + branch("w1_EFD", pg.x)) * (h3 + branch("w3_EFD", pg.x))
        (y,) = nvfp4_grouped_mm_shared(h, (p["w2_EDF"],), offsets, (None,), r, (c[1],), signs, True)
        y = y + branch("w2_EDF", h)
    else:
        (h,) = nvfp4_grouped_mm_shared(pg.x, (p["mlp1_weight_EGD"],), offsets, (p["mlp1_bias_EG"],), r, (c[0],),
                                       signs, True)
        h = swiglu(h + branch("mlp1_weight_EGD", pg.x), limit=m.swiglu_limit) * pg.valid(h.dtype)
        (y,) = nvfp4_grouped_mm_shared(h, (p["mlp2_weight_EDF"],), offsets, (p["mlp2_bias_ED"],), r, (c[1],), signs,
                                       True)
        y = y + branch("mlp2_weight_EDF", h)
    y = y[pg.rows]
    y.backward(dy)
    assert torch.equal(m(x.detach(), counts), y.detach())
    for name, a, b in zip(("dx", *params), got, [xc.grad, *(t.grad for t in p.values())]):
        assert torch.equal(a, b), name
    m.precision_schedule = SimpleNamespace(high_precision=True)  # after bf16_after_fraction: the input's dtype
    dense = {**{n: getattr(m, n).detach().double() for n in names}, **m.dense_weights()}
    want = experts_reference(kind, x.detach().double(), [dense[n].double() for n in names], COUNTS)
    assert torch.allclose(m(x.detach(), counts).double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    m.lora_decomposed.fill_(False)
    m._lora_ready = False
    with pytest.raises(RuntimeError, match="used before its weights were decomposed"):
        m(x, counts)


def test_grouped_lora_rank_that_does_not_fit_or_meets_ep_is_refused():
    """A grouped lora_rank above an expert weight's smaller dim stops the conversion naming the key, the experts and
    the weight; with a rank, expert or tensor parallelism is refused at parallelize, naming the key (0.2 refuses
    both too)."""
    c = parse("deepseek_v3_debug_nvfp4", "--quantize.grouped_mm.lora_rank", "512")
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm\] lora_rank 512 does not fit experts "
                                         r"'layers.1.moe.routed_experts.inner_experts': w1_EFD \(8, 256, 256\)"):
        apply_quantize(c)
    upstream, names = EXPERT_KINDS["gpt_oss"]
    with pytest.raises(ValueError, match=r"\[quantize.grouped_mm\] lora_rank 64 does not fit experts .*"
                                         r"mlp1_weight_EGD \(4, 96, 32\)"):
        build_experts(upstream, names, lora_rank=64)
    m = build_experts(*EXPERT_KINDS["swiglu"], lora_rank=16)
    for tp, ep in ((False, True), (True, False)):
        with pytest.raises(NotImplementedError, match=r"\[quantize.grouped_mm\] lora_rank = 16: experts .* expert "
                                                      "or tensor parallelism"):
            m.parallelize(SimpleNamespace(tp_enabled=tp, ep_enabled=ep))


def _fsdp_gather_worker(rank, world, out, tmp_path, tp=1):
    """Two SGD steps of llama3_debug_nvfp4's first 2 blocks under FSDP2 (dp_shard = world) through its parallelize,
    once with the BF16 all-gather and once with fsdp_nvfp4_all_gather (tile amaxes precomputed after the first
    step, as the trainer's step hook does); this rank's full gradients of each step."""
    import torchtitan.distributed.parallel_dims as pd_module

    from titan_nvfp4.distributed.fsdp_all_gather import TRAFFIC, NVFP4ShardedWeight

    torch.set_num_threads(1)
    pd_module.device_type = "cpu"
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + rank // tp))
    for gather in (False, True):
        torch.manual_seed(0)
        c = parse("llama3_debug_nvfp4", "--quantize.linear.gemm_backend", "reference", "--training.seq_len", str(SEQ),
                  "--training.local_batch_size", str(BATCH), "--parallelism.data_parallel_shard_degree", str(world // tp),
                  "--parallelism.tensor_parallel_degree", str(tp),
                  "--parallelism.spmd_backend", "partial_dtensor", "--dump_folder", str(tmp_path),
                  *(["--quantize.linear.fsdp_nvfp4_all_gather"] if gather else []))
        apply_quantize(c)
        model, pd = build_on_ranks(c, world, 2)
        for m in model.modules():  # gloo has no PREMUL_SUM: plain sums (TorchTitan divides by the token count itself)
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
        wrapped = sum(isinstance(_local(m.weight), NVFP4ShardedWeight) for m in model.modules()
                      if isinstance(m, TitanNVFP4Linear))
        sections = attach_sections([model], c.quantize, total_steps=2)
        TRAFFIC.take()
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            tp_step(model, pd, tokens)
            grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
            after_optimizer_step([model], sections)
        if rank == 0:
            out["nvfp4" if gather else "bf16"] = dict(grads=grads, wrapped=wrapped, traffic=TRAFFIC.take())


@pytest.mark.long
@pytest.mark.slow(reason="31 s on 2 cores; the NVFP4 all-gather under TorchTitan 0.2's FSDP2 in CI")
def test_fsdp2_nvfp4_all_gather_trains_as_the_bf16_gather(tmp_path):
    """fsdp_nvfp4_all_gather on 0.3: the 10 NVFP4 Linears' weights gather as codes through llama3's own parallelize
    (FSDP2 2 × TP 2 on 4 gloo ranks, partial_dtensor: the gather of FSDP2 alone, on the TP shards) and two SGD steps
    give the BF16 all-gather's gradients bit for bit. (FSDP2 alone on 2 ranks passed the same way; it is left out
    for CI's time, as the gather is the same code.)"""
    tp = 2
    out = run_ranks(_fsdp_gather_worker, 2 * tp, tmp_path, tp, preload=PRELOAD_V03)
    bf16, nvfp4 = out["bf16"], out["nvfp4"]
    assert (bf16["wrapped"], nvfp4["wrapped"]) == (0, 10)
    assert nvfp4["traffic"]["gathers"] > 0 and nvfp4["traffic"]["codes_bytes"] * 4 == nvfp4["traffic"]["param_dtype_bytes"]
    for step, (a, b) in enumerate(zip(bf16["grads"], nvfp4["grads"])):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    w1 = next(n for n in bf16["grads"][0] if n.endswith("feed_forward.w1.weight"))
    assert not torch.equal(bf16["grads"][0][w1], bf16["grads"][1][w1])  # the step did change the weights


def test_nvfp4_all_gather_outside_its_backend_stops_naming_the_knob():
    """fsdp_nvfp4_all_gather under FSDP on spmd_types (TP or not) stops before anything is sharded; without FSDP it
    leaves the weights alone; the parallelize_fn is wrapped once however often the config is converted."""
    from titan_nvfp4.distributed.fsdp_all_gather import NVFP4ShardedWeight
    from titan_nvfp4.integration_v03.trainer import with_nvfp4_all_gather

    c = parse("llama3_debug_nvfp4", "--quantize.linear.fsdp_nvfp4_all_gather")
    original = c.model_spec.parallelize_fn
    apply_quantize(c)
    apply_quantize(c)
    assert c.model_spec.parallelize_fn.__wrapped__ is original
    calls = []
    fn = with_nvfp4_all_gather(lambda model, **kw: calls.append(model) or model, "quantize.linear")
    model = torch.nn.Sequential(TitanNVFP4Linear(TitanNVFP4Linear.Config(in_features=32, out_features=16)))
    for pd, backend in [(SimpleNamespace(fsdp_enabled=True, tp_enabled=False, tp=1), "spmd_types"),
                        (SimpleNamespace(fsdp_enabled=True, tp_enabled=True, tp=2), "spmd_types")]:
        with pytest.raises(ValueError, match=r"\[quantize.linear\] fsdp_nvfp4_all_gather = true runs on "
                                             r"parallelism.spmd_backend = partial_dtensor"):
            fn(model, parallel_dims=pd, parallelism=SimpleNamespace(spmd_backend=backend))
    assert not calls
    fn(model, parallel_dims=SimpleNamespace(fsdp_enabled=False), parallelism=SimpleNamespace(spmd_backend="spmd_types"))
    assert calls == [model] and not isinstance(model[0].weight, NVFP4ShardedWeight)


def test_comparison_spec_arms_parse_through_the_03_config_manager(tmp_path):
    """The comparison runner on 0.3 (`module = ...`): every arm's command parses through 0.3's ConfigManager before
    anything trains (a branch's whole-state initial load included: 0.3 takes only an absolute path), and a misspelt
    override stops it naming the arm."""
    from torchtitan.config import ConfigManager

    from titan_nvfp4 import compare

    spec = tmp_path / "spec.toml"
    arms = ('[[arm]]\nname = "bf16"\nbase = "llama3_debug_bf16"\n[[arm]]\nname = "nvfp4"\n'
            '[[arm]]\nname = "no_sr"\noverrides = ["--quantize.linear.stochastic_rounding", "False"]\n'
            'branch_from = "nvfp4"\nbranch_step = 5\n')
    spec.write_text(f'[compare]\nmodule = "{MODULE}"\nbase = "llama3_debug_nvfp4"\nsteps = 10\nout = "out"\n'
                    f'checkpoint_interval = 5\n{arms}')
    s = compare.load_spec(spec)
    compare.check_arm_args(s, str(spec))
    branch = s.by_name()["no_sr"]
    ckpt = ConfigManager().parse_args(s.command(branch)[len(s.launcher):]).checkpoint
    assert ckpt.initial_load_path == str(Path("out/nvfp4/branch/step-5").absolute()) and not ckpt.initial_load_model_only
    spec.write_text(spec.read_text().replace("stochastic_rounding", "stochastic_roundin"))
    with pytest.raises(ValueError, match="arm 'no_sr': TorchTitan rejects its arguments"):
        compare.check_arm_args(compare.load_spec(spec), str(spec))
