"""TorchTitan 0.2 integration: the job-config section, the model converter and extra Llama3 flavors.

Importing it registers the `quantize.linear.nvfp4` and `quantize.grouped_mm.nvfp4` converters and the flavors
with TorchTitan (the job file's ``custom_config_module``, titan_nvfp4.integration.job_config, imports it). On
another TorchTitan it raises an ImportError that names the installed version (0.3: titan_nvfp4.integration_v03).
"""

from ..integration_common.torchtitan_version import require_generation

require_generation("0.2")

from . import converter  # noqa: E402,F401  (registers the converters, the flavors and TorchTitan's fixes)
