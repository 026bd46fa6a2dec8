"""Recipe presets (``<name>.toml``) and comparison specs (``compare/<name>.toml``), shipped as package data.

Resolved by name through ``importlib.resources``: ``recipe = "nvidia_paper"`` in a job file, or
``python -m titan_nvfp4.compare llama3_debug``. This module imports nothing heavy, so a packaging check
can run it without torch.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def shipped(folder: str = "") -> dict[str, Traversable]:
    """The ``*.toml`` files of this package (or of its sub-folder ``folder``), by name without ``.toml``.

    Read through importlib.resources, never ``str()`` of a resource path, so a wheel, a zip or an editable
    install all work.
    """
    root = files(__name__)
    if folder:
        root = root / folder
    if not root.is_dir():
        return {}
    return {p.name[: -len(".toml")]: p for p in root.iterdir() if p.name.endswith(".toml") and p.is_file()}
