"""Package discovery for setuptools (the metadata is in pyproject.toml).

Every package under titan_nvfp4/ is found, none listed by hand; the repo's configs/ folder (recipe
presets, comparison specs) ships as the package ``titan_nvfp4.configs``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["titan_nvfp4", "titan_nvfp4.*"]) + ["titan_nvfp4.configs", "titan_nvfp4.configs.compare"],
    package_dir={"titan_nvfp4.configs": "configs"},
)
