"""Extra Llama3 flavors, added to TorchTitan's `llama3_args` table on import (torchtitan itself is not
modified).

Why: TorchTitan 0.2.2 ships only the 6M-parameter `debugmodel` (too small to measure end-to-end
throughput: launch overhead dominates) and 8B+ flavors (vocabulary 128256, not our offline 2048-token
tokenizer, and too big for one GPU without sharding). `2B_bench` sits in between for the single-H100
BF16-vs-NVFP4 benchmark (`train_configs/llama3_2b_bench_*.toml`, `scripts/e2e_bench.sh`): dim 2048,
8 layers, 16 heads (8 KV heads), FFN hidden 5632, vocabulary 2048; 385,910,784 parameters. Every Linear
dim is a multiple of 256, so all 56 block Linears convert to NVFP4 (which needs multiples of 16).

TorchTitan builds the model from `get_train_spec("llama3").model_args[flavor]`, which is this very dict,
and it imports our `[job] custom_config_module` (-> converter -> this module) while parsing the job file,
before the model is built; `import titan_nvfp4` registers it too.
"""

from __future__ import annotations

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


def register_flavors() -> None:
    """Add our flavors to llama3_args; idempotent (an existing entry is kept, e.g. on module reload)."""
    llama3_args.setdefault(BENCH_FLAVOR, bench_args())


register_flavors()
