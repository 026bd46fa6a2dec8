"""The files of a Hugging Face model folder, written into a folder the caller made (export_hf writes into an
atomic_dir): config.json, safetensors shards with their index, the run's tokenizer files, generation_config.json.

Shards are written by safetensors' own ``save_file`` (metadata ``format = "pt"``, as transformers writes them),
named ``model-0000i-of-0000n.safetensors``, filled in key order up to ``max_shard_bytes`` each; the index
``model.safetensors.index.json`` maps every key to its shard and records the total size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

#: tokenizer files a Hugging Face folder may hold (whichever the run's hf_assets_path has are copied)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja")
#: those of them a tokenizer loads from (one is required)
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", re.I)
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of ``text`` such as "5GB", "500MB", "64KB" or "1000" (binary units); a ValueError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 64KB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_plan(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The keys of each shard, in ``state``'s order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        n = tensor_bytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def write_shards(folder: Path, state: dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    """Write ``state`` as safetensors shards with an index into ``folder``; returns the number of shards."""
    from safetensors.torch import save_file

    plan = shard_plan(state, max_shard_bytes)
    weight_map = {}
    for i, keys in enumerate(plan, 1):
        name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": sum(tensor_bytes(t) for t in state.values())}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return len(plan)


def tokenizer_files(assets: Path) -> list[str]:
    """The tokenizer files of ``assets`` (the job's hf_assets_path); a ValueError when it has no tokenizer to load."""
    if not assets.is_dir():
        raise ValueError(f"[model] hf_assets_path {assets}: no such folder (the run's tokenizer is exported from it)")
    if not any((assets / n).is_file() for n in TOKENIZER_MODELS):
        raise ValueError(f"[model] hf_assets_path {assets} has no tokenizer ({', '.join(TOKENIZER_MODELS)})")
    return [n for n in TOKENIZER_FILES if (assets / n).is_file()]


def copy_tokenizer(assets: Path, folder: Path) -> list[str]:
    """Copy the tokenizer files of ``assets`` into ``folder``; their names."""
    names = tokenizer_files(assets)
    for n in names:
        shutil.copyfile(assets / n, folder / n)
    return names


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


__all__ = ["INDEX", "TOKENIZER_FILES", "TOKENIZER_MODELS", "copy_tokenizer", "parse_size", "shard_plan",
           "tensor_bytes", "tokenizer_files", "write_json", "write_shards"]
