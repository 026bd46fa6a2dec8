"""Autotuning choices shipped with the package: per GPU class, a table of (kernel, autotuning key) → the config
the autotuner picked there (titan_nvfp4/kernels/tuned/<class>.json, written by scripts/tune_kernels.py).

A cold start otherwise compiles and benchmarks every config of every autotuned kernel for every key its first
step meets (most of an NVFP4 job's first minute). A key found in the table launches the listed config
directly; a key not found autotunes as before. The listed config must be one of the kernel's own candidates
(each gives the same bits: tests/test_shipped_tuning.py), so a shipped choice can change speed, never results.

TITAN_NVFP4_SHIPPED_TUNING: unset or 1, the package's table for this GPU's class (none: autotune); 0, no
table; any other value, the path of a table file to use on every device (a regenerated one, or tests).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

ENV = "TITAN_NVFP4_SHIPPED_TUNING"
#: the folder of the shipped tables (package data: pyproject.toml's [tool.setuptools.package-data])
TABLE_DIR = Path(__file__).resolve().parent / "tuned"
FORMAT = 1
#: what a table entry may hold besides the meta-parameters, as triton.Config names them
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_KEY_TYPES = (bool, int, float, str, type(None))


def gpu_class(device_index: int) -> str | None:
    """The table name of a CUDA device: ``sm90`` for Hopper (H100, H200), ``sm<major><minor>`` for others;
    None on ROCm (no tables)."""
    if torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm{major}{minor}"


def table_path(device_index: int | None) -> Path | None:
    """The table that serves a device (None: a CPU launch or ROCm), or None: switched off, or no table shipped
    for its class."""
    setting = os.environ.get(ENV, "1")
    if setting in ("", "0"):
        return None
    if setting != "1":
        return Path(setting)
    if device_index is None:
        return None
    cls = gpu_class(device_index)
    path = TABLE_DIR / f"{cls}.json" if cls else None
    return path if path is not None and path.is_file() else None


def key_text(key: tuple) -> str:
    """How a table writes an autotuning key: its values as a JSON list."""
    return json.dumps(list(key))


def config_entry(config) -> dict:
    """A triton.Config as a table entry: its meta-parameters and launch options (None ones left out)."""
    entry = {"kwargs": dict(config.kwargs)}
    for name in _OPTIONS:
        value = getattr(config, name, None)
        if value is not None:
            entry[name] = value
    return entry


@functools.lru_cache(maxsize=None)
def load(path: Path) -> dict[str, dict[tuple, dict]]:
    """{kernel name: {key: config entry}} of a table file, its layout checked (ValueError naming the file and the
    entry); the entries are matched to each kernel's configs on its first lookup (``choice``)."""
    if not path.is_file():
        raise ValueError(f"{ENV}={path}: no such table file" if os.environ.get(ENV, "1") not in ("", "0", "1")
                         else f"shipped tuning table {path}: no such file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"shipped tuning table {path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("kernels"), dict):
        raise ValueError(f"shipped tuning table {path}: expected an object with \"format\": {FORMAT} and a "
                         f"\"kernels\" object")
    out: dict[str, dict[tuple, dict]] = {}
    for kernel, entries in doc["kernels"].items():
        if not isinstance(entries, dict):
            raise ValueError(f"shipped tuning table {path}: kernel {kernel!r}: expected an object of key → config")
        table = out[kernel] = {}
        for text, entry in entries.items():
            where = f"shipped tuning table {path}: kernel {kernel!r}, key {text}"
            try:
                key = json.loads(text)
            except json.JSONDecodeError:
                key = None
            if not isinstance(key, list) or not all(type(v) in _KEY_TYPES for v in key):
                raise ValueError(f"{where}: the key is not a JSON list of numbers, booleans and strings")
            if (not isinstance(entry, dict) or not isinstance(entry.get("kwargs"), dict)
                    or set(entry) - {"kwargs", *_OPTIONS}):
                raise ValueError(f"{where}: expected {{\"kwargs\": {{...}}, \"num_warps\": ..., ...}}, got {entry!r}")
            table[tuple(key)] = entry
    return out


def _matches(config, entry: dict) -> bool:
    return dict(config.kwargs) == entry["kwargs"] and all(
        getattr(config, name, None) == entry.get(name, getattr(config, name, None)) for name in _OPTIONS)


def choices(path: Path, kernel: str, configs) -> dict[tuple, object]:
    """{key: one of ``configs``} for ``kernel`` in the table at ``path``; a ValueError naming the file, kernel and
    key when an entry is none of the kernel's configs (a table from other configs: regenerate it)."""
    return _choices(path, kernel, tuple(configs))


@functools.lru_cache(maxsize=None)
def _choices(path: Path, kernel: str, configs: tuple) -> dict[tuple, object]:
    out = {}
    for key, entry in load(path).get(kernel, {}).items():
        found = [c for c in configs if _matches(c, entry)]
        if len(found) != 1:
            raise ValueError(f"shipped tuning table {path}: kernel {kernel!r}, key {key_text(key)}: {entry} is "
                             f"{'none' if not found else 'more than one'} of the kernel's {len(configs)} configs "
                             f"(regenerate the table: scripts/tune_kernels.py)")
        out[key] = found[0]
    return out


def clear() -> None:
    """Forget the tables read so far (after a table file or the environment variable changed)."""
    load.cache_clear()
    _choices.cache_clear()
