"""titan-nvfp4: NVFP4 (4-bit) pretraining for TorchTitan.

The package itself imports neither torch nor TorchTitan: its public names load on first use, so a command-line
tool (``python -m titan_nvfp4.compare``, ``titan_nvfp4.tools.loss_log``) imports only what it needs. TorchTitan 0.2
finds the `quantize.linear.nvfp4` and `quantize.grouped_mm.nvfp4` model converters once
titan_nvfp4.integration is imported, which the job file's ``custom_config_module`` does; TorchTitan 0.3
names titan_nvfp4.integration_v03.configs on its command line instead.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("titan-nvfp4")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

# public name -> the module that defines it (imported on first access, PEP 562)
_EXPORTS = {
    "TrainingSteps": ".training.step_state",
    "convert": ".conversion",
    "DecomposedLinear": ".modules.decomposed_linear",
    "MXFP8Tensor": ".numerics",
    "NVFP4Linear": ".modules.nvfp4_linear",
    "NVFP4Recipe": ".recipe.nvfp4_recipe",
    "NVFP4Tensor": ".numerics",
    "available_presets": ".recipe.nvfp4_recipe",
    "build_recipe": ".recipe.nvfp4_recipe",
    "nvfp4_grouped_mm": ".autograd.grouped_function",
    "nvfp4_grouped_mm_shared": ".autograd.grouped_function",
    "nvfp4_linear": ".autograd.linear_function",
    "quantize_mxfp8": ".numerics",
    "quantize_nvfp4": ".numerics",
    "rht": ".numerics",
    "rht_signs": ".numerics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titan_nvfp4' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
