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

MoE models at real layer shapes, four blocks each, on our 2048-token vocabulary (issue 67), everything else
copied from TorchTitan's flavor of the published model (`moe_shapes_args` below; the job files
`train_configs/{deepseek_v3_16b,qwen3_30b_a3b,gpt_oss_20b}_4blocks_{bf16,nvfp4}.toml`): the expert GEMMs of
the real models on one GPU. Memory estimates are for one GPU without sharding or activation checkpointing:
FP32 weights + FP32 grads + AdamW's two FP32 states = 16 B/parameter, plus the BF16 weight copies autocast
keeps for backward (2 B/parameter), plus saved activations (~100-170 KB per token per MoE block in BF16:
top-k routed copies of the token and of the expert hidden, attention, norms) at seq 2048, plus a transient
of up to 8 B/parameter in the fused AdamW step. Not yet measured on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.gpt_oss import gptoss_configs
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.models.qwen3 import qwen3_args

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


MOE_BLOCKS = 4

DEEPSEEK_V3_16B_FLAVOR = "16B_4blocks"
"""deepseek_v3 `16B_4blocks`: DeepSeek-V3-16B (DeepSeek-MoE-16B) shapes, 4 blocks = the real model's 1 dense first
block (FFN hidden 10944) + 3 MoE blocks (64 routed experts of hidden 1408, top-6, 2 shared experts, softmax
router), dim 2048, MLA attention with 16 heads (kv_lora_rank 512, qk 128+64, v 128), flex attention with
block-causal masks as TorchTitan's `16B`. 1,843,941,376 parameters (1,660,944,384 in routed experts).
Estimated peak at seq 2048: 31 GiB of weights, grads, AdamW state and BF16 copies + ~1.1 GiB of activations
per sequence + up to 14 GiB of optimizer transient -> ~46 GiB at local batch 1, ~49 GiB at 4; the job files
use 4 (8192 tokens/step, 768 routed tokens per expert on average)."""

QWEN3_30B_A3B_FLAVOR = "30B-A3B_4blocks"
"""qwen3 `30B-A3B_4blocks`: Qwen3-30B-A3B shapes, 4 MoE blocks (128 routed experts of hidden 768, top-8, no
shared experts, normalized softmax router), dim 2048, 32 query heads / 4 KV heads of head_dim 128 with QK-norm,
rope theta 1e6. 2,500,873,216 parameters (2,415,919,104 in routed experts). Estimated peak at seq 2048:
42 GiB of weights, grads, AdamW state and BF16 copies + ~1.1 GiB of activations per sequence + up to 19 GiB
of optimizer transient -> ~62 GiB at local batch 1, ~66 GiB at 4; the job files use 4 (8192 tokens/step,
512 routed tokens per expert on average)."""

GPT_OSS_20B_FLAVOR = "20b_4blocks"
"""gpt_oss `20b_4blocks`: gpt-oss-20b shapes, 4 MoE blocks (32 routed experts, mlp1 2880->5760 and mlp2
2880->2880 with biases, top-4, clamped SwiGLU), dim 2880, 64 query heads / 8 KV heads of head_dim 64 with sinks
and sliding-window layers, YaRN rope. 3,304,547,264 parameters (3,186,155,520 in routed experts). Estimated
peak at seq 2048: 55 GiB of weights, grads, AdamW state and BF16 copies + ~1.3 GiB of activations per sequence
+ up to 25 GiB of optimizer transient -> ~81 GiB at local batch 1, ~85 GiB at 4; the job files use 4 (8192
tokens/step, 1024 routed tokens per expert on average)."""


def moe_shapes_args(table: dict, published: str):
    """TorchTitan's flavor ``published`` of ``table`` with MOE_BLOCKS blocks and our vocabulary; everything else
    (dims, heads, experts, top-k, shared experts, rope, attention) as the real model. Its MoE args are copied:
    TorchTitan's update_from_config edits them in place."""
    base = table[published]
    return dataclasses.replace(base, n_layers=MOE_BLOCKS, vocab_size=BENCH_VOCAB_SIZE,
                               moe_args=copy.deepcopy(base.moe_args))


def register_flavors() -> None:
    """Add our flavors to TorchTitan's tables; idempotent (an existing entry is kept, e.g. on reload)."""
    llama3_args.setdefault(BENCH_FLAVOR, bench_args())
    llama3_args.setdefault(LAYERS_8B_FLAVOR, layers_8b_args())
    gptoss_configs.setdefault(GPT_OSS_FLAVOR, gpt_oss_debug_args())
    deepseekv3_args.setdefault(DEEPSEEK_V3_16B_FLAVOR, moe_shapes_args(deepseekv3_args, "16B"))
    qwen3_args.setdefault(QWEN3_30B_A3B_FLAVOR, moe_shapes_args(qwen3_args, "30B-A3B"))
    gptoss_configs.setdefault(GPT_OSS_20B_FLAVOR, moe_shapes_args(gptoss_configs, "20b"))


register_flavors()
