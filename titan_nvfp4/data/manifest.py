"""The manifest of an assets folder, read strictly, and the check of the folder's files against it.

``manifest.json`` records each data file's size (``file_bytes``) and sha256 (``sha256``). A folder is
reused, or read as a ``dataset_path``, only when every data file has both: a same-size edit or a truncated
copy is caught by content, not by size alone. Hashing costs about 0.2 s per 100 MB (one core, warm page
cache); each process hashes a file once per (device, inode, size, mtime, ctime): any write changes the
ctime, which no user call can set back, so a cached hash is never that of other bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..corpus_pin import CORPUS_ENV_VAR, CORPUS_ID

MANIFEST = "manifest.json"
DATA_FILES = ("train.jsonl", "validation.jsonl", "tokenizer.json", "tokenizer_config.json")

_hashes: dict[tuple, str] = {}  # (realpath, dev, ino, size, mtime_ns, ctime_ns) -> sha256, this process only


class AssetsError(ValueError):
    """An assets folder, its manifest, its lock or a setting naming it cannot be used; the message says which and why."""


class ManifestError(AssetsError):
    """``manifest.json`` is missing, unreadable, not JSON or lacks an entry the check needs."""


class ContentMismatch(AssetsError):
    """A data file is missing, or its size or sha256 is not the one its manifest records."""


def load_manifest(folder: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of ``folder``; a ManifestError naming the file and why when it cannot be."""
    path = Path(folder) / MANIFEST
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise ManifestError(f"{folder} has no {MANIFEST}") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path}: holds a JSON {type(manifest).__name__}, not an object")
    return manifest


def corpus_id(manifest: dict) -> str:
    """Twelve hex digits naming what a run trains on: the sha256 of the data files' sha256s (both splits and the
    tokenizer). Logged for each split a job reads (data/registry.py), so runs on different corpora are told apart
    (the comparison runner)."""
    sha = _entries(manifest, "sha256", str, Path(MANIFEST))
    return hashlib.sha256("".join(sha[name] for name in DATA_FILES).encode()).hexdigest()[:12]


def documents_total(manifest: dict) -> object:
    """The corpus's document count as the manifest records it ("?" when it records none), for log lines."""
    return manifest.get("documents", {}).get("total", "?")


def check_corpus(folder: str | os.PathLike, manifest: dict) -> str:
    """The corpus id of ``folder``; an AssetsError naming both ids when ``$TITAN_NVFP4_CORPUS`` asks for another (a
    series of runs pinned to one corpus, whichever machine builds it), or naming the variable when it is malformed."""
    got = corpus_id(manifest)
    want = os.environ.get(CORPUS_ENV_VAR, "").strip()
    if want and not CORPUS_ID.fullmatch(want):
        raise AssetsError(f"{CORPUS_ENV_VAR}={want!r}: not a corpus id (12 lowercase hex digits, as jobs log them)")
    if want and got != want:
        raise AssetsError(f"{folder}: corpus {got} ({documents_total(manifest)} documents), but {CORPUS_ENV_VAR} "
                          f"asks for corpus {want}: this machine built other data (another package set or version?); "
                          "unset it to train anyway")
    return got


def _entries(manifest: dict, key: str, kind: type, path: Path) -> dict:
    value = manifest.get(key)
    if not isinstance(value, dict):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ManifestError(f"{path}: '{key}' is {got}, not an object of file names")
    for name in DATA_FILES:
        if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
            raise ManifestError(f"{path}: '{key}' has no {kind.__name__} entry for {name}")
    return value


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file at ``path``, remembered per (device, inode, size, mtime, ctime) for this process."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _hashes:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def check_files(folder: str | os.PathLike, manifest: dict, names: tuple[str, ...] = DATA_FILES) -> None:
    """Raise ContentMismatch naming the first of the data files ``names`` of ``folder`` that is missing or whose
    size or sha256 differs from ``manifest``'s (ManifestError when the manifest lacks the entries)."""
    where = Path(folder) / MANIFEST
    sizes = _entries(manifest, "file_bytes", int, where)
    hashes = _entries(manifest, "sha256", str, where)
    for name in names:
        f = Path(folder) / name
        if not f.is_file():
            raise ContentMismatch(f"{f}: missing ({MANIFEST} lists it)")
        size = f.stat().st_size
        if size != sizes[name]:
            raise ContentMismatch(f"{f}: {size:,} bytes, {MANIFEST} records {sizes[name]:,} (truncated or edited)")
        try:
            digest = file_sha256(f)
        except OSError as e:
            raise ContentMismatch(f"{f}: cannot be read ({e.strerror})") from None
        if digest != hashes[name]:
            raise ContentMismatch(f"{f}: sha256 {digest[:16]} is not the {hashes[name][:16]} {MANIFEST} records "
                                  f"(edited or corrupt, same size)")


def verify_folder(folder: str | os.PathLike) -> dict:
    """The manifest of ``folder`` after checking every data file against it (ManifestError, ContentMismatch)."""
    manifest = load_manifest(folder)
    check_files(folder, manifest)
    return manifest
