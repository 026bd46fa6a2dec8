"""Compile the kernel specializations of a precompile manifest into Triton's cache, on several processes: what a
training process starts in the background at conversion (titan_nvfp4/kernels/precompile.py), or by hand to fill a
cache folder ahead of jobs.

    python -m titan_nvfp4.tools.precompile_kernels MANIFEST [--workers N] [--stop-with PID]

One compile per cache folder at a time (a lock file there: a second one finds it taken and exits 0). With
--stop-with, the compile ends when process PID (the training process that started it) is gone, also when that was
killed (torchrun ends a worker's process group; this one runs in its own session). Exit 0 when the manifest was
read (a kernel that fails to compile is reported and compiles on first use), 2 for an unreadable manifest, one of
another Triton version, or TRITON_INTERPRET set; one summary line on stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path

import triton

from ..kernels.precompile import compile_all, default_workers, load

LOCK_NAME = "titan_nvfp4_precompile.lock"


def _stop_with(pid: int) -> None:
    """End this compile (and its pool) once ``pid`` is no longer this process's parent."""
    def watch():
        while os.getppid() == pid:
            time.sleep(0.5)
        if os.getpgrp() == os.getpid():  # its own process group (as started by a training process): the pool too
            os.killpg(0, signal.SIGKILL)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _lock(cache_dir: str):
    """The open lock file of ``cache_dir``, held; None if another compile holds it."""
    os.makedirs(cache_dir, exist_ok=True)
    f = open(os.path.join(cache_dir, LOCK_NAME), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_nvfp4.tools.precompile_kernels",
                                description="Compile the kernels of a manifest into Triton's cache.")
    p.add_argument("manifest", type=Path)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--stop-with", type=int, metavar="PID", help="end when this parent process is gone")
    args = p.parse_args(argv)
    if args.stop_with is not None:
        _stop_with(args.stop_with)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("titan_nvfp4 precompile: TRITON_INTERPRET is set: the kernels run in Triton's interpreter, nothing to "
              "compile", file=sys.stderr)
        return 2
    try:
        doc = load(args.manifest)
    except ValueError as e:
        print(f"titan_nvfp4 precompile: {e}", file=sys.stderr)
        return 2
    if doc["triton"] != triton.__version__:
        print(f"titan_nvfp4 precompile: {args.manifest} is for Triton {doc['triton']}, this is {triton.__version__}: "
              "nothing compiled", file=sys.stderr)
        return 2
    from triton import knobs
    cache_dir = knobs.cache.dir
    try:
        lock = _lock(cache_dir)
    except OSError as e:
        print(f"titan_nvfp4 precompile: cache folder {cache_dir}: {e}", file=sys.stderr)
        return 2
    if lock is None:
        print(f"titan_nvfp4 precompile: another precompile is filling {cache_dir}: nothing to do", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    with lock:
        done, failures = compile_all(doc, args.workers)
    for f in failures[:3]:
        print(f"titan_nvfp4 precompile: failed: {f}", file=sys.stderr)
    failed = f" ({len(failures)} failed: they compile on first use)" if failures else ""
    print(f"titan_nvfp4 precompile: {done} of {len(doc['kernels'])} kernel specializations in Triton's cache after "
          f"{time.perf_counter() - t0:.1f} s on {args.workers} processes{failed}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
