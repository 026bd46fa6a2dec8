"""The background compile of a precompile manifest as a process (precompile.py): a fork of the training process, or
the command-line tool's own process (tools/precompile_kernels.py). A fork starts no interpreter and imports nothing:
a fresh ``python -m`` cost 7-8 s on the GPU machine before it compiled anything, warm caches included, all of it on
the first step's path. One compile of a selection per cache folder at a time, and it ends with the process that
started it."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

from .precompile import compile_all, identity

LOCK_NAME = "titan_nvfp4_precompile.lock"


_in_fork = False


def say(line: str) -> None:
    """One line on stderr; in a fork written to the file descriptor directly (it takes no lock a thread of its parent
    may have held)."""
    text = f"titan_nvfp4 precompile: {line}\n"
    if _in_fork:
        os.write(2, text.encode())
    else:
        sys.stderr.write(text)
        sys.stderr.flush()


def stop_with(pid: int) -> None:
    """End this compile (and its pool) once ``pid`` is no longer this process's parent."""
    def watch():
        while os.getppid() == pid:
            time.sleep(0.5)
        if os.getpgrp() == os.getpid():  # its own process group (as started by a training process): the pool too
            os.killpg(0, signal.SIGKILL)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def lock(cache_dir: str, name: str = LOCK_NAME):
    """The open lock file ``name`` of ``cache_dir``, held; None if another compile holds it."""
    os.makedirs(cache_dir, exist_ok=True)
    f = open(os.path.join(cache_dir, name), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def lock_name(doc: dict, only: list[int] | None) -> str:
    """The whole manifest's lock, or one per selection (of what the selected entries compile)."""
    if only is None:
        return LOCK_NAME
    digest = hashlib.sha256("\n".join(sorted(identity(doc["kernels"][i]) for i in only)).encode()).hexdigest()
    return LOCK_NAME.replace(".lock", f".{digest[:16]}.lock")


def fill(doc: dict, workers: int, only: list[int] | None) -> int:
    """Compile the manifest's entries (those at ``only``) into Triton's cache folder under its lock, with one summary
    line; the exit code (0 also when some failed: they compile on first use; 2 when the folder cannot be used)."""
    from triton import knobs
    cache_dir = knobs.cache.dir
    try:
        held = lock(cache_dir, lock_name(doc, only))
    except OSError as e:
        say(f"cache folder {cache_dir}: {e}")
        return 2
    if held is None:
        say(f"another precompile is filling {cache_dir}: nothing to do")
        return 0
    t0 = time.perf_counter()
    with held:
        done, failures = compile_all(doc, workers, only)
    for f in failures[:3]:
        say(f"failed: {f}")
    failed = f" ({len(failures)} failed: they compile on first use)" if failures else ""
    say(f"{done} of {len(doc['kernels']) if only is None else len(only)} kernel specializations in Triton's cache "
        f"after {time.perf_counter() - t0:.1f} s on {workers} processes{failed}")
    return 0


class ForkedCompile:
    """A forked compile, watched as a subprocess.Popen is (pid, poll, wait, returncode); ``only`` its selection."""

    def __init__(self, pid: int, only: list[int] | None):
        self.pid, self.only, self.returncode = pid, only, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored, a waitpid(-1)): it has ended
                pid, status = self.pid, None
            if pid:
                self.returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"precompile (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode


def fork(doc: dict, workers: int, only: list[int] | None) -> ForkedCompile:
    """Fill the cache from a fork of this process, in a session of its own (so that its pool ends with it), ending
    with this process. The child compiles (Triton's compiler, ptxas, gcc for the launchers) and touches no GPU: the
    CUDA state it inherits stays unused, and it leaves by os._exit, running none of this process's exit handlers."""
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):  # else the child would write this process's buffered output again
        with contextlib.suppress(Exception):
            stream.flush()
    with warnings.catch_warnings():  # Python warns that a fork of a threaded process may deadlock in locks the other
        warnings.simplefilter("ignore", DeprecationWarning)  # threads held: the child takes none (below)
        pid = os.fork()
    if pid == 0:
        global _in_fork
        _in_fork, code = True, 1
        try:
            gc.disable()  # no finalizer of an inherited (CUDA) object runs here
            # streams of its own: the inherited ones' buffers and locks are the parent's (the pool's forks flush them)
            sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
            sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
            os.setsid()
            stop_with(parent)
            code = fill(doc, workers, only)
        except BaseException as e:  # noqa: BLE001 (one line; the first launch compiles what is missing)
            say(f"stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            os._exit(code)
    return ForkedCompile(pid, only)
