"""TorchTitan 0.2 integration: the job-config section, the model converter and extra Llama3 flavors.

Importing it on another TorchTitan raises an ImportError that names the installed version (0.3:
titan_nvfp4.integration_v03).
"""

from ..integration_common.torchtitan_version import require_generation

require_generation("0.2")
