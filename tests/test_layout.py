"""The package's import rules (docs/development.md "Import direction"), read from the source: the lower layers
import nothing above them, numerics/ needs no Triton, and no module imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "titan_nvfp4"

#: layer -> the package modules (first path component under titan_nvfp4/) its files may import
ALLOWED = {
    "platform.py": {"platform"},
    "numerics": {"numerics", "platform"},
    "kernels": {"numerics", "platform", "kernels"},
    "ops": {"numerics", "platform", "kernels", "ops"},
}


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(the imported package module, e.g. "ops" or "kernels", the names taken, line) of every relative import,
    and ("<external>:<top>", names, line) of absolute ones; at any depth (function-level imports included)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = list(rel.parts[: len(rel.parts) - node.level])  # the folder `level` dots point at
                target = base + (node.module.split(".") if node.module else [])
                top = target[0] if target else names[0]
                out.append((top.removesuffix(".py"), names, node.lineno))
            else:
                out.append((f"<external>:{node.module.split('.')[0]}", names, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((f"<external>:{a.name.split('.')[0]}", [], node.lineno) for a in node.names)
    return out


def _files(layer: str) -> list[Path]:
    root = PACKAGE / layer
    return [root] if root.is_file() else sorted(root.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_nothing_above_them(layer):
    bad = []
    for path in _files(layer):
        for top, names, line in _imports(path):
            if top.startswith("<external>"):
                if layer in ("numerics", "platform.py") and top == "<external>:triton":
                    bad.append(f"{path.relative_to(PACKAGE)}:{line} imports triton")
                continue
            if top not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {top}")
    assert not bad, bad


def test_no_module_imports_another_ones_private_names():
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports {n} from {top}"
           for path in sorted(PACKAGE.rglob("*.py"))
           for top, names, line in _imports(path) if not top.startswith("<external>")
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_the_checks_see_an_upward_and_a_private_import(tmp_path, monkeypatch):
    """The reader itself: a kernel file importing ops and a private name is caught."""
    fake = tmp_path / "titan_nvfp4"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "k.py").write_text("from ..ops.library import _hidden\nfrom .launch import launch\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    got = _imports(fake / "kernels" / "k.py")
    assert got == [("ops", ["_hidden"], 1), ("kernels", ["launch"], 2)]
