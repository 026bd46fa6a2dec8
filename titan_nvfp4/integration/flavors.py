"""Extra model flavors, added to TorchTitan's flavor tables on import (torchtitan itself is not modified).

Why: TorchTitan 0.2.2 ships only the 6M-parameter `debugmodel` (too small to measure end-to-end
throughput: launch overhead dominates) and 8B+ flavors (vocabulary 128256, not our offline 2048-token
tokenizer, and too big for one GPU without sharding). `2B_bench` sits in between for the single-H100
BF16-vs-NVFP4 benchmark (`train_configs/llama3_2b_bench_*.toml`, `scripts/e2e_bench.sh`): dim 2048,
8 layers, 16 heads (8 KV heads), FFN hidden 5632, vocabulary 2048; 385,910,784 parameters. Every Linear
dim is a multiple of 256, so all 56 block Linears convert to NVFP4 (which needs multiples of 16).

TorchTitan builds the model from `get_train_spec("llama3").model_args[flavor]`, which is this very dict,
and it imports our `[job] custom_config_module` (-> converter -> this module) while parsing the job file,
before the model is built; `import titan_nvfp4` registers it too.

`8B_layers`: four blocks of Llama3-8B's shapes (dim 4096, 32 heads / 8 KV heads, FFN hidden 14336) on
the same vocabulary, 889M parameters: the 8B model's GEMMs on one GPU (`train_configs/llama3_8b_layers_*.toml`,
seq 4096).

`gpt_oss` `debugmodel_vocab2048`: TorchTitan's gpt_oss `debugmodel` (4 layers, dim 256, 8 experts of
hidden 2880, top-4) with the vocabulary cut from gpt-oss's 201,088 entries to our tokenizer's 2048, as
the other MoE debug models (deepseek_v3, qwen3, llama4) already have. With 201,088 entries the LM head
and embedding hold 103M of the model's 184M parameters and its logits dominate memory (28 GiB at batch
16×512) for ids that never occur; at 2048 the model is 81.5M parameters (46.0M active per token), the
size of the gpt-oss debug MoE that the DecomposedLinear report used (issue 5).
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.models.gpt_oss import gptoss_configs
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

BENCH_FLAVOR = "2B_bench"
BENCH_VOCAB_SIZE = 2048
"""= titan_nvfp4.data.tokenizer.VOCAB_SIZE (not imported: that module needs `tokenizers`; a test checks it)."""


def bench_args() -> TransformerModelArgs:
    """The `2B_bench` model args: a mid-size Llama3 on our tokenizer, sized for one-GPU throughput runs."""
    return TransformerModelArgs(
        dim=2048,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=BENCH_VOCAB_SIZE,
        multiple_of=256,  # FFN hidden = 256 * ceil(int(2 * 4 * 2048 / 3) / 256) = 5632
        rope_theta=500000,
    )


LAYERS_8B_FLAVOR = "8B_layers"


def layers_8b_args() -> TransformerModelArgs:
    """The `8B_layers` model args: Llama3-8B's block shapes, 4 blocks, our tokenizer's vocabulary."""
    return TransformerModelArgs(
        dim=4096,
        n_layers=4,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=BENCH_VOCAB_SIZE,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,  # FFN hidden = 1024 * ceil(int(1.3 * 2 * 4 * 4096 / 3) / 1024) = 14336, as Llama3-8B
        rope_theta=500000,
    )


GPT_OSS_FLAVOR = "debugmodel_vocab2048"


def gpt_oss_debug_args():
    """gpt_oss `debugmodel` with our tokenizer's 2048-entry vocabulary (its MoE args copied, not shared)."""
    base = gptoss_configs["debugmodel"]
    return dataclasses.replace(base, vocab_size=BENCH_VOCAB_SIZE, moe_args=copy.deepcopy(base.moe_args))


def register_flavors() -> None:
    """Add our flavors to TorchTitan's tables; idempotent (an existing entry is kept, e.g. on reload)."""
    llama3_args.setdefault(BENCH_FLAVOR, bench_args())
    llama3_args.setdefault(LAYERS_8B_FLAVOR, layers_8b_args())
    gptoss_configs.setdefault(GPT_OSS_FLAVOR, gpt_oss_debug_args())


register_flavors()
