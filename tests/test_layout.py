"""The package's import rules (docs/development.md "Import direction"), read from the source: every module
imports only its layer and those below, numerics/ needs no Triton, and no module imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titan_nvfp4"

#: every top-level module or sub-package of the package -> its layer; a module may import its own layer and those below
LAYERS = {
    "configs": 0,  # the recipe presets (data)
    "corpus_pin": 0,  # the corpus id's form and variable (no torch: a comparison spec's reader imports it)
    "numerics": 1,
    "recipe": 2,  # NVFP4Recipe, presets, the config sections' knobs, layer selection
    "kernels": 3,
    "ops": 4,
    "distributed": 5,
    "autograd": 6,
    "modules": 7,
    "training": 8,
    "conversion": 9,  # the framework-free entry point
    "integration": 10, "integration_v03": 10, "integration_common": 10, "data": 10, "tools": 10, "compare": 10,
    "__init__": 10,
}
NAMES = {0: "leaves", 1: "numerics", 2: "recipe", 3: "kernels", 4: "ops", 5: "distributed", 6: "autograd functions",
         7: "modules", 8: "training state", 9: "convert", 10: "integration"}


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


def _top(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_every_module_has_a_layer():
    assert sorted({_top(p) for p in PACKAGE.rglob("*.py")} - set(LAYERS)) == []


def test_imports_point_down():
    """numerics → kernels → ops → autograd functions → modules → integration; no Triton below the kernels, and
    TorchTitan only in the integration layer."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = LAYERS[_top(path)]
        for top, names, line in _imports(path):
            where = f"{path.relative_to(PACKAGE)}:{line} ({NAMES[me]})"
            if top == "<external>:triton" and me < LAYERS["kernels"]:
                bad.append(f"{where} imports triton")
            elif top == "<external>:torchtitan" and me < LAYERS["integration"]:
                bad.append(f"{where} imports torchtitan")
            elif not top.startswith("<external>") and LAYERS.get(top, 99) > me:
                bad.append(f"{where} imports {top} ({NAMES.get(LAYERS.get(top), 'unknown')})")
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
