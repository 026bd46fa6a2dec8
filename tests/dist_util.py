"""Test helper: run a worker function on N gloo ranks (CPU) and collect what rank 0 reports.

The ranks start from a fork server that has imported torch, TorchTitan's models and titan_nvfp4 once per
test process: a spawned rank would spend 8-10 s of CPU re-importing them (TorchTitan pulls in inductor),
most of the multi-process tests' time on CI's two cores. The server has run no torch op, so forking it
is as safe as spawning (no OpenMP or gloo state is inherited).
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import torch
import torch.multiprocessing as mp

import inspect_cache  # noqa: F401  (in the ranks too, as triton_interp)
import triton_interp  # noqa: F401  (in the ranks too: they import this module to run _entry)

PRELOAD = [
    "torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint",
    "torchtitan.models.llama3", "torchtitan.models.deepseek_v3", "torchtitan.models.gpt_oss",
    "titan_nvfp4", "titan_nvfp4.integration.converter",
]
#: the same for TorchTitan 0.3 (tests/test_torchtitan03.py): its config registry, llama3 and deepseek_v3
PRELOAD_V03 = [
    "torch", "torch.distributed.fsdp", "torchtitan.models.llama3", "torchtitan.models.deepseek_v3",
    "torchtitan.trainer",
    "titan_nvfp4", "titan_nvfp4.integration_v03.configs",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args: tuple, nprocs: int, preload: list[str] = PRELOAD) -> None:
    """``torch.multiprocessing.spawn``'s contract (fn(rank, *args), errors re-raised) from the preloaded fork server
    (one per test process: the first call's ``preload`` is the one it keeps; its hash seed is not this process's).
    On a GPU machine the ranks are spawned instead: a rank forked from a server whose imports touched CUDA cannot
    use CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on an H100, 2026-12-06)."""
    if torch.cuda.is_available():
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "2" if seed == "1" else "1"  # what the server starts with, if this call starts it
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
    finally:
        if seed is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = seed


def _entry(rank: int, world: int, port: int, worker, args, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        worker(rank, world, out, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world: int, *args, preload: list[str] = PRELOAD) -> dict:
    """worker(rank, world, out, *args) on ``world`` gloo ranks; returns the dict the workers filled."""
    manager = mp.Manager()
    out = manager.dict()
    spawn(_entry, (world, free_port(), worker, args, out), world, preload)
    return dict(out)
