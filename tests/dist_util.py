"""Test helper: run a worker function on N gloo ranks (CPU) and collect what rank 0 reports."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, worker, args, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        worker(rank, world, out, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world: int, *args) -> dict:
    """worker(rank, world, out, *args) on ``world`` gloo ranks; returns the dict the workers filled."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_entry, args=(world, port, worker, args, out), nprocs=world, join=True)
    return dict(out)
