"""TorchTitan 0.3 integration: an NVFP4 Linear for 0.3's Module protocol, a config-tree converter, a Trainer
with a `quantize` section and a config registry (``--module titan_nvfp4.integration_v03.configs``).

Importing it on another TorchTitan raises an ImportError that names the installed version.
"""

from ..integration_common.torchtitan_version import require_generation

require_generation("0.3")
