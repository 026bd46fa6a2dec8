"""The MoE flavors at real layer shapes (DeepSeek-V3-16B, Qwen3-30B-A3B, gpt-oss-20b; 4 blocks each) and their
BF16/NVFP4 job files (issue 67): the files parse, the models build on meta with the published shapes, the NVFP4
twin's converters convert every routed expert and every block Linear but the filtered ones (CPU, meta device)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

import titan_nvfp4.integration  # noqa: F401  (registers the converters and the flavors)
from job_helpers import parse, world1
from titan_nvfp4 import NVFP4Linear
from titan_nvfp4.integration import flavors
from titan_nvfp4.integration.experts import NVFP4GptOssExperts, NVFP4GroupedExperts
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec

ROOT = Path(__file__).resolve().parents[1]

# job-file stem -> (TorchTitan model, our flavor, TorchTitan's flavor of the published model, parameter count,
# block Linears converted by [quantize.linear.nvfp4], Linears it keeps in BF16 (output, router gates, shared experts))
MODELS = {
    "deepseek_v3_16b_4blocks": ("deepseek_v3", flavors.DEEPSEEK_V3_16B_FLAVOR, "16B", 1_843_941_376,
                                # wq, wkv_a, wkv_b, wo in 4 blocks + the dense first block's w1, w2, w3
                                4 * 4 + 3, 1 + 3 + 3 * 3),
    "qwen3_30b_a3b_4blocks": ("qwen3", flavors.QWEN3_30B_A3B_FLAVOR, "30B-A3B", 2_500_873_216, 4 * 4, 1 + 4),
    "gpt_oss_20b_4blocks": ("gpt_oss", flavors.GPT_OSS_20B_FLAVOR, "20b", 3_304_547_264, 4 * 4, 1 + 4),
}


def job(stem: str, arm: str):
    return parse(toml=ROOT / "train_configs" / f"{stem}_{arm}.toml")


def meta_model(cfg):
    """The job's model on meta, its args updated from the job as TorchTitan's trainer does."""
    spec = get_train_spec(cfg.model.name)
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    with torch.device("meta"):
        return spec.model_cls(args), args


@pytest.mark.parametrize("stem", MODELS)
def test_flavor_is_the_published_model_cut_to_4_blocks_and_our_vocabulary(stem):
    name, ours, published, *_ = MODELS[stem]
    table = get_train_spec(name).model_args
    mine, real = dataclasses.asdict(table[ours]), dataclasses.asdict(table[published])
    assert (mine.pop("n_layers"), mine.pop("vocab_size")) == (4, flavors.BENCH_VOCAB_SIZE)
    assert real.pop("vocab_size") > 100_000 and real.pop("n_layers") >= 24  # TorchTitan's own flavor untouched
    assert mine == real  # dims, heads, experts, top-k, shared experts, rope, attention: all as the real model
    assert table[ours].moe_args is not table[published].moe_args  # update_from_config edits these in place


@pytest.mark.parametrize("stem", MODELS)
def test_job_files_are_twins(stem):
    name, ours, *_ = MODELS[stem]
    cfg = {arm: job(stem, arm) for arm in ("bf16", "nvfp4")}
    for c in cfg.values():
        assert (c.model.name, c.model.flavor) == (name, ours)
        assert c.training.seq_len == 2048 and c.training.local_batch_size == 4 and c.training.steps == 100
        assert c.metrics.log_freq == 10 and not c.checkpoint.enable and not c.compile.enable
        assert c.activation_checkpoint.mode == "none" and c.training.dataset == "pystdlib"
        assert c.model.hf_assets_path == "./assets/pystdlib"
    assert cfg["bf16"].model.converters == []
    assert cfg["nvfp4"].model.converters == ["quantize.linear.nvfp4", "quantize.grouped_mm.nvfp4"]
    assert list(cfg["nvfp4"].quantize.linear.nvfp4.filter_fqns) == ["output", "router.gate", "shared_experts"]
    assert list(cfg["nvfp4"].quantize.grouped_mm.nvfp4.fqns) == ["moe.experts"]
    a, b = cfg["bf16"].to_dict(), cfg["nvfp4"].to_dict()
    for d in (a, b):  # everything but the converters, the file names and the job's name is the same
        for k in ("dump_folder", "description", "config_file"):
            d["job"].pop(k)
        d["model"].pop("converters")
        d.pop("quantize")
    assert a == b
    assert parse("--compile.enable", toml=ROOT / "train_configs" / f"{stem}_bf16.toml").compile.enable


def _expert_shapes(experts) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in experts.named_parameters()}


@pytest.mark.parametrize("stem", MODELS)
def test_model_has_the_published_layer_shapes(stem):
    *_, n_params, _, _ = MODELS[stem]
    model, args = meta_model(job(stem, "bf16"))
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert len(model.layers) == 4 and model.tok_embeddings.weight.shape[0] == flavors.BENCH_VOCAB_SIZE
    moe = [b.moe for b in model.layers.values() if b.moe_enabled]
    routers = {(m.router.num_experts, m.router.top_k) for m in moe}
    if stem.startswith("deepseek_v3"):  # 1 dense first block (FFN hidden 10944) + 3 MoE blocks, as DeepSeek-V3-16B
        assert not model.layers["0"].moe_enabled and model.layers["0"].feed_forward.w1.weight.shape == (10944, 2048)
        assert len(moe) == 3 and routers == {(64, 6)}
        assert {n: s for m in moe for n, s in _expert_shapes(m.experts).items()} == {
            "w1": (64, 1408, 2048), "w2": (64, 2048, 1408), "w3": (64, 1408, 2048)}
        assert {m.shared_experts.w1.weight.shape for m in moe} == {(2 * 1408, 2048)}  # 2 shared experts
        att = model.layers["1"].attention  # MLA, 16 heads: q 128+64, kv_lora_rank 512 (+ rope 64), v 128
        assert (att.wq.weight.shape, att.wkv_a.weight.shape) == ((16 * 192, 2048), (512 + 64, 2048))
        assert (att.wkv_b.weight.shape, att.wo.weight.shape) == ((16 * 256, 512), (2048, 16 * 128))
    elif stem.startswith("qwen3"):
        assert len(moe) == 4 and routers == {(128, 8)} and all(m.shared_experts is None for m in moe)
        assert {n: s for m in moe for n, s in _expert_shapes(m.experts).items()} == {
            "w1": (128, 768, 2048), "w2": (128, 2048, 768), "w3": (128, 768, 2048)}
        att = model.layers["0"].attention  # 32 query heads, 4 KV heads, head_dim 128
        assert (att.wq.weight.shape, att.wk.weight.shape, att.wo.weight.shape) == (
            (32 * 128, 2048), (4 * 128, 2048), (2048, 32 * 128))
    else:
        assert len(moe) == 4 and routers == {(32, 4)}
        assert {n: s for m in moe for n, s in _expert_shapes(m.experts).items()} == {
            "mlp1_weight": (32, 5760, 2880), "mlp1_bias": (32, 5760),
            "mlp2_weight": (32, 2880, 2880), "mlp2_bias": (32, 2880)}
        att = model.layers["0"].attention  # 64 query heads, 8 KV heads, head_dim 64, sinks
        assert (att.wq.weight.shape, att.wk.weight.shape, att.sinks.shape) == ((64 * 64, 2880), (8 * 64, 2880), (64,))


@pytest.mark.parametrize("stem", MODELS)
def test_nvfp4_twin_converts_every_routed_expert_and_block_linear(stem):
    *_, n_linear, n_kept = MODELS[stem]
    cfg = job(stem, "nvfp4")
    model, _ = meta_model(cfg)
    build_model_converters(cfg, world1()).convert(model)
    experts = [n for n, m in model.named_modules() if isinstance(m, (NVFP4GroupedExperts, NVFP4GptOssExperts))]
    moe_blocks = [k for k, b in model.layers.items() if b.moe_enabled]
    assert experts == [f"layers.{k}.moe.experts" for k in moe_blocks]  # every routed-expert module
    nvfp4 = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert len(nvfp4) == n_linear and len(kept) == n_kept
    assert all(n == "output" or "router.gate" in n or "shared_experts" in n for n in kept), kept
