"""Config registry for TorchTitan 0.3: ``-m torchtitan.train --module titan_nvfp4.integration_v03.configs
--config llama3_debug_nvfp4`` (or its BF16 twin ``llama3_debug_bf16``; ``qwen3_debug_*`` for Qwen3's dense
debug model, ``qwen3_moe_debug_*``, ``deepseek_v3_debug_*`` and ``gpt_oss_debug_*`` for the MoE ones), on the
offline pystdlib corpus. One flagship each, NVFP4 and BF16: ``llama3_8b_*``, ``qwen3_30b_a3b_*``,
``deepseek_v3_16b_*``, ``gpt_oss_20b_*`` (upstream's configs on the offline corpus, expert parallelism off)."""

import dataclasses
import os

from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_16b, deepseek_v3_debugmodel
from torchtitan.models.gpt_oss.config_registry import gpt_oss_20b, gpt_oss_debugmodel
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b, qwen3_debugmodel, qwen3_moe_debug
from torchtitan.trainer import Trainer

from ..data.assets import DEFAULT_DIR, ENV_VAR
from ..data.registry import TRAIN_NAME, VALIDATION_NAME
from .converter import NVFP4GroupedMMConfigConverter, NVFP4LinearConfigConverter
from .trainer import NVFP4Trainer, QuantizeConfig


def nvfp4_trainer_config(base: Trainer.Config, quantize: QuantizeConfig) -> NVFP4Trainer.Config:
    """``base`` (an upstream config function's result) as an NVFP4Trainer.Config on the offline corpus, CUDA
    graphs off (our step has host-side logic)."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    config = NVFP4Trainer.Config(**fields, quantize=quantize)
    config.hf_assets_path = os.environ.get(ENV_VAR) or str(DEFAULT_DIR)
    config.dataloader.dataset = TRAIN_NAME
    config.validator.dataloader.dataset = VALIDATION_NAME
    config.training.disable_cuda_graphs = True
    return config


def nvfp4_quantize(experts: bool = False) -> QuantizeConfig:
    """The NVFP4 entries' sections: every eligible Linear (and with ``experts`` the routed experts) in NVFP4 with
    the nvidia_paper recipe."""
    grouped = NVFP4GroupedMMConfigConverter.Config(enable=experts)
    return QuantizeConfig(linear=NVFP4LinearConfigConverter.Config(enable=True), grouped_mm=grouped)


def llama3_debug_bf16() -> NVFP4Trainer.Config:
    """Llama3 debugmodel in BF16: the control arm of llama3_debug_nvfp4."""
    return nvfp4_trainer_config(llama3_debugmodel(), QuantizeConfig())


def llama3_debug_nvfp4() -> NVFP4Trainer.Config:
    """Llama3 debugmodel with every block Linear in NVFP4 (nvidia_paper recipe; the LM head stays BF16)."""
    return nvfp4_trainer_config(llama3_debugmodel(), nvfp4_quantize())


def qwen3_debug_bf16() -> NVFP4Trainer.Config:
    """Qwen3 dense debugmodel in BF16: the control arm of qwen3_debug_nvfp4."""
    return nvfp4_trainer_config(qwen3_debugmodel(), QuantizeConfig())


def qwen3_debug_nvfp4() -> NVFP4Trainer.Config:
    """Qwen3 dense debugmodel with every block Linear in NVFP4 (nvidia_paper recipe; the LM head stays BF16)."""
    return nvfp4_trainer_config(qwen3_debugmodel(), nvfp4_quantize())


def qwen3_moe_debug_bf16() -> NVFP4Trainer.Config:
    """Qwen3 MoE debug model in BF16: the control arm of qwen3_moe_debug_nvfp4."""
    return nvfp4_trainer_config(qwen3_moe_debug(), QuantizeConfig())


def qwen3_moe_debug_nvfp4() -> NVFP4Trainer.Config:
    """Qwen3 MoE debug model with the block Linears and the routed experts in NVFP4 (router gates, LM head BF16)."""
    return nvfp4_trainer_config(qwen3_moe_debug(), nvfp4_quantize(experts=True))


def deepseek_v3_debug_bf16() -> NVFP4Trainer.Config:
    """DeepSeek-V3 debug model in BF16: the control arm of deepseek_v3_debug_nvfp4."""
    return nvfp4_trainer_config(deepseek_v3_debugmodel(), QuantizeConfig())


def deepseek_v3_debug_nvfp4() -> NVFP4Trainer.Config:
    """DeepSeek-V3 debug model with the block Linears and the routed experts in NVFP4 (router gates, shared experts
    and LM head BF16)."""
    return nvfp4_trainer_config(deepseek_v3_debugmodel(), nvfp4_quantize(experts=True))


def gpt_oss_debug_bf16() -> NVFP4Trainer.Config:
    """gpt-oss debug model in BF16: the control arm of gpt_oss_debug_nvfp4."""
    return nvfp4_trainer_config(gpt_oss_debugmodel(), QuantizeConfig())


def gpt_oss_debug_nvfp4() -> NVFP4Trainer.Config:
    """gpt-oss debug model with the block Linears and the routed experts in NVFP4 (router gates, LM head BF16)."""
    return nvfp4_trainer_config(gpt_oss_debugmodel(), nvfp4_quantize(experts=True))


def flagship(base: Trainer.Config, quantize: QuantizeConfig) -> NVFP4Trainer.Config:
    """An upstream flagship config as ours: the offline corpus (its tokenizer's 2048 ids fit every flagship's
    vocabulary) and expert parallelism off (this integration does not shard experts across ranks yet)."""
    config = nvfp4_trainer_config(base, quantize)
    config.parallelism.expert_parallel_degree = 1
    return config


def llama3_8b_bf16() -> NVFP4Trainer.Config:
    """Llama3 8B in BF16: the control arm of llama3_8b_nvfp4."""
    return flagship(llama3_8b(), QuantizeConfig())


def llama3_8b_nvfp4() -> NVFP4Trainer.Config:
    """Llama3 8B with every block Linear in NVFP4 (160: 32 blocks of wqkv, wo, w1, w2, w3; the LM head stays BF16)."""
    return flagship(llama3_8b(), nvfp4_quantize())


def qwen3_30b_a3b_bf16() -> NVFP4Trainer.Config:
    """Qwen3 30B-A3B (MoE) in BF16: the control arm of qwen3_30b_a3b_nvfp4."""
    return flagship(qwen3_30b_a3b(), QuantizeConfig())


def qwen3_30b_a3b_nvfp4() -> NVFP4Trainer.Config:
    """Qwen3 30B-A3B with the block Linears and the routed experts in NVFP4 (router gates, LM head BF16)."""
    return flagship(qwen3_30b_a3b(), nvfp4_quantize(experts=True))


def deepseek_v3_16b_bf16() -> NVFP4Trainer.Config:
    """DeepSeek-V3 16B (MoE) in BF16, expert parallelism off (upstream: 8): the control arm of deepseek_v3_16b_nvfp4."""
    return flagship(deepseek_v3_16b(), QuantizeConfig())


def deepseek_v3_16b_nvfp4() -> NVFP4Trainer.Config:
    """DeepSeek-V3 16B with the block Linears and the routed experts in NVFP4 (router gates, shared experts and LM
    head BF16), expert parallelism off."""
    return flagship(deepseek_v3_16b(), nvfp4_quantize(experts=True))


def gpt_oss_20b_bf16() -> NVFP4Trainer.Config:
    """gpt-oss 20B (MoE) in BF16: the control arm of gpt_oss_20b_nvfp4."""
    return flagship(gpt_oss_20b(), QuantizeConfig())


def gpt_oss_20b_nvfp4() -> NVFP4Trainer.Config:
    """gpt-oss 20B with the block Linears and the routed experts in NVFP4 (router gates, LM head BF16)."""
    return flagship(gpt_oss_20b(), nvfp4_quantize(experts=True))
