"""Transformer Engine's published NVFP4 reference quantizer, as a test-only oracle on a CPU machine.

The `transformer_engine` wheel (the test extra pins it; no dependencies) ships the pure-PyTorch reference
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, but importing the package needs TE's
CUDA core library. This loads that one file unmodified, with stand-ins for the two framework modules it
imports for its base classes (``quantized_tensor``, ``tensor.utils``), which hold no arithmetic.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

_PREFIX = "_te_reference"


def _package(name: str, path: Path | None) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)] if path else []
    sys.modules[name] = mod
    return mod


def load() -> types.ModuleType | None:
    """TE's ``reference_nvfp4`` module, or None when the transformer_engine wheel is not installed."""
    if f"{_PREFIX}.reference_nvfp4" in sys.modules:
        return sys.modules[f"{_PREFIX}.reference_nvfp4"]
    spec = importlib.util.find_spec("transformer_engine")  # finds the folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    recipes = root / "pytorch" / "custom_recipes"
    if not (recipes / "reference_nvfp4.py").is_file():
        return None

    class Quantizer:  # the base class's constructor: the two usage flags the reference reads
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    class QuantizedTensorStorage:
        pass

    saved = {k: sys.modules.get(k) for k in ("transformer_engine", "transformer_engine.pytorch",
                                             "transformer_engine.pytorch.custom_recipes",
                                             "transformer_engine.pytorch.quantized_tensor",
                                             "transformer_engine.pytorch.tensor",
                                             "transformer_engine.pytorch.tensor.utils")}
    try:
        _package("transformer_engine", root)
        _package("transformer_engine.pytorch", root / "pytorch")
        _package("transformer_engine.pytorch.custom_recipes", recipes)
        _package("transformer_engine.pytorch.tensor", None)
        qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
        qt.Quantizer, qt.QuantizedTensorStorage = Quantizer, QuantizedTensorStorage
        sys.modules[qt.__name__] = qt
        utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
        utils.is_custom = lambda x=None: getattr(x, "custom", False)
        sys.modules[utils.__name__] = utils
        ref = importlib.import_module("transformer_engine.pytorch.custom_recipes.reference_nvfp4")
    finally:  # leave no half-imported transformer_engine behind for other code
        for k in [k for k in sys.modules if k == "transformer_engine" or k.startswith("transformer_engine.")]:
            if k != "transformer_engine.pytorch.custom_recipes.reference_nvfp4":
                del sys.modules[k]
        for k, v in saved.items():
            if v is not None:
                sys.modules[k] = v
    sys.modules.pop("transformer_engine.pytorch.custom_recipes.reference_nvfp4", None)
    sys.modules[f"{_PREFIX}.reference_nvfp4"] = ref
    return ref


def wgrad_operand(x2d, signs):
    """TE's columnwise (wgrad) NVFP4 of x2d [M, K] with the RHT of sign vector ``signs``, 1×16 blocks:
    (codes [K, M/2] uint8, scales [K, M/16] float8_e4m3fn, tensor amax fp32 [1])."""
    import torch
    from unittest import mock

    ref = load()
    q = ref.NVFP4QuantizerRef(dtype=ref.reference_utils.Fp4Formats.E2M1, rowwise=False, columnwise=True,
                              quant_tile_shape=(1, 16), with_rht=True, with_random_sign_mask=True)
    with mock.patch.object(ref, "get_wgrad_sign_vector", lambda: signs.to(torch.float32).cpu()):
        _, _, qx_t, sx_t, _, amax_col = q._quantize(x2d)
    return qx_t, sx_t, amax_col
