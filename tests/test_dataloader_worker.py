"""docs/performance.md advises TorchTitan's `[training.dataloader] num_workers = 1` (the data loader off the training
process: 10% of eager tokens/s on 2B_bench). What that claim rests on, with TorchTitan's own text dataloader over a
small registered corpus: the worker yields the same batches as the in-process loader, a resume from the worker
loader's state continues them, and a state saved by the in-process loader is refused by a worker loader (so a run
keeps the setting it started with)."""

from __future__ import annotations

import pytest
import torch

import titan_nvfp4.integration  # noqa: F401
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from text_corpus_helpers import register_corpus, unregister

NAME = "dataloader_worker_test"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    yield register_corpus(tmp_path_factory.mktemp("dataloader_worker"), NAME, docs=300, max_words=80)
    unregister(NAME)


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
