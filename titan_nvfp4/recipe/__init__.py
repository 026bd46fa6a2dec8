"""The recipe layer: what each NVFP4 GEMM does (NVFP4Recipe and its presets), the config-section knobs shared by
both TorchTitan generations, and which layers a conversion keeps in high precision. Imports only numerics."""

from .nvfp4_recipe import (NVFP4Recipe, available_presets, build_recipe, load_preset, shipped_compare_specs,
                           validate_field)

__all__ = ["NVFP4Recipe", "available_presets", "build_recipe", "load_preset", "shipped_compare_specs",
           "validate_field"]
