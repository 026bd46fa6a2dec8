"""An arm's log and what it proves: the header written at each start (the full command, then a line with the arm's
spec hash), and a log read back as one run of the current spec, a run of another spec, an older runner's log that
cannot say, or a mix of runs that no table may show."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..tools.loss_log import StepMetrics, parse_log, tensorboard_run
from .spec import BRANCH_FLAG, Arm, Spec

#: the variables ``Spec.env`` sets that change what an arm computes (its GPU and thread count do not)
RUN_ENV = ("TORCHINDUCTOR_CUDAGRAPHS", "WANDB_MODE")
_SPEC_LINE = re.compile(r"^# compare: arm (?P<arm>.*), spec (?P<hash>[0-9a-f]{16}), job file (?P<job>[0-9a-f]{16}|-),"
                        r" (?P<kind>fresh|resumed)\s*$")
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_DUMP_FLAGS = ("--job.dump_folder", "--dump_folder")
_RANK_PREFIX = re.compile(r"^\s*\[(\w+)\]:")  # torchrun's "[rank1]:" / "[default1]:" before each rank's lines
_BRANCH_LINE = re.compile(r"^# compare: branch of (?P<parent>\S+) at step (?P<step>[0-9]+), whose log's first "
                          r"(?P<bytes>[0-9]+) bytes have sha256 (?P<sha>[0-9a-f]{16})\s*$")
_CORPUS = re.compile(r"Reading (?P<split>\S+) of .*: corpus (?P<id>[0-9a-f]{12}) \(")  # data/registry.py, per split


def job_digest(spec: Spec, arm: Arm) -> str:
    """The first 16 hex digits of the sha256 of the arm's job file, "-" under a config registry (no file)."""
    path = spec.job_file(arm)
    if path is None:
        return "-"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as e:
        raise ValueError(f"arm {arm.name!r}: cannot read its job file {path}: {e.strerror}") from None


def _relocatable(command: list[str], branch: bool = False) -> list[str]:
    """``command`` with its dump folder left out (and a branching arm's kept checkpoint, under the out folder too): a
    log moved or gathered elsewhere (``--out``) is the same run."""
    words = list(command)
    for i, w in enumerate(words[:-1]):
        if w in _DUMP_FLAGS:
            words[i + 1] = "<out>/<arm>"
        elif w == BRANCH_FLAG and branch:  # the runner's <out>/<parent>/branch/step-N (a user's own path stays)
            words[i + 1] = "/".join(["<out>", *Path(words[i + 1]).parts[-3:]])
    return words


def identity(spec: Spec, arm: Arm) -> dict:
    """What makes a run of ``arm`` this spec's: its command (dump folder aside), its variables of RUN_ENV and its
    job file's contents."""
    env = spec.env(arm)
    return {"command": _relocatable(spec.command(arm), bool(arm.branch_from)),
            "env": {k: env[k] for k in RUN_ENV if k in env}, "job": job_digest(spec, arm)}


def spec_hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def header(spec: Spec, arm: Arm, env: dict[str, str], resumed: bool) -> str:
    """The two lines an arm's log starts (or, resumed, continues) with: its variables and full command, then its
    spec hash and job file digest."""
    ident = identity(spec, arm)
    command = shlex.join([*(f"{k}={v}" for k, v in env.items()), *spec.command(arm)])
    return (f"# {command}\n# compare: arm {arm.name}, spec {spec_hash(ident)}, job file {ident['job']}, "
            f"{'resumed' if resumed else 'fresh'}\n")


def log_stamp(log: Path) -> dict:
    """What identifies the run a log holds so far: its length and the sha256 of its bytes (a log only grows)."""
    data = log.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}


def branch_line(arm: Arm, stamp: dict) -> str:
    """The line a branching arm's log carries after its first header: the run of its parent it started from."""
    return (f"# compare: branch of {arm.branch_from} at step {arm.branch_step}, whose log's first {stamp['bytes']} "
            f"bytes have sha256 {stamp['sha256']}\n")


def _branch_mismatch(spec: Spec, arm: Arm, text: str) -> str:
    """Why a branching arm's log does not pair with its parent's log in the folder ("" when it does): the parent's
    log must be a run of the spec as it is now, and start with the bytes it had when the arm's checkpoint was taken
    from it."""
    m = next((m for line in text.splitlines() if (m := _BRANCH_LINE.match(line))), None)
    if m is None:
        return f"{spec.log(arm)} does not say which run of {arm.branch_from!r} it branched from"
    parent_arm = spec.by_name()[arm.branch_from]
    parent_log = spec.log(parent_arm)
    parent = read_arm_log(spec, parent_arm)
    if parent.status != "current":
        return (f"{spec.log(arm)} branched from {arm.branch_from!r}, whose log {parent_log} is not a run of this spec "
                f"({parent.status}{': ' + parent.why if parent.why else ''}): its first {arm.branch_step} steps are "
                "not the spec's")
    n = int(m["bytes"])
    try:
        head = parent_log.read_bytes()[:n] if parent_log.is_file() else b""
    except OSError:
        head = b""
    if m["parent"] != arm.branch_from or int(m["step"]) != arm.branch_step or len(head) < n or \
            hashlib.sha256(head).hexdigest()[:16] != m["sha"]:
        return (f"{spec.log(arm)} branched from a run of {m['parent']!r} at step {m['step']} that {parent_log} does "
                "not hold (another run of it, or none): the two do not pair")
    return ""


@dataclass
class ArmLog:
    """An arm's log as read back. ``status``: "none" (no log, no events), "current" (one run of this spec, maybe
    resumed), "unchecked" (no spec line: an older runner's or a gathered log), "stale" (another spec), "mixed" (two
    runs in one, or damaged). ``why`` says what makes it stale, mixed or unchecked."""
    status: str
    steps: list[StepMetrics] = field(default_factory=list)
    why: str = ""
    corpus: str = ""  # the corpus ids its job read, "+"-joined ("" when it logged none: an older log, other data)

    @property
    def tabled(self) -> bool:
        """Whether a table may show it: a run of this spec, or one that cannot say (flagged)."""
        return self.status in ("current", "unchecked") and bool(self.steps)


def _changes(spec: Spec, arm: Arm, command_line: str, job: str) -> str:
    """What differs between the run a header line records and ``arm`` now, e.g. "--training.steps 40 → 30"."""
    try:
        words = shlex.split(command_line[1:])
    except ValueError:
        words = command_line[1:].split()
    env = {}
    while words and _ENV_WORD.match(words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    now = identity(spec, arm)
    found = [f"{k}={env.get(k, '(unset)')} → {now['env'].get(k, '(unset)')}" for k in RUN_ENV
             if env.get(k) != now["env"].get(k)]
    if job != now["job"]:
        found.append(f"the job file {spec.job_file(arm)} changed")
    old, new = _relocatable(words, bool(arm.branch_from)), now["command"]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        flag = old[i1 - 1] + " " if 0 < i1 < len(old) and old[i1 - 1].startswith("-") and \
            not old[i1].startswith("-") else ""
        if tag == "replace":
            found.append(f"{flag}{' '.join(old[i1:i2])} → {' '.join(new[j1:j2])}")
        elif tag == "delete":
            found.append(f"{flag}{' '.join(old[i1:i2])} removed")
        elif tag == "insert":
            found.append(f"{' '.join(new[j1:j2])} added")
    return ", ".join(found) or "its spec hash differs"


def _metrics(spec: Spec, arm: Arm, text: str) -> list[StepMetrics]:
    """The log's metric lines, else (a job that logs elsewhere) the TensorBoard events under its dump folder."""
    return parse_log(text) or tensorboard_run(spec.dump(arm))[0]


def _off_pin(spec: Spec, log: Path, corpus: str, trained: bool) -> str:
    """Why a log is off the spec's ``corpus`` pin ("" when it is not): it names another corpus, or it logged steps
    without naming one, so nothing shows which data they were of."""
    if not spec.corpus or corpus == spec.corpus or not (corpus or trained):
        return ""
    if corpus:
        return f"{log} read corpus {corpus}, not the spec's ([compare] corpus = {spec.corpus})"
    return (f"{log} names no corpus, so nothing shows it read the spec's ([compare] corpus = {spec.corpus}; a job "
            "logs one for each split it reads since 2026-12-06)")


def read_arm_log(spec: Spec, arm: Arm) -> ArmLog:
    """Read and judge ``arm``'s log against the spec as it is now."""
    log = spec.log(arm)
    if not log.exists():
        steps = tensorboard_run(spec.dump(arm))[0]
        if not steps:
            return ArmLog("none")
        if spec.corpus:
            return ArmLog("stale", why=f"no log {log}, only TensorBoard events, which name no corpus: nothing shows "
                                       f"they are of the spec's ([compare] corpus = {spec.corpus})")
        return ArmLog("unchecked", steps, f"no log {log}, only TensorBoard events")
    if not log.is_file():
        return ArmLog("mixed", why=f"{log} is not a file")
    data = log.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        return ArmLog("mixed", why=f"{log} has NUL bytes from byte {nul} on (two processes wrote it at once)")
    text = data.decode(errors="replace")
    heads: list[tuple[int, re.Match, str]] = []  # (line number, spec line, the command line above it)
    last_step: dict[str, int] = {}  # by rank prefix: every rank of a multi-GPU arm may log each step
    previous, before_header = "", False
    corpora: dict[str, tuple[str, int]] = {}  # split file -> (corpus id, the first line logging it)
    for n, line in enumerate(text.splitlines(), 1):
        if c := _CORPUS.search(line):
            first, at = corpora.setdefault(c["split"], (c["id"], n))
            if c["id"] != first:
                return ArmLog("mixed", why=f"{log} reads {c['split']} of corpus {first} (line {at}) and of corpus "
                                           f"{c['id']} (line {n}): its data changed between two starts")
        m = _SPEC_LINE.match(line)
        if m:
            heads.append((n, m, previous))
            if m["kind"] == "fresh" and len(heads) > 1:
                return ArmLog("mixed", why=f"{log} starts a second fresh run at line {n} (two runs appended)")
            last_step.clear()  # a resumed run logs again from its checkpoint's step
        elif "step:" in line:
            for s in parse_log(line):
                before_header |= not heads
                rank = r[1] if (r := _RANK_PREFIX.match(line)) else ""
                if heads and s.step < last_step.get(rank, 0):
                    return ArmLog("mixed", why=f"{log} logs step {s.step} after step {last_step[rank]} at line {n} "
                                               "(two runs in one log)")
                last_step[rank] = s.step
        previous = line
    corpus = "+".join(sorted({ident for ident, _ in corpora.values()}))
    if not heads:
        steps = _metrics(spec, arm, text)
        if off := _off_pin(spec, log, corpus, bool(steps)):
            return ArmLog("stale", why=off, corpus=corpus)
        return ArmLog("unchecked", steps,
                      f"{log} has no spec line (an older runner's log, or one gathered from elsewhere)", corpus)
    if before_header:
        return ArmLog("mixed", why=f"{log} has metric lines before its first header (two runs in one log)")
    if heads[0][1]["kind"] != "fresh":
        return ArmLog("mixed", why=f"{log} starts with a resumed run (its first part is missing)")
    current = spec_hash(identity(spec, arm))
    for n, m, command_line in heads:
        if m["arm"] != arm.name:
            return ArmLog("stale", why=f"{log} was written for arm {m['arm']!r} (line {n})")
        if m["hash"] != current:
            return ArmLog("stale", why=f"{log} ran another spec ({_changes(spec, arm, command_line, m['job'])})")
    steps = _metrics(spec, arm, text)
    if off := _off_pin(spec, log, corpus, bool(steps)):
        return ArmLog("stale", why=off, corpus=corpus)
    if arm.branch_from and (why := _branch_mismatch(spec, arm, text)):
        return ArmLog("stale", why=why, corpus=corpus)
    return ArmLog("current", steps, corpus=corpus)


def arm_metrics(spec: Spec, arm: Arm) -> list[StepMetrics]:
    """The arm's logged steps, whatever run its log holds (the progress line; ``read_arm_log`` judges them)."""
    log = spec.log(arm)
    return _metrics(spec, arm, log.read_text(errors="replace") if log.is_file() else "")


def is_done(spec: Spec, arm: Arm) -> bool:
    """Whether the arm's log is one run of this spec that reached its steps."""
    state = read_arm_log(spec, arm)
    return state.status == "current" and bool(state.steps) and state.steps[-1].step >= spec.steps
