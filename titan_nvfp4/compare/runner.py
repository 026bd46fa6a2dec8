"""Running the arms: what each may do (skip, resume, start fresh, or be refused), its old outputs cleared before a
fresh start, and its trainer run under a guard (guard.py) with its log and lock held, ``parallel`` arms at a time."""

from __future__ import annotations

import fcntl
import json
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

from ..tools.atomic import write_text
from .armlog import arm_metrics, branch_line, header, log_stamp, read_arm_log
from .lock import ArmLock, Busy, acquire, check_log_free, stray_writers
from .spec import Arm, Spec

GUARD = Path(__file__).with_name("guard.py")
GRACE_S = 30  # SIGTERM to SIGKILL, for an arm's processes (torchrun's own grace for its workers)
BRANCH_POLL_S = 2.0  # how often a parent arm's checkpoint folder is looked at (its saves are minutes apart)


class Refused(Exception):
    """Arms that may not run as asked; the message names each and says why and what to do."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the runner: it stops like Ctrl-C, the arms it runs with it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def has_checkpoint(spec: Spec, arm: Arm) -> bool:
    """Whether the arm will load a checkpoint: checkpointing on and a whole step folder (its ``.metadata`` is written
    last) under its dump folder. A folder cut short by a kill is not one: TorchTitan would start afresh from step 1
    (and a branch without its parent's state), so the arm starts fresh instead, its outputs cleared."""
    return spec.checkpoint_interval > 0 and any(spec.dump(arm).glob("checkpoint/step-*/.metadata"))


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


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def _stamp_file(kept: Path) -> Path:
    """The stamp of the parent's log beside a kept checkpoint folder."""
    return kept.with_name(f"{kept.name}.json")


def keep_branch_points(spec: Spec, parent: Arm) -> None:
    """Keep each checkpoint of ``parent`` that an arm branches from, once TorchTitan has written it whole (its
    ``.metadata`` comes last), as hard links under its branch folder (TorchTitan removes its own step folder when it
    keeps only the latest ones), with the stamp of the parent's log so far beside it (``armlog.branch_line``)."""
    for step in sorted({a.branch_step for a in spec.branches(parent)}):
        kept = spec.branch_point(parent.name, step)
        saved = spec.dump(parent) / "checkpoint" / f"step-{step}"
        if kept.is_dir() or not (saved / ".metadata").is_file():
            continue
        partial = kept.with_name(f".{kept.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(saved, partial, copy_function=_link_or_copy)
        write_text(_stamp_file(kept), json.dumps(log_stamp(spec.log(parent))), "a branch stamp")
        os.replace(partial, kept)


def _keep_while_running(spec: Spec, parent: Arm, done: threading.Event) -> None:
    """Poll for ``parent``'s branch points while it trains (its step folder may go before it ends)."""
    while not done.wait(BRANCH_POLL_S):
        try:
            keep_branch_points(spec, parent)
        except OSError as e:
            print(f"compare: arm {parent.name!r}: cannot keep its branch checkpoint yet: {e}", file=sys.stderr,
                  flush=True)


def branch_stamp(spec: Spec, arm: Arm) -> dict | None:
    """The stamp of the parent's run that ``arm`` branches from, None while its checkpoint is not kept here."""
    kept = spec.branch_point(arm.branch_from, arm.branch_step)
    try:
        return json.loads(_stamp_file(kept).read_text()) if (kept / ".metadata").is_file() else None
    except (OSError, ValueError):
        return None


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
    starts_branch = bool(arm.branch_from) and not resume
    stamp = branch_stamp(spec, arm) if starts_branch else None
    if starts_branch and stamp is None:
        print(f"[{index}/{len(spec.arms)}] {arm.name}: not run: the checkpoint of {arm.branch_from!r} at step "
              f"{arm.branch_step} it starts from is not in {spec.branch_point(arm.branch_from, arm.branch_step)}: "
              f"{arm.branch_from!r} did not save it here (it stopped before step {arm.branch_step}, or could not be "
              f"kept: see above)", flush=True)
        return 1
    is_parent = bool(spec.branches(arm))
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
        log.write(header(spec, arm, extra, resume) + (branch_line(arm, stamp) if stamp else ""))
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
            done = threading.Event()
            keeper = None
            if is_parent:
                keeper = threading.Thread(target=_keep_while_running, args=(spec, arm, done), daemon=True)
                keeper.start()
            try:
                rc = proc.wait(timeout=spec.timeout_s or None)
            except subprocess.TimeoutExpired:
                stop([proc])
                rc = 124
            finally:
                done.set()
                if keeper is not None:
                    keeper.join()  # one keeper at a time: the last look below must not race a poll's copy
                LIVE.discard(proc)
        finally:
            os.close(runner_end)
    if is_parent:
        try:
            keep_branch_points(spec, arm)
        except OSError as e:
            print(f"compare: arm {arm.name!r}: cannot keep its branch checkpoint: {e}", file=sys.stderr, flush=True)
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
        running = {arm.name for _, arm in todo}
        for _, arm in todo:
            if plans[arm.name] == "fresh" and arm.branch_from and arm.branch_from not in running and \
                    branch_stamp(spec, arm) is None:
                kept = spec.branch_point(arm.branch_from, arm.branch_step)
                refused.append(f"arm {arm.name!r} starts from the checkpoint of {arm.branch_from!r} at step "
                               f"{arm.branch_step}, which is not kept in {kept} (the runner keeps it while "
                               f"{arm.branch_from!r} trains): run both, --only {arm.branch_from} {arm.name} (with "
                               f"--rerun if {arm.branch_from!r} is done)")
        if refused:
            raise Refused("; ".join(refused))
        for _, arm in todo:
            if plans[arm.name] == "fresh":
                clear_outputs(spec, arm)
        resume = frozenset(n for n, p in plans.items() if p == "resume")
        # the arms that start from another's checkpoint go after every other (their parents keep it as they train)
        failed = run_arms(spec, [t for t in todo if not t[1].branch_from], resume, locks)
        return failed + run_arms(spec, [t for t in todo if t[1].branch_from], resume, locks)
    finally:
        for lock in locks.values():
            lock.release()
