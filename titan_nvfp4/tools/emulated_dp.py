"""Train with the batches a wider data-parallel run would read: layouts compared on the same tokens.

    torchrun --nproc_per_node=1 -m titan_nvfp4.tools.emulated_dp --data-parallel 2 \\
        --job.config_file train_configs/deepseek_v3_nvfp4.toml [more TorchTitan flags]

TorchTitan gives data-parallel rank r of N the r-th contiguous 1/N of the training documents, so a
one-GPU run and an N-way run train on different batches and their losses differ by data order as well as
by layout. This launcher runs ``torchtitan.train`` unchanged except for its training dataloader: each
of the D real data-parallel ranks reads the N/D virtual ranks it stands for (rank r: virtual ranks
r*N/D ... (r+1)*N/D - 1), each with ``local_batch_size * D / N`` rows, and concatenates their batches in
rank order. A one-GPU run with ``--data-parallel 2`` and local batch 16 therefore trains on exactly the
tokens of a 2-way run with local batch 8, row for row. Validation is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from .cli import fail


class ConcatenatedDataLoader(BaseDataLoader):
    """Batches of several dataloaders concatenated along the batch dimension, in loader order.

    Ends when any loader ends. ``state_dict`` keeps each loader's state under its virtual rank, so a
    checkpoint of an emulated run resumes the same token stream.
    """

    def __init__(self, loaders: list, virtual_ranks: list[int]):
        if not loaders or len(loaders) != len(virtual_ranks):
            raise ValueError("ConcatenatedDataLoader: need one virtual rank per loader")
        self.loaders = loaders
        self.virtual_ranks = virtual_ranks

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for parts in zip(*self.loaders):
            inputs = [p[0] for p in parts]
            keys = inputs[0].keys()
            if any(x.keys() != keys for x in inputs):
                raise ValueError(f"emulated data parallel: loaders yield different input keys {[list(x) for x in inputs]}")
            yield ({k: torch.cat([x[k] for x in inputs]) for k in keys}, torch.cat([p[1] for p in parts]))

    def state_dict(self) -> dict[str, Any]:
        return {f"virtual_rank_{v}": ld.state_dict() for v, ld in zip(self.virtual_ranks, self.loaders)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for v, ld in zip(self.virtual_ranks, self.loaders):
            key = f"virtual_rank_{v}"
            if key not in state_dict:
                raise KeyError(f"emulated data parallel: checkpoint has no dataloader state for {key} "
                               f"(has {sorted(state_dict)}); was it saved with the same --data-parallel?")
            ld.load_state_dict(state_dict[key])


def emulate(build_dataloader_fn: Callable, data_parallel: int) -> Callable:
    """Wrap a TrainSpec's ``build_dataloader_fn`` so each real rank reads its share of ``data_parallel`` ranks."""
    if data_parallel < 1:
        raise ValueError(f"--data-parallel must be >= 1, got {data_parallel}")

    def build(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
        if data_parallel % dp_world_size:
            raise ValueError(f"--data-parallel {data_parallel} is not a multiple of this run's data-parallel "
                             f"degree {dp_world_size}")
        per_rank = data_parallel // dp_world_size
        batch = job_config.training.local_batch_size
        if batch % per_rank:
            raise ValueError(f"training.local_batch_size {batch} does not split into {per_rank} virtual ranks "
                             f"(--data-parallel {data_parallel} over {dp_world_size} real ranks)")
        sub_config = copy.copy(job_config)
        sub_config.training = dataclasses.replace(job_config.training, local_batch_size=batch // per_rank)
        virtual = [dp_rank * per_rank + i for i in range(per_rank)]
        loaders = [build_dataloader_fn(dp_world_size=data_parallel, dp_rank=v, tokenizer=tokenizer,
                                       job_config=sub_config, **kwargs) for v in virtual]
        logging.getLogger(__name__).warning(
            "emulated data parallel: this rank (%d of %d) trains on the batches of virtual ranks %s of %d, "
            "%d rows each", dp_rank, dp_world_size, virtual, data_parallel, batch // per_rank)
        return ConcatenatedDataLoader(loaders, virtual)

    return build


def patch_train_specs(data_parallel: int) -> None:
    """Make ``torchtitan.protocols.train_spec.get_train_spec`` hand out specs with emulated dataloaders."""
    from torchtitan.protocols import train_spec as ts

    original = ts.get_train_spec

    def get_train_spec(name: str):
        spec = original(name)
        if spec.build_dataloader_fn is None:
            raise ValueError(f"emulated data parallel: model {name!r} has no build_dataloader_fn")
        return dataclasses.replace(spec, build_dataloader_fn=emulate(spec.build_dataloader_fn, data_parallel))

    ts.get_train_spec = get_train_spec


PROG = "python -m titan_nvfp4.tools.emulated_dp"
USAGE = f"{PROG} --data-parallel N [TorchTitan flags]"


def pop_data_parallel(argv: list[str]) -> tuple[int, list[str]]:
    """Take ``--data-parallel N`` (or ``--data-parallel=N``) out of ``argv``; the rest goes to TorchTitan."""
    rest, value = [], None
    it = iter(argv)
    for a in it:
        if a == "--data-parallel":
            value = next(it, None)
            if value is None:
                fail(PROG, "--data-parallel needs a value")
        elif a.startswith("--data-parallel="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    if value is None:
        fail(PROG, f"--data-parallel N is required (usage: {USAGE})")
    try:
        n = int(value)
    except ValueError:
        fail(PROG, f"--data-parallel: {value!r} is not an integer")
    if n < 1:
        fail(PROG, f"--data-parallel must be >= 1, got {n}")
    return n, rest


_OWN_ERRORS = ("--data-parallel", "training.local_batch_size", "emulated data parallel")


def require_job_file(argv: list[str]) -> None:
    """``fail`` naming a ``--job.config_file`` that does not exist (TorchTitan would end with a traceback)."""
    for i, a in enumerate(argv):
        path = argv[i + 1] if a == "--job.config_file" and i + 1 < len(argv) else \
            a.split("=", 1)[1] if a.startswith("--job.config_file=") else None
        if path is not None and not Path(path).is_file():
            fail(PROG, f"--job.config_file {path}: no such file")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\n{__doc__}\n--data-parallel N   the data-parallel degree whose batches to train on "
              "(a positive integer)\nTorchTitan flags    as for torchtitan.train (--job.config_file ...; --help after "
              "--data-parallel N lists them)")
        return
    n, rest = pop_data_parallel(argv)
    require_job_file(rest)
    patch_train_specs(n)
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer, main as titan_main

    # ConfigManager.parse_args reads sys.argv[1:] bound when TorchTitan was imported: hand it ours.
    parse_args = ConfigManager.parse_args
    ConfigManager.parse_args = lambda self, args=None: parse_args(self, rest if args is None else args)

    try:
        titan_main(Trainer)
    except (ValueError, KeyError) as e:  # this launcher's own refusals (a batch that does not split, ...): one line
        message = str(e.args[0]) if e.args else ""
        if message.startswith(_OWN_ERRORS):
            fail(PROG, message)
        raise


if __name__ == "__main__":
    main()
