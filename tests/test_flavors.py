"""The llama3 "2B_bench" flavor our plugin registers, and the benchmark job files that use it (CPU, meta device)."""

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

import titan_nvfp4.integration  # noqa: F401  (registers the converter and the flavors)
from titan_nvfp4 import NVFP4Linear, NVFP4Recipe
from titan_nvfp4.conversion import convert_linears
from titan_nvfp4.integration.flavors import BENCH_FLAVOR, BENCH_VOCAB_SIZE, LAYERS_8B_FLAVOR
from torchtitan.config import ConfigManager
from torchtitan.models.llama3 import Transformer
from torchtitan.protocols.train_spec import get_train_spec

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {arm: ROOT / "train_configs" / f"llama3_2b_bench_{arm}.toml" for arm in ("bf16", "nvfp4")}


def expected_params(dim=2048, layers=8, heads=16, kv_heads=8, vocab=2048, ffn=5632) -> int:
    """Parameter count of a Llama3 Transformer, by hand: embedding, blocks, final norm, LM head."""
    kv = dim // heads * kv_heads
    attn = dim * dim * 2 + dim * kv * 2  # wq, wo; wk, wv
    block = attn + 3 * dim * ffn + 2 * dim  # + w1, w2, w3 + two RMSNorms
    return vocab * dim + layers * block + dim + dim * vocab


def test_flavor_registered_beside_the_built_in_ones():
    # in a fresh interpreter, absent before the plugin's import: test_converter.test_import_registers_*
    assert get_train_spec("llama3").model_args[BENCH_FLAVOR].dim == 2048
    assert "debugmodel" in get_train_spec("llama3").model_args  # the built-in flavors are still there


def test_vocab_matches_our_tokenizer():
    tokenizer = pytest.importorskip("titan_nvfp4.data.tokenizer")
    assert BENCH_VOCAB_SIZE == tokenizer.VOCAB_SIZE


def test_meta_build_size_and_linear_dims():
    args = get_train_spec("llama3").model_args[BENCH_FLAVOR]
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for p in model.parameters())
    assert n == expected_params() == 385_910_784
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 8 * 7 + 1
    assert linears["layers.0.feed_forward.w1"].out_features == 5632  # = 22 * 256
    for name, m in linears.items():
        assert m.in_features % 16 == 0 and m.out_features % 16 == 0, name
    report = convert_linears(model, NVFP4Recipe(), ["output"])  # the converter accepts every block Linear
    assert len(report["converted"]) == 56 and [f for f, _ in report["skipped"]] == ["output"]
    assert isinstance(model.layers["7"].attention.wk, NVFP4Linear)


def test_bench_job_files_are_twins():
    cfg = {arm: ConfigManager().parse_args(["--job.config_file", str(p)]) for arm, p in CONFIGS.items()}
    for c in cfg.values():
        assert c.model.flavor == BENCH_FLAVOR and c.training.seq_len == 2048 and c.training.steps == 40
        assert c.metrics.log_freq == 1 and not c.checkpoint.enable and not c.compile.enable
        assert c.activation_checkpoint.mode == "none" and c.training.dataset == "pystdlib"
    assert cfg["bf16"].model.converters == [] and cfg["nvfp4"].model.converters == ["quantize.linear.nvfp4"]
    assert cfg["nvfp4"].quantize.linear.nvfp4.gemm_backend == "auto"
    a, b = cfg["bf16"].to_dict(), cfg["nvfp4"].to_dict()
    for d in (a, b):  # everything but the converter, the file names and the job's name is the same
        for k in ("dump_folder", "description", "config_file"):
            d["job"].pop(k)
        d["model"].pop("converters")
        d.pop("quantize")
    assert a == b
    over = ConfigManager().parse_args(["--job.config_file", str(CONFIGS["bf16"]),
                                       "--training.local_batch_size", "8", "--compile.enable"])
    assert over.training.local_batch_size == 8 and over.compile.enable


def test_gpt_oss_flavor_is_the_debugmodel_on_our_vocabulary():
    from torchtitan.models.gpt_oss.model.model import GptOssModel
    from titan_nvfp4.integration.flavors import GPT_OSS_FLAVOR

    table = get_train_spec("gpt_oss").model_args
    ours, base = table[GPT_OSS_FLAVOR], table["debugmodel"]
    assert ours.vocab_size == BENCH_VOCAB_SIZE and base.vocab_size == 201088  # the built-in one untouched
    assert ours.moe_args == base.moe_args and ours.moe_args is not base.moe_args
    with torch.device("meta"):
        model = GptOssModel(ours)
    # per block: attention q/k/v/o with biases + sinks + 2 norms, 8 experts (mlp1 256->5760, mlp2
    # 2880->256, biases), router gate 8x256 + bias; then embedding, final norm and LM head
    block = (4096 * 257 + 2 * 512 * 257 + 256 * 4097 + 64 + 2 * 256
             + 8 * (5760 * 257 + 256 * 2881) + 8 * 257)
    assert sum(p.numel() for p in model.parameters()) == 4 * block + 2048 * 256 * 2 + 256 == 81_489_440
    job_files = sorted(p for p in (ROOT / "train_configs").glob("gpt_oss_*.toml") if "_4blocks_" not in p.name)
    assert len(job_files) >= 4
    for path in job_files:  # every gpt_oss debug job file trains this flavor (20b_4blocks: test_moe_shapes.py)
        assert ConfigManager().parse_args(["--job.config_file", str(path)]).model.flavor == GPT_OSS_FLAVOR, path


@pytest.mark.parametrize("path", sorted((ROOT / "train_configs").glob("*.toml")), ids=lambda p: p.stem)
def test_every_job_file_parses(path):
    """Each train_configs/ file is a valid TorchTitan job (our sections and knobs included)."""
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert cfg.model.name in ("llama3", "deepseek_v3", "gpt_oss", "qwen3", "llama4")
    assert cfg.model.flavor in get_train_spec(cfg.model.name).model_args


def test_8b_layers_flavor_has_llama3_8b_block_shapes():
    args = get_train_spec("llama3").model_args[LAYERS_8B_FLAVOR]
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == expected_params(
        dim=4096, layers=4, heads=32, kv_heads=8, ffn=14336) == 889_229_312
    block = model.layers["0"]
    assert (block.attention.wq.out_features, block.attention.wk.out_features) == (4096, 1024)
    assert block.feed_forward.w1.out_features == 14336  # Llama3-8B's FFN hidden
    report = convert_linears(model, NVFP4Recipe(), ["output"])
    assert len(report["converted"]) == 4 * 7 and [f for f, _ in report["skipped"]] == ["output"]
    cfg = {arm: ConfigManager().parse_args(["--job.config_file", str(ROOT / f"train_configs/llama3_8b_layers_{arm}.toml")])
           for arm in ("bf16", "nvfp4")}
    for c in cfg.values():
        assert c.model.flavor == LAYERS_8B_FLAVOR and c.training.seq_len == 4096 and not c.compile.enable
    assert cfg["bf16"].model.converters == [] and cfg["nvfp4"].model.converters == ["quantize.linear.nvfp4"]
