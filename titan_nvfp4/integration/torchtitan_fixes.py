"""Backports of TorchTitan fixes that this project's comparisons depend on, for torchtitan 0.2.x.

Applied once when the integration is imported; every job file here loads it (BF16 twins included,
through `custom_config_module`), so both arms of a comparison run the same model code.

  * Router gate bias (TorchTitan PR #2450, after 0.2.2): gpt-oss's router gate has a bias that
    ``TokenChoiceTopKRouter.init_weights`` never initializes, so a meta-device model starts from
    whatever to_empty() left in memory (NaN under deterministic mode). It is zeroed after the
    weight's initialization, as upstream now does; a version that already zeroes it is unaffected.

  * Validation for the MoE models: TorchTitan's deepseek_v3 and gpt_oss train specs have no
    ``build_validator_fn``, so ``[validation] enable = true`` fails on an assertion. Those two get
    TorchTitan's own text validator (forward and the training loss on the validation split, as for
    llama3 and qwen3); a spec that has a validator keeps it. That validator builds flex-attention
    masks whenever the model has ``get_attention_masks``, which DeepSeek-V3's SDPA attention rejects
    (it asserts ``attention_masks is None``); like the Trainer, ours builds them only for flex/varlen.

  * Validation under CUDA-graph trees (``TORCHINDUCTOR_CUDAGRAPHS=1`` with ``--compile.enable``, the
    comparison runner's default mode): TorchTitan's validator runs the compiled model batch after batch
    under no_grad, and each batch's graph replay overwrites the outputs the last one still reads
    ("accessing tensor output of CUDAGraphs that has been overwritten"). Every validation forward now
    starts a new graph step (``torch.compiler.cudagraph_mark_step_begin``), as PyTorch asks of such loops.

  * The same validation batches every round (TorchTitan PR #2791, after 0.2.2; issue #2636): the validator's
    dataloader keeps its place between rounds, so each validation read the split from where the last one
    stopped (one batch past it, which the last round fetched and dropped) and, with ``steps = -1``, found it
    empty after the first round. Each round now starts the loader from its state before the first round, as
    upstream rebuilds it, so every validation loss of a run is over the same held-out batches.

  * Attention masks under CUDA-graph trees: TorchTitan compiles ``create_block_mask`` once for all masks,
    with Inductor's global options, so under ``TORCHINDUCTOR_CUDAGRAPHS=1`` the masks are outputs of graph
    replays. gpt_oss (sliding window and causal) and llama4 (rope and nope) build two masks per step, and the
    second replay overwrites the first mask before attention reads it ("accessing tensor output of CUDAGraphs
    that has been overwritten", gpt_oss on an H100, 2026-11-28). Masks are now built by a
    ``create_block_mask`` compiled without CUDA graphs (a mask is built once per step: the graphs saved nothing).
    tests/test_gpu.py's gpt_oss graph-trees case: the same losses with and without the graphs (H100, 2026-11-28).

And extensions: the Trainer's checkpointed ``train_state`` also carries the NVFP4 layers'
stochastic-rounding call counts, so a resumed run draws the same random numbers (train_state.py); the
CheckpointManager saves low-rank layers' current W and checks a checkpoint against the job before DCP
loads it (checkpoint.py).
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.components.validate import Validator
from torchtitan.models import attention as _attention
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

_original_router_init = TokenChoiceTopKRouter.init_weights


def _router_init_weights(self, *args, **kwargs):
    out = _original_router_init(self, *args, **kwargs)
    bias = getattr(self.gate, "bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.zero_()
    return out


#: TorchTitan's compiled create_block_mask, and ours: the same function compiled without CUDA graphs
_original_mask_builder = getattr(_attention, "_compiled_create_block_mask", None)


def compile_mask_builder():
    """create_block_mask compiled with CUDA graphs off, whatever TORCHINDUCTOR_CUDAGRAPHS says."""
    return torch.compile(create_block_mask, options={"triton.cudagraphs": False})


mask_builder_without_graphs = compile_mask_builder()

_MODELS_WITHOUT_VALIDATOR = ("deepseek_v3", "gpt_oss")


class _NoMasks:
    """Stands in for the model where no attention masks are wanted: TorchTitan's Validator leaves the
    masks out when ``get_attention_masks`` raises TypeError."""

    def get_attention_masks(self, *args, **kwargs):
        raise TypeError("SDPA attention takes no attention masks")


class TextValidator(Validator):
    """TorchTitan's Validator, building attention masks only for flex/varlen attention, as TorchTitan's
    Trainer does for training batches. Built with the Trainer's keywords, so the class is the builder."""

    def post_dataloading_process(self, input_dict, labels, model_parts):
        attn = getattr(getattr(model_parts[0], "model_args", None), "attn_type", "sdpa")
        parts = model_parts if attn in ("flex", "varlen") else [_NoMasks()]
        return super().post_dataloading_process(input_dict, labels, parts)


_original_validate = Validator.validate


def _graph_step(module, args):
    """Forward pre-hook: the forward starts a new CUDA-graph-trees step (nothing to do without the trees)."""
    if _cudagraph_trees_on():
        torch.compiler.cudagraph_mark_step_begin()


def _cudagraph_trees_on() -> bool:
    inductor_config = sys.modules.get("torch._inductor.config")  # unimported: nothing compiled, no trees
    return inductor_config is not None and bool(inductor_config.triton.cudagraphs) and \
        bool(inductor_config.triton.cudagraph_trees)


def _rewind(validator) -> None:
    """Start the validator's dataloader where it stood before its first round (a stateful loader: its state
    then, kept on the validator; a loader without state is left as it is)."""
    loader = getattr(validator, "validation_dataloader", None)
    if loader is None or not hasattr(loader, "state_dict") or not hasattr(loader, "load_state_dict"):
        return
    start = getattr(validator, "_nvfp4_validation_start", None)
    if start is None:
        validator._nvfp4_validation_start = loader.state_dict()
    else:
        loader.load_state_dict(start)


def _validate_in_graph_steps(self, model_parts, *args, **kwargs):
    """Validator.validate over the same batches every round, each model part's forward starting a new
    CUDA-graph step."""
    _rewind(self)
    handles = [m.register_forward_pre_hook(_graph_step) for m in model_parts]
    try:
        return _original_validate(self, model_parts, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def _with_text_validator(get_train_spec):
    """``get_train_spec`` whose spec falls back to ``TextValidator`` when it has no validator."""

    @functools.wraps(get_train_spec)
    def wrapped():
        spec = get_train_spec()
        if spec.build_validator_fn is None:
            spec.build_validator_fn = TextValidator
        return spec

    wrapped._nvfp4_text_validator = True
    return wrapped


def apply() -> None:
    """Install the backports (idempotent)."""
    if TokenChoiceTopKRouter.init_weights is _original_router_init:
        TokenChoiceTopKRouter.init_weights = _router_init_weights
    if Validator.validate is _original_validate:
        Validator.validate = _validate_in_graph_steps
    if _original_mask_builder is not None and _attention._compiled_create_block_mask is _original_mask_builder:
        _attention._compiled_create_block_mask = mask_builder_without_graphs
    for name in _MODELS_WITHOUT_VALIDATOR:
        module = importlib.import_module(f"torchtitan.models.{name}")
        if not getattr(module.get_train_spec, "_nvfp4_text_validator", False):
            module.get_train_spec = _with_text_validator(module.get_train_spec)
    from . import checkpoint
    from .train_state import install_on_running_trainers

    install_on_running_trainers()
    checkpoint.install()
