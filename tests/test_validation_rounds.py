"""TorchTitan 0.2.2's validator kept its dataloader's place between rounds: each validation read the held-out split
from where the last one stopped (one batch past it), and with ``steps = -1`` found it empty after the first round.
torchtitan_fixes rewinds the loader before every round (as TorchTitan PR #2791 rebuilds it upstream): every round
is over the same batches, the ones a fresh loader gives first."""

from __future__ import annotations


import pytest
import torch

import titan_nvfp4.integration  # noqa: F401  (applies the fixes)
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config import JobConfig
from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader
from text_corpus_helpers import register_corpus, unregister
from validator_helpers import cpu_validator, validate_on_cpu

NAME = "validation_rounds_test"


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A 40-document held-out split registered as a TorchTitan dataset, and its tokenizer."""
    yield register_corpus(tmp_path_factory.mktemp("validation_rounds"), NAME, docs=40, max_words=40)
    unregister(NAME)


class _Model(torch.nn.Module):
    """Logits from a fixed embedding and projection: a deterministic function of the batch."""

    def __init__(self, vocab: int = 256):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, 8, generator=g))
        self.out = torch.nn.Parameter(torch.randn(vocab, 8, generator=g))

    def forward(self, tokens):
        return self.emb[tokens] @ self.out.T

    def get_attention_masks(self, *args, **kwargs):  # as an SDPA model: the validator then builds none
        raise TypeError("SDPA attention takes no attention masks")


def _job(steps: int) -> JobConfig:
    cfg = JobConfig()
    cfg.validation.dataset, cfg.validation.local_batch_size, cfg.validation.seq_len = NAME, 2, 16
    cfg.validation.steps = steps
    return cfg


def _expected(cfg, tokenizer, model, steps: int | None) -> float:
    """The validator's loss over the first ``steps`` batches (None: all) of a fresh loader, computed here."""
    loader = build_text_validation_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=cfg,
                                              infinite=False)
    losses = []
    with torch.no_grad():
        for i, (inputs, labels) in enumerate(loader):
            if steps is not None and i == steps:
                break
            losses.append(cross_entropy_loss(model(inputs["input"]), labels) / labels.numel())
    return (torch.stack(losses).sum() / len(losses)).item()


@pytest.mark.parametrize("steps", [3, -1])
def test_every_validation_round_reads_the_same_batches(split, steps):
    cfg = _job(steps)
    model = _Model()
    validator, logged = cpu_validator(cfg, split)
    for step in (1, 250, 500):
        validate_on_cpu(validator, model, step)
    want = _expected(cfg, split, model, None if steps == -1 else steps)
    assert logged == [want] * 3  # unpatched: three different losses (steps 3), a failure in round 2 (steps -1)


def test_a_resumed_run_validates_on_the_batches_of_an_unbroken_one(split, monkeypatch):
    """TorchTitan checkpoints the training loader, not the validator's: a resumed process starts validating from
    the split's start. Unpatched, its round at step 500 then read other batches than an unbroken run's third round
    (the 386M study's arms, resumed at steps 1750, 2000 or 2250, read three different batch sets at step 3000);
    rewound, both read the same."""
    from torchtitan.components.validate import Validator

    from titan_nvfp4.integration import torchtitan_fixes

    cfg, model = _job(3), _Model()

    def losses(patched: bool) -> tuple[float, float]:
        if not patched:
            monkeypatch.setattr(Validator, "validate", torchtitan_fixes._original_validate)
        unbroken, logged = cpu_validator(cfg, split)
        for step in (1, 250, 500):
            validate_on_cpu(unbroken, model, step)
        resumed, logged_after = cpu_validator(cfg, split)  # a new process, resumed from a checkpoint at step 400
        validate_on_cpu(resumed, model, 500)
        monkeypatch.undo()
        return logged[-1], logged_after[-1]

    unbroken, resumed = losses(patched=True)
    assert unbroken == resumed == _expected(cfg, split, model, 3)
    unbroken, resumed = losses(patched=False)
    assert unbroken != resumed  # TorchTitan 0.2.2 on its own: the confound of the kept 386M runs
