"""Import hook for jobs that train on the ``pysources`` corpus (see ``titan_nvfp4.data.pysources``).

Importing it builds the assets when missing (in ``$TITAN_NVFP4_PYSOURCES_DIR`` or ``./assets/pysources``;
minutes on first use, once for all ranks) and registers ``pysources`` / ``pysources_validation``::

    [experimental]
    custom_import = "titan_nvfp4.data.prepare_pysources"
    [model]
    hf_assets_path = "./assets/pysources"
    [training]
    dataset = "pysources"
"""

from .pysources import prepare_pysources

prepare_pysources()
