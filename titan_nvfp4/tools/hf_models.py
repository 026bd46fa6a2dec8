"""The TorchTitan models export_hf writes as Hugging Face models: their transformers config, from the model args.

Weights are renamed (and q/k rows permuted) by TorchTitan's own state-dict adapter of the model
(``train_spec.state_dict_adapter``); what transformers needs besides is its config, built here. Llama3 and
DeepSeek-V3 (its routed experts split per expert by TorchTitan's adapter). TorchTitan's llama3 always applies Llama 3.1's RoPE scaling (RoPEScalingArgs), so the config says
``rope_type = "llama3"`` with the same factors, and ``max_position_embeddings`` is the trained context
(training.seq_len); transformers warns that original_max_position_embeddings (8192) is not below it, which
changes nothing in the frequencies it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HFModel:
    """How one TorchTitan model becomes a transformers model: ``config(args, model, bos_id, eos_id)`` gives
    config.json's dict (without quantization_config); ``fused``: the groups of Linears (Hugging Face module name
    suffixes) that vLLM and SGLang load as one fused GEMM, and so read with one weight global scale."""

    architecture: str
    config: Callable[[object, nn.Module, int | None, int | None], dict]
    fused: tuple[tuple[str, ...], ...]


def _first_block(model: nn.Module) -> nn.Module:
    layers = model.layers
    return next(iter(layers.values())) if isinstance(layers, nn.ModuleDict) else layers[0]


def llama_config(args, model: nn.Module, bos_id: int | None, eos_id: int | None) -> dict:
    """transformers' LlamaConfig of TorchTitan llama3 model args (the FFN width read from the model's w1)."""
    from transformers import LlamaConfig

    rope = args.rope_scaling_args
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=_first_block(model).feed_forward.w1.out_features,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads or args.n_heads,
        head_dim=args.dim // args.n_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "llama3", "rope_theta": float(args.rope_theta),
                         "factor": float(rope.scaling_factor), "low_freq_factor": float(rope.low_freq_factor),
                         "high_freq_factor": float(rope.high_freq_factor),
                         "original_max_position_embeddings": int(rope.original_max_position_embeddings)},
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        dtype=torch.bfloat16,
    )
    return config.to_dict()


def deepseek_v3_config(args, model: nn.Module, bos_id: int | None, eos_id: int | None) -> dict:
    """transformers' DeepseekV3Config of TorchTitan deepseek_v3 model args; a ValueError naming the knob where
    TorchTitan's model computes what transformers' DeepseekV3 cannot (its router is always sigmoid, weights the
    expert outputs after the experts, has no gate bias; YaRN RoPE is not mapped here)."""
    from transformers import DeepseekV3Config

    moe = args.moe_args
    unsupported = [(f"moe_args.score_func = {moe.score_func!r}", moe.score_func != "sigmoid"),
                   ("moe_args.score_before_experts = True", moe.score_before_experts),
                   ("moe_args.gate_bias = True", moe.gate_bias),
                   (f"max_seq_len {args.max_seq_len} > original_seq_len {args.original_seq_len} (YaRN RoPE)",
                    args.max_seq_len > args.original_seq_len)]
    bad = [what for what, flag in unsupported if flag]
    if bad:
        raise ValueError(f"deepseek_v3 with {bad[0]}: transformers' DeepseekV3 computes otherwise (sigmoid router, "
                         "scores applied after the experts, no gate bias, default RoPE here); not exported")
    config = DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.inter_dim,
        moe_intermediate_size=args.moe_inter_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
        n_shared_experts=moe.num_shared_experts,
        n_routed_experts=moe.num_experts,
        routed_scaling_factor=float(moe.route_scale),
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank or None,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        qk_nope_head_dim=args.qk_nope_head_dim,
        n_group=moe.num_expert_groups or 1,
        topk_group=moe.num_limited_groups or 1,
        num_experts_per_tok=moe.top_k,
        first_k_dense_replace=args.n_dense_layers,
        norm_topk_prob=bool(moe.route_norm),
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rope_theta)},
        rope_interleave=True,  # TorchTitan's complex RoPE pairs adjacent features, as DeepSeek's checkpoints
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        attention_bias=False,
        dtype=torch.bfloat16,
    )
    return config.to_dict()


def llama_config_v03(mc, model: nn.Module, bos_id: int | None, eos_id: int | None) -> dict:
    """transformers' LlamaConfig of a TorchTitan 0.3 llama3 model config (Llama3Model.Config: the attention, RoPE and
    norm configs of its blocks); a ValueError for a RoPE scaling other than Llama 3's."""
    from transformers import LlamaConfig

    attn = mc.layers[0].attention
    rope = attn.rope
    if rope.scaling not in ("llama", "none"):
        raise ValueError(f"llama3 with RoPE scaling {rope.scaling!r}: not mapped to transformers here")
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope.theta)}
    if rope.scaling == "llama":
        rope_parameters = {"rope_type": "llama3", "rope_theta": float(rope.theta),
                           "factor": float(rope.scaling_factor), "low_freq_factor": float(rope.low_freq_factor),
                           "high_freq_factor": float(rope.high_freq_factor),
                           "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=mc.vocab_size,
        hidden_size=mc.dim,
        intermediate_size=_first_block(model).feed_forward.w1.out_features,
        num_hidden_layers=len(mc.layers),
        num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads or attn.n_heads,
        head_dim=attn.head_dim or mc.dim // attn.n_heads,
        max_position_embeddings=rope.max_seq_len,
        rms_norm_eps=mc.norm.eps,
        rope_parameters=rope_parameters,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=bool(mc.enable_weight_tying),
        attention_bias=False,
        mlp_bias=False,
        dtype=torch.bfloat16,
    )
    return config.to_dict()


#: TorchTitan 0.3 model name -> its config.json builder (the model config tree's field names differ from 0.2's)
HF_CONFIGS_V03 = {"llama3": llama_config_v03}

#: TorchTitan model name -> its Hugging Face form
HF_MODELS = {
    "llama3": HFModel("LlamaForCausalLM", llama_config,
                      fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))),
    "deepseek_v3": HFModel("DeepseekV3ForCausalLM", deepseek_v3_config, fused=(("gate_proj", "up_proj"),)),
}

__all__ = ["HFModel", "HF_CONFIGS_V03", "HF_MODELS", "deepseek_v3_config", "llama_config", "llama_config_v03"]
