"""Registration of the offline corpora as TorchTitan datasets (``pystdlib``, ``pystdlib_validation`` and
``pystdlib_memorize`` here; ``pysources`` and ``pysources_validation`` through ``register_splits``, see
``pysources.py``).

``pystdlib_memorize`` is the leading documents of the shuffled pystdlib train split up to MEMORIZE_TOKENS
tokens (``variants.head``): a fixed corpus the debug models learn by heart within 10,000 steps, the regime where
a gap between NVFP4 and BF16 can show (issue 45). It is written next to the split on first use.

TorchTitan looks datasets up by name in ``torchtitan.hf_datasets.text_datasets.DATASETS``; each entry
gives a default path, a loader ``path -> datasets.Dataset`` and a per-sample text extractor. Our
loaders read the local JSON-lines files with ``datasets`` (nothing touches the network);
``training.dataset_path`` / ``validation.dataset_path`` may name another assets directory (read only when its
files match the sha256s of its manifest) or a ``.jsonl`` file (read as it is).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .assets import default_data_dir, ensure_assets
from .manifest import (DATA_FILES, MANIFEST, AssetsError, ManifestError, check_corpus, check_files, documents_total,
                       load_manifest)

logger = logging.getLogger(__name__)

TRAIN_NAME = "pystdlib"
VALIDATION_NAME = "pystdlib_validation"
_SPLIT_FILES = {TRAIN_NAME: "train.jsonl", VALIDATION_NAME: "validation.jsonl"}
MEMORIZE_NAME = "pystdlib_memorize"
MEMORIZE_TOKENS = 262_144  # 10,000 steps of 16 x 512 tokens pass over it ~310 times, as the published run did (issue 45)


def split_file(
    path: str | os.PathLike,
    split_filename: str,
    ensure: Callable[[Path], Path] | None = None,
    corpus_name: str = TRAIN_NAME,
) -> Path:
    """The JSONL file a dataset path stands for: the file itself, or ``split_filename`` in a directory.

    A directory that does not exist yet is built first by ``ensure`` (default: ``ensure_assets``, the
    pystdlib build; same lock), ``corpus_name`` names the corpus in the error message. A directory is read
    only when its data files have the sizes and sha256s its manifest records (an ``AssetsError`` says which
    does not, or that there is no manifest); a file is read as it is, unless its directory's manifest lists
    it, when it is checked the same way.
    """
    p = Path(path)
    if p.is_file():
        if p.name in DATA_FILES and (p.parent / MANIFEST).is_file():
            _verify(p.parent, "dataset path", (p.name,))
        return p
    if not p.exists():
        (ensure or ensure_assets)(p)
    f = p / split_filename
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: {p} is not a {corpus_name} assets directory")
    _verify(p, f"dataset path {p}")
    return f


def _verify(folder: Path, what: str, names: tuple[str, ...] = DATA_FILES) -> None:
    """Check ``names`` of ``folder`` against its manifest; errors start with ``what`` (the dataset path)."""
    try:
        check_files(folder, load_manifest(folder), names)
    except AssetsError as e:
        hint = ""
        if isinstance(e, ManifestError) and not (folder / MANIFEST).exists():
            hint = (", so its files cannot be checked; give a directory built by python -m titan_nvfp4.data.prepare, "
                    "or name a .jsonl file to read it as it is")
        raise type(e)(f"{what}: {e}{hint}") from None


def load_split(
    path: str,
    split_filename: str,
    ensure: Callable[[Path], Path] | None = None,
    corpus_name: str = TRAIN_NAME,
):
    """Load one split as a map-style ``datasets.Dataset`` with a single ``text`` column; a split checked against its
    folder's manifest logs that folder's corpus id first (``_check_and_log_corpus``)."""
    f = split_file(path, split_filename, ensure, corpus_name)
    if f.name in DATA_FILES and (f.parent / MANIFEST).is_file():
        _check_and_log_corpus(f)
    return _load_jsonl(f)


def _check_and_log_corpus(split: Path) -> None:
    """The line a job logs for each split it reads from an assets folder: which corpus ("corpus <id>", read back by
    the comparison runner), after checking it against ``$TITAN_NVFP4_CORPUS`` when that is set."""
    manifest = load_manifest(split.parent)
    ident = check_corpus(split.parent, manifest)
    tokens = manifest.get("tokens_estimate", {}).get("total")
    logger.info("Reading %s of %s: corpus %s (%s documents, %s tokens)", split.name, split.parent, ident,
                documents_total(manifest),
                f"~{tokens / 1e6:.2f}M" if isinstance(tokens, (int, float)) else "?")


def _load_jsonl(f: Path):
    from datasets import load_dataset

    logger.info("Loading %s", f)
    return load_dataset("json", data_files=str(f), split="train")


def memorize_split(path: str | os.PathLike, tokens: int = MEMORIZE_TOKENS) -> Path:
    """``<path>/memorize_<tokens>.jsonl``, the leading train documents up to ``tokens`` tokens of the corpus's own
    tokenizer, written on first use (whole, by an atomic rename: ranks that start together write the same bytes);
    a file path is taken as it is."""
    from .variants import head

    p = Path(path)
    if p.is_file():
        return p
    train = split_file(p, _SPLIT_FILES[TRAIN_NAME])  # builds the pystdlib assets when missing; checks them
    f = p / f"memorize_{tokens}.jsonl"  # assets.DERIVED: a rebuild of the directory removes it
    if not f.is_file():
        _, docs, total = head(train, f, tokens, p)  # written atomically
        logger.info("Wrote %s: %d documents, %d tokens", f, docs, total)
    return f


def load_memorize(path: str):
    """The memorize split (``memorize_split``) as a map-style ``datasets.Dataset``."""
    return _load_jsonl(memorize_split(path))


def sample_text(sample: dict[str, Any]) -> str:
    """The text of one JSONL record (TorchTitan's per-sample processor)."""
    return sample["text"]


def register_splits(
    split_files: dict[str, str],
    path: str | os.PathLike,
    ensure: Callable[[Path], Path] | None = None,
    corpus_name: str = TRAIN_NAME,
) -> None:
    """Add (or refresh) one TorchTitan dataset per ``{name: split_filename}`` reading ``path``; idempotent."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    for name, filename in split_files.items():
        DATASETS[name] = DatasetConfig(
            path=str(path),
            loader=functools.partial(load_split, split_filename=filename, ensure=ensure, corpus_name=corpus_name),
            sample_processor=sample_text,
        )


def register_datasets(data_dir: str | os.PathLike | None = None) -> None:
    """Add (or refresh) ``pystdlib`` / ``pystdlib_validation`` in TorchTitan's dataset table; idempotent."""
    path = str(Path(os.path.abspath(data_dir)) if data_dir is not None else default_data_dir())
    register_splits(_SPLIT_FILES, path)
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[MEMORIZE_NAME] = DatasetConfig(path=path, loader=load_memorize, sample_processor=sample_text)
