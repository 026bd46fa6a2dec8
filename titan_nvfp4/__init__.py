"""titan-nvfp4: NVFP4 (4-bit) pretraining for TorchTitan.

With TorchTitan 0.2 installed, importing the package registers the `quantize.linear.nvfp4` and
`quantize.grouped_mm.nvfp4` model converters (titan_nvfp4.integration); TorchTitan 0.3 names
titan_nvfp4.integration_v03.configs on its command line instead. Without TorchTitan the numerics and
modules still work.
"""

from importlib.metadata import PackageNotFoundError, version

from .modules.decomposed_linear import DecomposedLinear
from .autograd.grouped_function import nvfp4_grouped_mm, nvfp4_grouped_mm_shared
from .autograd.linear_function import nvfp4_linear
from .conversion import convert
from .numerics import MXFP8Tensor, NVFP4Tensor, quantize_mxfp8, quantize_nvfp4, rht, rht_signs
from .modules.nvfp4_linear import NVFP4Linear
from .recipe.nvfp4_recipe import NVFP4Recipe, available_presets, build_recipe
from .training.step_state import TrainingSteps
from .integration_common.torchtitan_version import installed_generation

try:
    __version__ = version("titan-nvfp4")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

if installed_generation() == "0.2":  # TorchTitan 0.2 finds converters in its registry; 0.3 needs none
    from .integration import converter as _converter  # noqa: F401

__all__ = [
    "TrainingSteps",
    "convert",
    "DecomposedLinear",
    "MXFP8Tensor",
    "NVFP4Linear",
    "NVFP4Recipe",
    "NVFP4Tensor",
    "available_presets",
    "build_recipe",
    "nvfp4_grouped_mm",
    "nvfp4_grouped_mm_shared",
    "nvfp4_linear",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "rht",
    "rht_signs",
]
