"""Registration of the offline corpora as TorchTitan datasets (``pystdlib`` and ``pystdlib_validation`` here;
``pysources`` and ``pysources_validation`` through ``register_splits``, see ``pysources.py``).

TorchTitan looks datasets up by name in ``torchtitan.hf_datasets.text_datasets.DATASETS``; each entry
gives a default path, a loader ``path -> datasets.Dataset`` and a per-sample text extractor. Our
loaders read the local JSON-lines files with ``datasets`` (nothing touches the network);
``training.dataset_path`` / ``validation.dataset_path`` may name another assets directory or a
``.jsonl`` file.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .assets import default_data_dir, ensure_assets

logger = logging.getLogger(__name__)

TRAIN_NAME = "pystdlib"
VALIDATION_NAME = "pystdlib_validation"
_SPLIT_FILES = {TRAIN_NAME: "train.jsonl", VALIDATION_NAME: "validation.jsonl"}


def split_file(
    path: str | os.PathLike,
    split_filename: str,
    ensure: Callable[[Path], Path] | None = None,
    corpus_name: str = TRAIN_NAME,
) -> Path:
    """The JSONL file a dataset path stands for: the file itself, or ``split_filename`` in a directory.

    A directory that does not exist yet is built first by ``ensure`` (default: ``ensure_assets``, the
    pystdlib build; same lock), ``corpus_name`` names the corpus in the error message.
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        (ensure or ensure_assets)(p)
    f = p / split_filename
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: {p} is not a {corpus_name} assets directory")
    return f


def load_split(
    path: str,
    split_filename: str,
    ensure: Callable[[Path], Path] | None = None,
    corpus_name: str = TRAIN_NAME,
):
    """Load one split as a map-style ``datasets.Dataset`` with a single ``text`` column."""
    from datasets import load_dataset

    f = split_file(path, split_filename, ensure, corpus_name)
    logger.info("Loading %s", f)
    return load_dataset("json", data_files=str(f), split="train")


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
