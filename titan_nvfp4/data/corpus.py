"""The offline text corpus: CPython's own standard-library sources plus its English pydoc topics.

Every Python install carries this text, so the default training data needs no download and no
third-party text in the repository. The corpus is a pure function of the interpreter it runs on:
files are read in sorted order, exact duplicates dropped, the documents shuffled with a fixed seed
(so neighbouring batches mix packages) and every ``VALIDATION_EVERY``-th document held out.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

SHUFFLE_SEED = 20250917
VALIDATION_EVERY = 100
# Directory names under the stdlib that are not the stdlib (installed packages, bytecode caches) or
# whose text reaches the corpus another way (pydoc_data is added topic by topic).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})


@dataclass
class Corpus:
    """Train and validation documents (one string each) plus counts describing how they were made."""

    train: list[str]
    validation: list[str]
    stats: dict = field(default_factory=dict)


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library (the corpus source)."""
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_sources(root: Path | None = None, stats: dict | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(relative_path, text)`` for each UTF-8 ``.py`` file under the stdlib, in sorted path order."""
    root = Path(root) if root is not None else stdlib_root()
    stats = stats if stats is not None else {}
    stats.setdefault("undecodable_files", 0)
    for dirpath, dirnames, filenames in os.walk(root):
        # os.walk visits subdirectories in the order left in `dirnames`: sort it for a stable order.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            try:
                with open(full, "rb") as fh:
                    text = fh.read().decode("utf-8")
            except UnicodeDecodeError:  # a few test fixtures are deliberately latin-1 etc.
                stats["undecodable_files"] += 1
                continue
            except OSError:  # dangling link or unreadable file: not part of a usable install
                continue
            yield os.path.relpath(full, root).replace(os.sep, "/"), text


def iter_pydoc_topics() -> Iterator[tuple[str, str]]:
    """Yield ``(topic, text)`` for the English language-reference topics shipped with pydoc, sorted."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # stripped-down installs may lack pydoc_data
        return
    for key in sorted(topics):
        yield f"pydoc:{key}", topics[key]


def collect_unique(sources: Iterable[tuple[str, Iterable[tuple[str, str]]]], counts: dict) -> list[str]:
    """Texts of ``sources`` (``(kind, items)`` pairs, items ``(name, text)``) in order, empty and repeated ones dropped.

    ``counts`` is updated in place: ``counts[kind]`` documents kept per kind, ``counts["duplicates"]``
    exact repeats (sha256 of the text) and ``counts["empty"]`` whitespace-only texts.
    """
    seen: set[str] = set()
    docs: list[str] = []
    for kind, items in sources:
        for _name, text in items:
            if not text.strip():  # empty __init__.py files would only contribute BOS/EOS
                counts["empty"] = counts.get("empty", 0) + 1
                continue
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if digest in seen:  # identical copies would leak train text into validation
                counts["duplicates"] = counts.get("duplicates", 0) + 1
                continue
            seen.add(digest)
            docs.append(text)
            counts[kind] = counts.get(kind, 0) + 1
    return docs


def split_documents(docs: list[str], seed: int, validation_every: int) -> tuple[list[str], list[str]]:
    """Shuffle ``docs`` in place with ``seed`` and return ``(train, validation)``: every
    ``validation_every``-th document of the shuffled order is held out (a split by document)."""
    random.Random(seed).shuffle(docs)
    validation = [d for i, d in enumerate(docs) if i % validation_every == validation_every - 1]
    train = [d for i, d in enumerate(docs) if i % validation_every != validation_every - 1]
    return train, validation


def build_corpus(seed: int = SHUFFLE_SEED, validation_every: int = VALIDATION_EVERY) -> Corpus:
    """Collect, dedupe, shuffle and split the stdlib/pydoc documents; deterministic per Python version."""
    stats: dict = {"stdlib_root": str(stdlib_root())}
    counts = {"stdlib_files": 0, "pydoc_topics": 0, "duplicates": 0, "empty": 0}
    sources: list[tuple[str, Iterable[tuple[str, str]]]] = [
        ("stdlib_files", iter_stdlib_sources(stats=stats)),
        ("pydoc_topics", iter_pydoc_topics()),
    ]
    docs = collect_unique(sources, counts)
    train, validation = split_documents(docs, seed, validation_every)
    stats.update(counts)
    return Corpus(train=train, validation=validation, stats=stats)


def jsonl_bytes(texts: Iterable[str]) -> bytes:
    """Serialise documents as JSON lines ``{"text": ...}`` exactly as they are written to disk."""
    return b"".join(
        (json.dumps({"text": t}, ensure_ascii=False) + "\n").encode("utf-8") for t in texts
    )


def corpus_sha256(corpus: Corpus) -> str:
    """Fingerprint of a corpus: sha256 of its train JSONL followed by its validation JSONL."""
    h = hashlib.sha256()
    h.update(jsonl_bytes(corpus.train))
    h.update(jsonl_bytes(corpus.validation))
    return h.hexdigest()


def read_jsonl(path: str | os.PathLike) -> list[str]:
    """Read the ``text`` field of every line of a JSON-lines file (used by tests and the CLI)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]
