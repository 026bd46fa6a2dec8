"""tests/inspect_cache.py: a class's source, or the OSError of a class without one, is what Python's own
inspect.getsource gives, again after its file changes."""

import dataclasses
import importlib.util
import inspect
import sys

import pytest

import inspect_cache  # noqa: F401  (installed by conftest.py too)


def _load(path, name, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_a_class_source_follows_its_file_and_equals_pythons(tmp_path, monkeypatch):
    assert getattr(inspect.getsource, "_titan_nvfp4", False)
    original = inspect.getsource.original
    path = tmp_path / "cached_mod.py"
    path.write_text("class A:\n    x: int = 1\n")
    first = _load(path, "cached_mod", monkeypatch).A
    assert inspect.getsource(first) == original(first) == "class A:\n    x: int = 1\n"
    path.write_text("class A:\n    x: int = 22\n")  # another size: another answer
    second = _load(path, "cached_mod", monkeypatch).A
    assert inspect.getsource(second) == original(second) == "class A:\n    x: int = 22\n"


def test_a_class_without_source_raises_the_same_oserror_each_time():
    made = dataclasses.make_dataclass("MergedJobConfig", [("a", int)])  # as TorchTitan's ConfigManager makes them
    for _ in range(2):
        with pytest.raises(OSError):
            inspect.getsource(made)
