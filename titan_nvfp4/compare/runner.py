"""Running the arms: what each may do (skip, resume, start fresh, or be refused), its old outputs cleared before a
fresh start, and its trainer run under a guard (guard.py) with its log and lock held, ``parallel`` arms at a time."""

from __future__ import annotations

import fcntl
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .armlog import arm_metrics, header, read_arm_log
from .lock import ArmLock, Busy, acquire, check_log_free, stray_writers
from .spec import Arm, Spec

GUARD = Path(__file__).with_name("guard.py")
GRACE_S = 30  # SIGTERM to SIGKILL, for an arm's processes (torchrun's own grace for its workers)


class Refused(Exception):
    """Arms that may not run as asked; the message names each and says why and what to do."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the runner: it stops like Ctrl-C, the arms it runs with it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def has_checkpoint(spec: Spec, arm: Arm) -> bool:
    """Whether the arm will load a checkpoint: checkpointing on and a step folder saved under its dump folder."""
    return spec.checkpoint_interval > 0 and any(spec.dump(arm).glob("checkpoint/step-*"))


def plan(spec: Spec, arm: Arm, rerun: bool) -> str:
    """What to do with ``arm``, whose lock this runner holds: "skip" (its log is a run of this spec that reached the
    steps), "resume" (one that did not, with a checkpoint) or "fresh". Busy while a process still writes its log;
    Refused when its log is another spec's run, a mix, or cannot say (unless ``rerun``: then always "fresh")."""
    check_log_free(spec, arm)
    if rerun:
        return "fresh"
    state = read_arm_log(spec, arm)
    if state.status in ("stale", "mixed") or (state.status == "unchecked" and spec.log(arm).exists()):
        raise Refused(f"arm {arm.name!r}: {state.why}: --rerun starts it afresh (its log and {spec.dump(arm)}/ "
                      "removed)")
    if state.status == "current" and state.steps and state.steps[-1].step >= spec.steps:
        return "skip"
    return "resume" if state.status == "current" and has_checkpoint(spec, arm) else "fresh"


def clear_outputs(spec: Spec, arm: Arm) -> None:
    """Remove the arm's dump folder (TensorBoard events, checkpoints, all else) and its log before a fresh start.
    Both move into one trash folder, the dump folder first, and the trash goes last: a kill in between leaves the
    old log with nothing of its run beside it (still judged by its own header), never old events beside a new log."""
    trash = spec.out / f".{arm.name}.old"
    shutil.rmtree(trash, ignore_errors=True)  # left by a clear that was killed
    for path in (spec.dump(arm), spec.log(arm)):
        if path.exists() or path.is_symlink():
            trash.mkdir(exist_ok=True)
            os.replace(path, trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S + 10) -> None:
    """SIGTERM to each arm's process group (its guard, which stops everything under it, and torchrun), SIGKILL to
    a group whose guard outlives ``grace_s``."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


#: the arms' guards running now (each leads its own process group: a signal to the runner does not reach them)
LIVE: set[subprocess.Popen] = set()


def run_arm(spec: Spec, arm: Arm, index: int, gpu: str | None = None, resume: bool = False,
            lock: ArmLock | None = None) -> int:
    """Run one arm (on ``gpu`` when given) under its guard, its output appended to its log, which it locks for as
    long as any process of the arm holds it; print one progress line when it ends. Returns the exit code (124 after
    ``timeout_s``, which stops the arm's processes)."""
    extra = spec.env(arm)
    if gpu is not None:
        extra["CUDA_VISIBLE_DEVICES"] = gpu
    if spec.parallel > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun leaves a one-process job every core's worth of OpenMP threads; N arms at once then oversubscribe
        # the host, and a host-bound arm slows (gpt_oss at seq 512, 4 arms on one host: NVFP4 56k -> 72.5k
        # tokens/s with 4 threads each, in part because the BF16 arms finished meanwhile)
        extra["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.parallel))
    env = {**os.environ, **extra}
    start = time.time()
    # O_APPEND: every process of the arm appends, so no writer's offset can leave a hole of NUL bytes; the flock
    # travels with the open file to every process given it as stdout, and marks the log as written until the last
    with open(spec.log(arm), "a") as log:
        try:
            fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[{index}/{len(spec.arms)}] {arm.name}: not run: another process took its log", flush=True)
            return 1
        if not resume:
            log.truncate(0)
        log.write(header(spec, arm, extra, resume))
        log.flush()
        guard_end, runner_end = os.pipe()  # only this process holds runner_end: the guard reads EOF when it is gone
        try:
            proc = subprocess.Popen([sys.executable, str(GUARD), str(GRACE_S), *spec.command(arm)], stdin=guard_end,
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    pass_fds=(lock.fd,) if lock else ())
        except BaseException:
            os.close(runner_end)
            raise
        finally:
            os.close(guard_end)
        try:
            if lock:
                lock.record(guard=proc.pid)
            LIVE.add(proc)
            try:
                rc = proc.wait(timeout=spec.timeout_s or None)
            except subprocess.TimeoutExpired:
                stop([proc])
                rc = 124
            finally:
                LIVE.discard(proc)
        finally:
            os.close(runner_end)
    strays = stray_writers(spec, arm)
    if strays:
        print(f"compare: arm {arm.name!r}: pids {', '.join(map(str, strays))} still write its log after its guard "
              f"ended: stop them (kill {' '.join(map(str, strays))})", file=sys.stderr, flush=True)
    steps = arm_metrics(spec, arm)
    last = f"step {steps[-1].step}, loss {steps[-1].loss:.4f}" if steps else "no metric lines"
    where = f" on GPU {gpu}" if gpu is not None else ""
    print(f"[{index}/{len(spec.arms)}] {arm.name}{where}: exit {rc} in {time.time() - start:.0f} s"
          f"{' (resumed)' if resume else ''}, {last}", flush=True)
    return rc


def _gpu_slots(parallel: int) -> list[str | None]:
    """The GPU of each of ``parallel`` slots: visible GPU i modulo the count; None (no pinning) for one slot
    or on a machine without CUDA."""
    if parallel == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        try:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        except ImportError:
            gpus = []
    return [gpus[i % len(gpus)] if gpus else None for i in range(parallel)]


def run_arms(spec: Spec, todo: list[tuple[int, Arm]], resume: frozenset[str] = frozenset(),
             locks: dict[str, ArmLock] | None = None) -> list[str]:
    """Run ``todo`` (index, arm) with ``spec.parallel`` at a time (those named in ``resume`` from their checkpoints);
    returns the names of the arms that failed. SIGTERM and SIGHUP stop the runner like Ctrl-C (Interrupted), and
    every arm running with it."""
    slots: queue.Queue = queue.Queue()
    for gpu in _gpu_slots(spec.parallel):
        slots.put(gpu)

    def one(item):
        i, arm = item
        gpu = slots.get()
        try:
            return arm.name, run_arm(spec, arm, i, gpu, arm.name in resume, (locks or {}).get(arm.name))
        finally:
            slots.put(gpu)

    def on_signal(signum, frame):
        raise Interrupted(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with ThreadPoolExecutor(max_workers=spec.parallel) as pool:
            try:
                return [name for name, rc in pool.map(one, todo) if rc]
            except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: the arms' processes go down with the runner
                stop(list(LIVE))
                raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_selected(spec: Spec, selected: list[tuple[int, Arm]], rerun: bool) -> list[str]:
    """Lock the ``selected`` (index, arm), plan each, then run those to run; Refused (naming every arm refused, and
    nothing run) when an arm is locked by another runner, still written, or logged under another spec. Returns the
    names of the arms that failed."""
    locks: dict[str, ArmLock] = {}
    refused: list[str] = []
    try:
        for _, arm in selected:
            try:
                locks[arm.name] = acquire(spec, arm)
            except Busy as e:
                refused.append(str(e))
            except OSError as e:
                refused.append(f"arm {arm.name!r}: cannot lock it in {spec.out}: {e.strerror or e}")
        if refused:
            raise Refused("; ".join(refused))
        for lock in locks.values():
            if lock.note:
                print(f"compare: {lock.note}", file=sys.stderr, flush=True)
        plans = {}
        for _, arm in selected:
            try:
                plans[arm.name] = plan(spec, arm, rerun)
            except (Busy, Refused, ValueError) as e:
                refused.append(str(e))
        if refused:
            raise Refused("; ".join(refused))
        todo = []
        for i, arm in selected:
            if plans[arm.name] == "skip":
                print(f"[{i}/{len(spec.arms)}] {arm.name}: already reached step {spec.steps}", flush=True)
            else:
                todo.append((i, arm))
        if todo and shutil.which(spec.launcher[0]) is None:
            raise Refused(f"[compare] launcher: {spec.launcher[0]!r} is not on PATH (activate the environment that "
                          "has it, or give its full path)")
        for _, arm in todo:
            if plans[arm.name] == "fresh":
                clear_outputs(spec, arm)
        return run_arms(spec, todo, frozenset(n for n, p in plans.items() if p == "resume"), locks)
    finally:
        for lock in locks.values():
            lock.release()
