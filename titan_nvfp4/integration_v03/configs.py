"""Config registry for TorchTitan 0.3: ``-m torchtitan.train --module titan_nvfp4.integration_v03.configs
--config llama3_debug_nvfp4`` (or its BF16 twin ``llama3_debug_bf16``; ``qwen3_debug_*`` for Qwen3's dense
debug model, ``qwen3_moe_debug_*``, ``deepseek_v3_debug_*`` and ``gpt_oss_debug_*`` for the MoE ones), on the
offline pystdlib corpus. One flagship each, NVFP4 and BF16: ``llama3_8b_*``, ``qwen3_30b_a3b_*``,
``deepseek_v3_16b_*``, ``gpt_oss_20b_*`` (upstream's configs, their parallelism included, on the offline corpus)."""

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


def _twins(name: str, upstream, what: str, experts: bool, make=nvfp4_trainer_config) -> None:
    """Define ``<name>_bf16`` and ``<name>_nvfp4`` in this module: ``upstream()`` through ``make``, with the
    Linears (and with ``experts`` the routed experts) in NVFP4 or everything BF16 (the control arm)."""
    def bf16() -> NVFP4Trainer.Config:
        return make(upstream(), QuantizeConfig())

    def nvfp4() -> NVFP4Trainer.Config:
        return make(upstream(), nvfp4_quantize(experts=experts))

    kept = "router gates, any shared experts and the LM head BF16" if experts else "the LM head stays BF16"
    parts = "block Linears and routed experts" if experts else "block Linears"
    docs = {"bf16": f"{what} in BF16: the control arm of {name}_nvfp4 (upstream: {upstream.__name__}).",
            "nvfp4": f"{what} with the {parts} in NVFP4, nvidia_paper recipe ({kept}; upstream: {upstream.__name__})."}
    for suffix, fn in (("bf16", bf16), ("nvfp4", nvfp4)):
        fn.__name__ = fn.__qualname__ = f"{name}_{suffix}"
        fn.__doc__ = docs[suffix]
        globals()[fn.__name__] = fn


_twins("llama3_debug", llama3_debugmodel, "Llama3 debugmodel", experts=False)
_twins("qwen3_debug", qwen3_debugmodel, "Qwen3 dense debugmodel", experts=False)
_twins("qwen3_moe_debug", qwen3_moe_debug, "Qwen3 MoE debug model", experts=True)
_twins("deepseek_v3_debug", deepseek_v3_debugmodel, "DeepSeek-V3 debug model", experts=True)
_twins("gpt_oss_debug", gpt_oss_debugmodel, "gpt-oss debug model", experts=True)
# one flagship per family
_twins("llama3_8b", llama3_8b, "Llama3 8B", experts=False)
_twins("qwen3_30b_a3b", qwen3_30b_a3b, "Qwen3 30B-A3B (MoE)", experts=True)
_twins("deepseek_v3_16b", deepseek_v3_16b, "DeepSeek-V3 16B (MoE)", experts=True)
_twins("gpt_oss_20b", gpt_oss_20b, "gpt-oss 20B (MoE)", experts=True)
