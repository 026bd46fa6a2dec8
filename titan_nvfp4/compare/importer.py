"""Bring arms' logs back from another machine (a device call's ``logs.tar.xz``, or a folder of logs) into a spec's
output folder, judged like the runner judges them: only a run of this spec comes in, and a log there is only ever
replaced by its own continuation, or, with ``replace``, by another run of the arm (never a run of this spec with as
many steps or more)."""

from __future__ import annotations

import dataclasses
import re
import tarfile
import tempfile
from pathlib import Path

from ..tools.atomic import write_bytes
from .armlog import ArmLog, read_arm_log
from .spec import Spec

_LOG_NAME = re.compile(r"^[A-Za-z0-9_.+-]+\.log$")


def _incoming_logs(source: Path, into: Path) -> list[Path]:
    """The ``<name>.log`` files of ``source`` (a tar archive, compressed or not, or a folder), copied flat into
    ``into``; members that are not plain files, or whose names are not plain log names, are left out."""
    if source.is_dir():
        found = [p for p in sorted(source.iterdir()) if p.is_file() and _LOG_NAME.match(p.name)]
        for p in found:
            (into / p.name).write_bytes(p.read_bytes())
        return [into / p.name for p in found]
    if not source.is_file():
        raise ValueError(f"--import-logs {source}: no such file or folder")
    try:
        with tarfile.open(source) as tar:
            out, seen = [], {}
            for m in tar.getmembers():
                name = Path(m.name).name
                if not m.isfile() or not _LOG_NAME.match(name):
                    continue
                if name in seen:
                    raise ValueError(f"--import-logs {source}: holds two logs named {name} ({seen[name]} and "
                                     f"{m.name}): which is the arm's cannot be told")
                seen[name] = m.name
                data = tar.extractfile(m).read()
                (into / name).write_bytes(data)
                out.append(into / name)
            return out
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ValueError(f"--import-logs {source}: not a readable tar archive or folder ({e})") from None


def _last_step(state: ArmLog) -> int:
    return state.steps[-1].step if state.steps else 0


def import_logs(spec: Spec, source: Path, only: list[str] | None = None, replace: bool = False) -> list[str]:
    """Copy each arm's log from ``source`` into ``spec.out`` when it is a run of this spec that continues the log
    there (or there is none); with ``replace``, also one that replaces another run there, unless that is a run of
    this spec with as many logged steps or more. Returns one line per log found, saying what happened to it and why.
    Each log is written atomically."""
    arms = spec.by_name()
    lines = []
    with tempfile.TemporaryDirectory(prefix="titan_nvfp4_import_") as tmp:
        staging = dataclasses.replace(spec, out=Path(tmp))
        incoming = _incoming_logs(source, Path(tmp))
        # parents first: a branch pairs with the parent's log in the folder once the import is done
        incoming.sort(key=lambda p: bool(getattr(arms.get(p.name[: -len(".log")]), "branch_from", "")))
        for path in incoming:
            name = path.name[: -len(".log")]
            if name not in arms:
                lines.append(f"{name}: skipped, not an arm of this spec")
                continue
            if only is not None and name not in only:
                continue
            arm = arms[name]
            why_of = {str(path): f"{source}: {path.name}"}
            if arm.branch_from:  # checked against the parent's log in the folder, not the one in the archive
                parent = arms[arm.branch_from]
                staged, there = staging.log(parent), spec.log(parent)
                staged.unlink(missing_ok=True)
                if there.is_file():
                    staged.write_bytes(there.read_bytes())
                why_of[str(staged)] = str(there)
            new = read_arm_log(staging, arm)
            if new.status != "current":  # its reason names the logs as they came in or are kept, not staging copies
                why = new.why
                for staged_path, shown in why_of.items():
                    why = why.replace(staged_path, shown)
                lines.append(f"{name}: skipped, {new.status}: {why}")
                continue
            if not new.steps:
                lines.append(f"{name}: skipped, no logged step (a run that failed at its start)")
                continue
            data = path.read_bytes()  # bytes as they came: a branch's stamp is the sha256 of its parent's log
            old = read_arm_log(spec, arm)
            there_file = spec.log(arm).is_file()
            held = spec.log(arm).read_bytes() if there_file else b""
            if held and data == held:
                lines.append(f"{name}: already there (the same log, step {_last_step(new)})")
                continue
            if old.status != "none" and not (there_file and data.startswith(held)):
                if old.steps:
                    there = f"{old.status}, step {_last_step(old)}"
                else:
                    there = f"{old.status}: {old.why}" if old.why else "a run that logged no step"
                if old.status == "current" and _last_step(old) >= _last_step(new):
                    lines.append(f"{name}: kept the log there (step {_last_step(old)}; the incoming one reaches step "
                                 f"{_last_step(new)}: an earlier copy of it, or another run)")
                    continue
                if not replace:
                    lines.append(f"{name}: skipped, the log there holds another run of the arm ({there}); "
                                 f"--replace-logs puts the incoming one (step {_last_step(new)}) in its place")
                    continue
            write_bytes(spec.log(arm), data, f"the log of arm {name}")
            done = "complete" if _last_step(new) >= spec.steps else "partial"
            lines.append(f"{name}: imported, step {_last_step(new)} of {spec.steps} ({done})")
    return lines
