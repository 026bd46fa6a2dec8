"""Shared command-line conventions of the ``python -m titan_nvfp4...`` tools.

Usage names the module as it is run, the description is the module's whole docstring, and a bad input
(a missing file, an invalid spec) ends with one line on stderr and exit status 2, never a traceback. Outputs are
written atomically (tools/atomic.py) and never over an input.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn

from .atomic import refuse_output_over_input


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser for ``python -m <module>`` that prints ``doc`` as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_output(prog: str, path: Path, what: str = "output file", inputs: Iterable[Path] = ()) -> None:
    """``fail`` unless ``path`` can be created: its folder exists and is writable, it is not a folder itself, and
    it is none of ``inputs`` (nor a folder holding one)."""
    if path.is_dir():
        fail(prog, f"{what} {path} is a folder; name a file")
    if not path.parent.is_dir():
        fail(prog, f"{what} {path}: no such folder {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        fail(prog, f"{what} {path}: the folder {path.parent} is not writable")
    try:
        refuse_output_over_input(path, inputs, what)
    except ValueError as e:
        fail(prog, str(e))


@contextlib.contextmanager
def writing(prog: str, path: Path, what: str = "output file") -> Iterator[None]:
    """Around the atomic write of ``path``: a folder the system refuses to write in (read-only, even where
    os.access says writable, as for root; a full disk) ends ``prog`` with one line naming ``what`` and ``path``."""
    try:
        yield
    except OSError as e:
        fail(prog, f"{what} {path}: cannot write: {e.strerror or e}")


def require_inputs(prog: str, paths: list[Path], what: str = "file or folder") -> None:
    """``fail`` naming the first path of ``paths`` that does not exist."""
    for p in paths:
        if not p.exists():
            fail(prog, f"no such {what}: {p}")
