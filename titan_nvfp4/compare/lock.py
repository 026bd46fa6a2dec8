"""One runner per arm: a lock file beside the arm's log (``.<arm>.lock``) that records its owner's pid, held with
flock by the runner and by the guard of the arm's trainer (so the kernel frees it when both are gone, and a dead
owner's lock is taken over with a note); and the processes that still write an arm's log (an orphaned trainer)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .spec import Arm, Spec


class Busy(Exception):
    """The arm is run, or its log still written, by another process; the message names the arm and the pids."""


def lock_path(spec: Spec, arm: Arm) -> Path:
    return spec.out / f".{arm.name}.lock"


def _alive(pid) -> bool:
    """Whether ``pid`` is a running process (a zombie is not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _owner(fd: int) -> dict:
    """The lock file's record; {} when released (emptied), {"pid": "?"} when a killed owner left it half written."""
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return {}
    try:
        owner = json.loads(raw)
    except ValueError:
        return {"pid": "?"}
    return owner if isinstance(owner, dict) else {"pid": "?"}


def _who(owner: dict) -> str:
    pid, guard = owner.get("pid"), owner.get("guard")
    if guard and not _alive(pid):
        return (f"the trainer guard pid {guard} of runner pid {pid}, which has ended (the guard is stopping the "
                "arm's processes: retry in a moment)")
    return f"runner pid {pid}" + (f" since {owner['since']}" if owner.get("since") else "")


@dataclass
class ArmLock:
    """A held arm lock; ``note`` tells that a dead owner's lock was taken over."""
    arm: str
    path: Path
    fd: int
    note: str = ""

    def record(self, **extra) -> None:
        """Write the owner's pid, host and start time (and ``extra``, e.g. the guard's pid) into the lock file."""
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
        data = json.dumps(owner).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Empty the file (the mark of a clean release) and unlock it; the file stays, so that a runner waiting on
        its inode never holds a lock on a deleted one."""
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = -1


def acquire(spec: Spec, arm: Arm) -> ArmLock:
    """Lock ``arm`` for this runner, or raise Busy naming who holds it."""
    path = lock_path(spec, arm)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(4):  # a table's brief look (``holder``) holds it for microseconds: try a few times
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == 3:
                owner = _owner(fd)
                os.close(fd)
                raise Busy(f"arm {arm.name!r} is being run by {_who(owner)} (lock {path}): wait for it to end, or "
                           "stop it") from None
            time.sleep(0.05)
    lock = ArmLock(arm.name, path, fd)
    previous = _owner(fd)
    if previous:
        lock.note = (f"arm {arm.name!r}: took over the lock {path} of runner pid {previous.get('pid')}, which ended "
                     "without releasing it")
    lock.record()
    return lock


def holder(spec: Spec, arm: Arm) -> str | None:
    """Who runs ``arm`` now ("runner pid N since ..."), None when nobody holds its lock."""
    try:
        fd = os.open(lock_path(spec, arm), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _who(_owner(fd))
    finally:
        os.close(fd)


def _writer_pids(log: Path) -> list[int]:
    """Other processes with ``log`` open for writing, from /proc (Linux; [] elsewhere): a reader such as
    ``tail -f`` does not count."""
    try:
        key = (lambda s: (s.st_dev, s.st_ino))(os.stat(log))
    except OSError:
        return []
    pids = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                s = os.stat(entry / "fd" / fd)
                if (s.st_dev, s.st_ino) != key:
                    continue
                flags = next(ln for ln in (entry / "fdinfo" / fd).read_text().splitlines() if ln.startswith("flags:"))
            except (OSError, StopIteration):
                continue
            if int(flags.split()[1], 8) & (os.O_WRONLY | os.O_RDWR):
                pids.append(int(entry.name))
                break
    return sorted(pids)


def check_log_free(spec: Spec, arm: Arm) -> None:
    """Raise Busy when a process still writes ``arm``'s log: a trainer of an earlier run that outlived its runner
    holds the runner's flock on it, and /proc names it."""
    log = spec.log(arm)
    held = False
    try:
        fd = os.open(log, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        held = True
    finally:
        os.close(fd)
    pids = _writer_pids(log)
    if held or pids:
        who = f"pids {', '.join(map(str, pids))}" if pids else "a process (not visible here)"
        stop = f" (kill {' '.join(map(str, pids))})" if pids else ""
        raise Busy(f"arm {arm.name!r}: its log {log} is still written by {who}, left from an earlier run: stop them "
                   f"first{stop}")


def stray_writers(spec: Spec, arm: Arm) -> list[int]:
    """The processes other than this runner that still write ``arm``'s log (after its guard ended: orphans)."""
    return _writer_pids(spec.log(arm))
