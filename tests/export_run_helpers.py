"""The tiny TorchTitan 0.2 Llama3 run the export and evaluation tests share (test_export_hf.py, test_eval_run.py):
its job file, a few training steps on the CPU checkpointed by TorchTitan's CheckpointManager as the Trainer does, the
model without converters, a tiny validation corpus, and TorchTitan's own Validator's loss on a model."""

from __future__ import annotations

import contextlib
import copy
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import titan_nvfp4.integration  # noqa: F401  (registers the converters)
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args
from export_helpers import job_head
from fake_trainer import FakeTrainer
from job_helpers import initialized, world1
from validator_helpers import cpu_validator, validate_on_cpu

FLAVOR = "export_hf_test"
#: 3 blocks (the last kept BF16 by bf16_last_blocks), GQA (4 heads, 2 KV heads: both q and k rows permuted)
ARGS = TransformerModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16,
                            rope_theta=500000)
SEQ = 32
STEPS = 3


def register_flavor() -> None:
    """The test flavor in TorchTitan's llama3 flavors (each process that builds the model from the job file)."""
    llama3_args.setdefault(FLAVOR, ARGS)


def job_toml(tmp: Path, assets: Path, extra: str = "") -> Path:
    """tmp/job.toml: the run's job file (NVFP4 Linears but the last block and the LM head, reference backend,
    a checkpoint every step); ``extra`` lines go to its [quantize.linear.nvfp4] section."""
    path = tmp / "job.toml"
    path.write_text(job_head(tmp, assets, "llama3", FLAVOR, ["quantize.linear.nvfp4"]) + textwrap.dedent(f"""\
        [optimizer]
        name = "AdamW"
        lr = 1e-2
        [training]
        seq_len = {SEQ}
        steps = 10
        mixed_precision_param = "bfloat16"
        [checkpoint]
        enable = true
        folder = "checkpoint"
        interval = 1
        keep_latest_k = 0
        [quantize.linear.nvfp4]
        recipe = "nvidia_paper"
        filter_fqns = ["output"]
        bf16_last_blocks = 1
        gemm_backend = "reference"
        """) + extra)
    return path


class _Data:
    def state_dict(self):
        return {"pos": 0}

    def load_state_dict(self, state_dict):
        pass


def random_tokens(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def checkpointer(cfg, model, tmp: Path, dims):
    """TorchTitan's CheckpointManager over ``model`` with AdamW and its LR schedule, as the Trainer builds it."""
    opt = build_optimizers([model], cfg.optimizer, dims)
    lr = build_lr_schedulers(opt, cfg.lr_scheduler, cfg.training.steps)
    trainer = FakeTrainer(model)
    ckpt = CheckpointManager(dataloader=_Data(), model_parts=[model], optimizers=opt, lr_schedulers=lr,
                             states={"train_state": trainer}, checkpoint_config=cfg.checkpoint, sd_adapter=None,
                             base_folder=str(tmp))
    return opt, lr, trainer, ckpt


def train(tmp: Path, job: Path, overrides: tuple[str, ...] = (), steps: int = STEPS):
    """The job's model trained ``steps`` steps on random tokens and checkpointed after each by TorchTitan's
    CheckpointManager (tmp/checkpoint/step-N), as the Trainer does; returns the model."""
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--job.config_file", str(job), *overrides])
    args = copy.deepcopy(llama3_args[FLAVOR])
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    model, converters = initialized(model, cfg)
    opt, lr, trainer, ckpt = checkpointer(cfg, model, tmp, world1())
    for step in range(1, steps + 1):
        tokens = random_tokens(step)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        lr.step()
        converters.post_optimizer_hook([model])
        opt.zero_grad()
        trainer.step = step
        ckpt.save(step)
    return model


def plain_llama(weights: dict[str, torch.Tensor]) -> Transformer:
    """TorchTitan's llama3 without converters (fp32) holding ``weights``."""
    args = copy.deepcopy(llama3_args[FLAVOR])
    args.max_seq_len = SEQ
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model.load_state_dict(weights)
    return model.eval()


def corpus_folder(folder: Path) -> Path:
    """A tiny text corpus in the test tokenizer's words, read by TorchTitan's c4_test dataset (load_dataset of a
    folder of JSON lines)."""
    folder.mkdir()
    g = torch.Generator().manual_seed(5)
    lines = [json.dumps({"text": " ".join(f"w{int(i)}" for i in torch.randint(3, 256, (40,), generator=g))})
             for _ in range(24)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@contextlib.contextmanager
def corpus_in(tmp: Path) -> Iterator[Path]:
    """corpus_folder(tmp/corpus), with datasets' cache kept in ``tmp`` and its progress bars off (they would write
    to a tool's stderr) while inside."""
    import datasets

    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp / "hf_cache"))
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield corpus_folder(tmp / "corpus")
    finally:
        mp.undo()
        if not bars:
            datasets.enable_progress_bars()


def validation_flags(corpus: Path) -> list[str]:
    """The [validation] flags of the runs: 3 batches of 2 x SEQ from ``corpus`` (TorchTitan's c4_test)."""
    return ["--validation.enable", "--validation.dataset", "c4_test", "--validation.dataset_path", str(corpus),
            "--validation.local_batch_size", "2", "--validation.seq_len", str(SEQ), "--validation.steps", "3"]


def validator_loss(job: Path, assets: Path, flags: list[str], model) -> float:
    """TorchTitan's own Validator (one CPU process) on ``model`` with the job's [validation] data: its logged loss."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--job.config_file", str(job), *flags])
    validator, logged = cpu_validator(cfg, HuggingFaceTokenizer(str(assets)))
    validate_on_cpu(validator, model, 3)
    return logged[0]
