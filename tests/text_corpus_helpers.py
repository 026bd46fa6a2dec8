"""A small random-word corpus registered as a TorchTitan dataset, with a tokenizer, for tests of TorchTitan's text
dataloaders (validation rounds, data-loader workers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from export_helpers import tokenizer as make_tokenizer

WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()


def register_corpus(folder: Path, name: str, docs: int, max_words: int) -> HuggingFaceTokenizer:
    """Write ``docs`` documents of 5..``max_words`` random words (seed 0) to folder/<name>.jsonl, register it in
    TorchTitan's DATASETS as ``name`` (``unregister`` removes it), and return a tokenizer for it."""
    from datasets import load_dataset

    rng = random.Random(0)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, max_words)))})
                            + "\n" for _ in range(docs)))
    DATASETS[name] = DatasetConfig(path=str(path), loader=lambda p: load_dataset("json", data_files=p, split="train"),
                                   sample_processor=lambda s: s["text"])
    return HuggingFaceTokenizer(str(make_tokenizer(folder / "assets")))


def unregister(name: str) -> None:
    DATASETS.pop(name, None)
