"""TorchTitan's MoE debug models on meta (deepseek_v3, llama4, qwen3, gpt_oss), the CPU stand-in for the
torch.histc their routers call, and the mark of tests that run CPU tensors through Triton."""

from __future__ import annotations

import copy

import pytest
import torch

from titan_nvfp4.ops.backends import interpreting

# These tests run CPU tensors through Triton (our kernels, and TorchTitan's token-permutation kernel,
# which TorchTitan picks whenever CUDA is present): in CI's interpreter, not on a GPU machine's driver.
# On a GPU machine run them with TRITON_INTERPRET=1; test_gpu.py covers the kernels on the device.
cpu_triton = pytest.mark.skipif(torch.cuda.is_available() and not interpreting(),
                                reason="CPU tensors through Triton: set TRITON_INTERPRET=1 on a GPU machine")


def moe_models():
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
    from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs
    from torchtitan.models.llama4 import Transformer as Llama4, llama4_args
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    return {
        "deepseek_v3": (DeepSeekV3Model, deepseekv3_args["debugmodel"]),
        "llama4": (Llama4, llama4_args["debugmodel"]),
        "qwen3": (Qwen3Model, qwen3_args["debugmodel_moe"]),
        "gpt_oss": (GptOssModel, gptoss_configs["debugmodel"]),
    }


def build_moe(name: str, seq: int = 32, score_before_experts: bool | None = None, n_layers: int | None = None,
              **dims):
    """TorchTitan's debug flavour of ``name`` on the meta device, its vocabulary cut to the other flavours'
    2048: gpt_oss's debug flavour keeps its tokenizer's 201,088, whose embedding and output layer would
    take most of a CPU test's time in init_weights. ``dims``: model arguments to set (dim=1024, ...)."""
    from torchtitan.config import ConfigManager

    cls, args = moe_models()[name]
    args = copy.deepcopy(args)
    args.vocab_size = min(args.vocab_size, 2048)
    if score_before_experts is not None:
        args.moe_args.score_before_experts = score_before_experts
    if n_layers is not None:  # fewer blocks (deepseek_v3: the first stays dense), for the multi-process tests
        args.n_layers = n_layers
    for field, value in dims.items():
        if not hasattr(args, field):
            raise AttributeError(f"build_moe: {name} has no model argument {field!r}")
        setattr(args, field, value)
    # as TorchTitan's trainer does (max_seq_len, the MoE implementation, ...)
    args.update_from_config(ConfigManager().parse_args(["--training.seq_len", str(seq)]))
    with torch.device("meta"):
        return cls(args), args


def histc_for_cpu(histc=torch.histc):
    """TorchTitan's router counts tokens per expert with torch.histc on int64 indices, which has no
    CPU kernel: a torch.histc that counts in float32 there (exact for these counts). GPU runs use the
    real op."""

    def patched(x, *args, **kwargs):
        if x.device.type == "cpu" and not x.is_floating_point():
            return histc(x.float(), *args, **kwargs).to(x.dtype)  # integer counts, as CUDA returns
        return histc(x, *args, **kwargs)

    return patched
