"""Shared command-line conventions of the ``python -m titan_nvfp4...`` tools.

Usage names the module as it is run, the description is the module's whole docstring, and a bad input
(a missing file, an invalid spec) ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser for ``python -m <module>`` that prints ``doc`` as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_output(prog: str, path: Path, what: str = "output file") -> None:
    """``fail`` unless ``path`` can be created: its folder exists and it is not a folder itself."""
    if path.is_dir():
        fail(prog, f"{what} {path} is a folder; name a file")
    if not path.parent.is_dir():
        fail(prog, f"{what} {path}: no such folder {path.parent}")


def require_inputs(prog: str, paths: list[Path], what: str = "file or folder") -> None:
    """``fail`` naming the first path of ``paths`` that does not exist."""
    for p in paths:
        if not p.exists():
            fail(prog, f"no such {what}: {p}")
