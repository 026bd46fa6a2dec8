"""The test suite's own import rule: no file under tests/ imports a test module (test_*.py). What several test
files share lives in a helpers module (job_helpers.py, moe_helpers.py, kernel_helpers.py, ...) or, for fixtures,
in conftest.py, so running or collecting one test file never runs another's module code."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``test_*`` module in ``source``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.extend((node.lineno, n) for n in names if n.split(".")[0].startswith("test_"))
    return sorted(out)


def test_the_check_finds_imports_of_test_modules():
    src = "import os\nfrom test_a import b\n\ndef f():\n    import test_c as c\n    from pairwise import x\n"
    assert imports_of_test_modules(src) == [(2, "test_a"), (5, "test_c")]


def test_no_test_file_imports_another_test_module():
    bad = [f"tests/{path.relative_to(TESTS)}:{line} imports {module}"
           for path in sorted(TESTS.rglob("*.py"))
           for line, module in imports_of_test_modules(path.read_text(encoding="utf-8"))]
    assert not bad, "move what they share into a helpers module or conftest.py:\n" + "\n".join(bad)
