"""Atomic outputs for every tool: each file or folder is written beside its target under a temporary name and
moved into place with os.replace, so a kill mid-write leaves the old output (or none), never half of one; and an
output path that names one of the command's inputs is refused by name before anything is written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def _resolved(p: str | os.PathLike) -> Path:
    return Path(p).expanduser().resolve()


def refuse_output_over_input(output: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str) -> None:
    """Raise a ValueError when ``output`` (the value of ``option``) is one of ``inputs``, or a folder holding one
    (a folder output replaces what is in it)."""
    out = _resolved(output)
    for i in inputs:
        src = _resolved(i)
        if src == out or out in src.parents:
            raise ValueError(f"{option} {output} would overwrite the input {i}: give another path")


def _writable_parent(path: Path, option: str) -> Path:
    """The existing folder ``path`` is written into; a ValueError naming ``option`` when it is missing, not a folder,
    or not writable, or when ``path`` itself is an existing folder where a file is expected."""
    parent = path.parent
    if not parent.exists():
        raise ValueError(f"{option} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: the folder {parent} is not writable")
    return parent


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, option: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without an exception it replaces ``path``
    (os.replace), else it is removed and ``path`` is untouched. ``option`` names the argument in errors."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {target} is a folder; give a file path")
    parent = _writable_parent(target, option)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str, option: str = "output") -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_file(path, option) as tmp:
        tmp.write_text(text)


def write_bytes(path: str | os.PathLike, data: bytes, option: str = "output") -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_file(path, option) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, option: str = "output", replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; when the block succeeds it becomes ``path``. An existing
    ``path`` is refused unless ``replace`` (then it is swapped out only after the new folder is complete). On an
    exception the temporary folder is removed and ``path`` is untouched."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{option} {target} is a file; give a folder path")
    if target.exists() and not replace and any(target.iterdir()):
        raise ValueError(f"{option} {target} exists and is not empty; remove it or give another folder")
    parent = _writable_parent(target, option)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    old = None
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
            os.replace(target, old / "previous")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
