"""The guard of one arm: runs the arm's command as its child and ends the whole process tree under it when the
runner goes away, by any signal, SIGKILL included. Run as a script (stdlib only, no package import):

    python guard.py GRACE_S COMMAND...

Its stdin is a pipe whose other end only the runner holds: end of file there means the runner is gone. On that,
on SIGTERM, SIGINT or SIGHUP, and after the command exits, every process under the guard gets SIGTERM, and
SIGKILL after GRACE_S. The tree is walked through /proc, not by process group, because torchrun starts each worker
in a session of its own; and on Linux the guard is a child subreaper (prctl), so a worker whose torchrun died
first is still under it. A watchdog process rather than PR_SET_PDEATHSIG on torchrun: a death signal fires when
the *thread* that started the child ends (the runner starts arms from a thread pool), is set in a preexec_fn that
is unsafe in a threaded runner, and would reach torchrun but not its workers. Exits with the command's status
(killed by a signal: by the same signal)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def _subreaper() -> None:
    """Become a child subreaper (Linux): orphans under this process are re-parented to it, not to init."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids of every live process, from /proc (empty elsewhere)."""
    tree: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return tree
    for name in entries:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def _descendants(root: int) -> list[int]:
    tree, found, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(child: subprocess.Popen) -> None:
    """Collect the processes re-parented to the guard that ended; only once ``child``'s own status is taken, so that
    waitpid(-1) never takes it from its Popen."""
    if child.poll() is None:
        return
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def stop_tree(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to every process under the guard, SIGKILL to those left after ``grace_s``."""
    me = os.getpid()
    pids = _descendants(me) or ([child.pid] if child.poll() is None else [])
    if not pids:
        return
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(child)
        if child.poll() is not None and not _descendants(me):
            return
        time.sleep(0.1)
    _signal_all(_descendants(me) or ([child.pid] if child.poll() is None else []), signal.SIGKILL)
    child.wait()
    _reap(child)


def main(argv: list[str]) -> int:
    grace_s, command = float(argv[0]), argv[1:]
    _subreaper()
    stopped: list[int] = []

    def on_signal(signum, frame):
        stopped.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as e:
        print(f"compare: cannot start {command[0]!r}: {e.strerror}", flush=True)  # into the arm's log
        return 127
    runner_gone = False
    while child.poll() is None and not stopped and not runner_gone:
        ready = select.select([0], [], [], 0.2)[0]
        runner_gone = bool(ready) and not os.read(0, 1)
    if runner_gone:
        print("compare: the runner is gone; stopping this arm", flush=True)
    stop_tree(child, grace_s)  # after a normal exit: whatever the command left running
    rc = child.wait()
    if rc < 0:  # end as the command did, by its signal
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: uncatchable anyway
            pass
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
