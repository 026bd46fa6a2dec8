"""A one-block Llama3 trained and checkpointed through TorchTitan's CheckpointManager (DCP), shared by the
checkpoint tests."""

from __future__ import annotations
import copy
import dataclasses
import functools
import torch
import titan_nvfp4.integration  # noqa: F401  (registers the converters, patches the CheckpointManager)
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.protocols.model_converter import build_model_converters
from job_helpers import parse, world1
from fake_trainer import FakeTrainer


ARGS = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=256, multiple_of=16, max_seq_len=32)


REF = {"gemm_backend": "reference"}  # stochastic rounding on (the preset), so resumes test the SR counts


LORA = {**REF, "lora_rank": 16}


BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
         "feed_forward.w3")


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))


class Data:
    """The dataloader's checkpoint entry."""

    def state_dict(self):
        return {"pos": 0}

    def load_state_dict(self, state_dict):
        pass


@functools.cache
def parsed_job():
    return parse()  # once: TorchTitan's parser takes about a second


def job_cfg_for(keys: dict | None, folder: str, initial: str | None, initial_model_only: bool = True):
    """The job file's config with a CheckpointManager on ``folder`` (saving every step) and these
    [quantize.linear.nvfp4] keys (the section rebuilt, so its checks run as at parse time)."""
    cfg = copy.deepcopy(parsed_job())
    ck = cfg.checkpoint
    ck.enable, ck.folder, ck.interval, ck.keep_latest_k, ck.initial_load_path = True, folder, 1, 0, initial
    ck.initial_load_model_only = initial_model_only
    cfg.quantize.linear.nvfp4 = dataclasses.replace(cfg.quantize.linear.nvfp4, **(keys or {}))
    return cfg


class Job:
    """A TorchTitan job as far as checkpoints go: the tiny Llama3 (BF16 when ``keys`` is None, else
    converted with these [quantize.linear.nvfp4] keys), AdamW, LR schedule and train_state, with a
    CheckpointManager on ``tmp/folder``; ``initial``: checkpoint.initial_load_path (model only unless
    ``initial_model_only`` is False: the whole training state, as a branching comparison arm loads it); ``args``: the
    model's."""

    def __init__(self, tmp, keys=LORA, folder="ckpt", initial=None, dims=None, shard=None, seed=0, args=ARGS,
                 initial_model_only=True):
        cfg = job_cfg_for(keys, folder, initial, initial_model_only)
        dims = dims or world1()
        with torch.device("meta"):
            self.model = Transformer(copy.deepcopy(args))
        self.converters = build_model_converters(cfg, dims) if keys is not None else None
        if self.converters is not None:
            self.converters.convert(self.model)
        if shard is not None:
            shard(self.model)
        self.model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            self.model.init_weights(buffer_device=None)
        self.opt = build_optimizers([self.model], cfg.optimizer, dims)
        self.lr = build_lr_schedulers(self.opt, cfg.lr_scheduler, cfg.training.steps)
        self.trainer = FakeTrainer(self.model)
        self.ckpt = CheckpointManager(dataloader=Data(), model_parts=[self.model], optimizers=self.opt,
                                      lr_schedulers=self.lr, states={"train_state": self.trainer},
                                      checkpoint_config=cfg.checkpoint, sd_adapter=None, base_folder=str(tmp))

    def step(self, tokens) -> torch.Tensor:
        loss = self.model(tokens).float().square().mean()
        loss.backward()
        self.opt.step()
        self.lr.step()
        if self.converters is not None:
            self.converters.post_optimizer_hook([self.model])
        self.opt.zero_grad()
        self.trainer.step += 1
        return loss.detach()

    def save(self) -> str:
        self.ckpt.save(self.trainer.step)
        return str(self.ckpt.folder) + f"/step-{self.trainer.step}"

    def load(self) -> None:
        assert self.ckpt.load()

    def linear(self, name: str, block: str = "0"):
        return self.model.layers[block].get_submodule(name)
