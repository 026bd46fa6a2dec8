"""docs/performance.md advises TorchTitan's `[training.dataloader] num_workers = 1` (the data loader off the training
process: 10% of eager tokens/s on 2B_bench). What that claim rests on, with TorchTitan's own text dataloader over a
small registered corpus: the worker yields the same batches as the in-process loader, a resume from the worker
loader's state continues them, and a state saved by the in-process loader is refused by a worker loader (so a run
keeps the setting it started with)."""

from __future__ import annotations

import json
import random

import pytest
import torch

import titan_nvfp4.integration  # noqa: F401
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, build_text_dataloader
from export_helpers import tokenizer as make_tokenizer

WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
NAME = "dataloader_worker_test"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from datasets import load_dataset

    tmp = tmp_path_factory.mktemp("dataloader_worker")
    rng = random.Random(0)
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80)))}) + "\n"
                            for _ in range(300)))
    DATASETS[NAME] = DatasetConfig(path=str(path), loader=lambda p: load_dataset("json", data_files=p, split="train"),
                                   sample_processor=lambda s: s["text"])
    yield HuggingFaceTokenizer(str(make_tokenizer(tmp / "assets")))
    DATASETS.pop(NAME, None)


def _loader(tok, workers: int):
    cfg = JobConfig()
    cfg.training.dataset, cfg.training.local_batch_size, cfg.training.seq_len = NAME, 2, 32
    cfg.training.dataloader.num_workers = workers
    cfg.training.dataloader.persistent_workers = workers > 0
    return build_text_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tok, job_config=cfg)


def _take(it, n: int) -> list[torch.Tensor]:
    return [next(it)[0]["input"].clone() for _ in range(n)]


def test_one_worker_gives_the_same_batches_and_resumes_them(tok):
    ref = _take(iter(_loader(tok, 0)), 8)
    first = _loader(tok, 1)
    it = iter(first)
    assert all(torch.equal(a, b) for a, b in zip(_take(it, 4), ref[:4]))
    state = first.state_dict()
    resumed = _loader(tok, 1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_take(iter(resumed), 4), ref[4:]))

    in_process = _loader(tok, 0)
    _take(iter(in_process), 4)
    other = _loader(tok, 1)
    other.load_state_dict(in_process.state_dict())
    with pytest.raises(AssertionError, match="_snapshot"):  # at the first batch
        _take(iter(other), 1)
