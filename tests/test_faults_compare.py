"""Faults of the comparison runner (issue 66, point 2), each done for real with the stub trainer
(tests/compare_stub.py): the runner SIGKILLed or sent SIGHUP mid-arm, a trainer orphaned by its killed guard, a
second runner of a running arm, a spec edited between runs, logs that mix two runs, torchrun not on PATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from titan_nvfp4 import compare

STUB = str(Path(__file__).with_name("compare_stub.py"))
REPO = Path(__file__).resolve().parents[1]
SLOW = '"--stub.worker", "--stub.sleep", "0.25"'  # 10 s for 40 steps, a worker in a session of its own


def _spec(tmp_path: Path, nvfp4: str = '"--stub.offset", "0.2"', steps: int = 40,
          launcher: str = f'["{sys.executable}", "{STUB}"]', third: bool = False,
          bf16_job: Path = REPO / "train_configs/llama3_bf16.toml") -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(f"""
[compare]
base = "{REPO / 'train_configs/llama3_nvfp4.toml'}"
steps = {steps}
out = "{tmp_path / 'out'}"
last = 3
baseline = "bf16"
common = ["--metrics.log_freq", "5"]
launcher = {launcher}
[[arm]]
name = "bf16"
base = "{bf16_job}"
[[arm]]
name = "nvfp4"
overrides = [{nvfp4}]
""" + ('[[arm]]\nname = "no_rht"\noverrides = ["--stub.offset", "0.1"]\n' if third else ""))
    return p


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _stops(pid: int, within_s: float = 3) -> bool:
    """Whether ``pid`` ends within ``within_s`` (a zombie counts): well before a SLOW arm would end by itself."""
    deadline = time.time() + within_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def _wait_for(path: Path, within_s: float = 90) -> int:
    deadline = time.time() + within_s
    while not (path.is_file() and path.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = compare.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: Path) -> dict[str, list[str]]:
    """The table's rows in ``out``/compare.md by arm."""
    table = (out / "compare.md").read_text()
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.split("\n\n")[0].splitlines()[2:] if line.startswith("|")}


def _runner(spec: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "titan_nvfp4.compare", str(spec), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_of_the_runner_ends_its_trainer_and_a_rerun_starts_clean(tmp_path, capsys):
    """S1: SIGKILL to the runner ends the arm's trainer and torchrun-like worker (the guard sees the runner go);
    meanwhile a second runner is refused by name; afterwards the dead runner's lock is taken over with a note and
    the arm runs afresh: one header, no NUL bytes, steps 1-40 of one run."""
    spec = _spec(tmp_path, f'"--stub.offset", "0.2", {SLOW}')
    out = tmp_path / "out"
    runner = _runner(spec, "--only", "nvfp4")
    stub = worker = 0
    try:
        worker, stub = _wait_for(out / "nvfp4/worker.pid"), _wait_for(out / "nvfp4/stub.pid")
        code, _, err = _main([str(spec), "--only", "nvfp4"], capsys)  # a second runner while the first runs
        assert code == 2 and f"arm 'nvfp4' is being run by runner pid {runner.pid}" in err, err
        guard = json.loads((out / ".nvfp4.lock").read_text())["guard"]
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
        assert _stops(stub) and _stops(worker) and _stops(guard), "the arm outlived its runner"
    finally:
        runner.kill()
        _kill(stub, worker)
    assert "step: 40" not in (out / "nvfp4.log").read_text()  # stopped part way

    code, stdout, err = _main([str(spec), "--timeout-s", "1.5"], capsys)  # afresh, then stopped by the timeout
    assert code == 1 and "nvfp4: exit 124" in stdout, err
    assert f"took over the lock {out / '.nvfp4.lock'} of runner pid {runner.pid}" in err
    log = (out / "nvfp4.log").read_bytes()
    assert b"\0" not in log and log.count(b"# compare: arm nvfp4") == 1 and b"compare: arm nvfp4, spec" in log
    state = compare.read_arm_log(compare.load_spec(spec), compare.load_spec(spec).arms[1])
    assert state.status == "current" and state.steps[0].step == 1 and state.steps[-1].step < 40
    assert "Partial (below step 40): nvfp4 at step" in stdout and "+0.2000" in _rows(out)["nvfp4"][3]
    assert _stops(_wait_for(out / "nvfp4/worker.pid"))  # the timeout stopped this run's worker too
    assert json.loads((out / ".nvfp4.lock").read_text() or "{}") == {}  # released


def test_sighup_stops_the_runner_and_its_arm_like_sigterm(tmp_path):
    spec = _spec(tmp_path, f'"--stub.offset", "0.2", {SLOW}')
    runner = _runner(spec, "--only", "nvfp4")
    stub = worker = 0
    try:
        worker, stub = _wait_for(tmp_path / "out/nvfp4/worker.pid"), _wait_for(tmp_path / "out/nvfp4/stub.pid")
        runner.send_signal(signal.SIGHUP)
        _, err = runner.communicate(timeout=60)
        assert _stops(stub) and _stops(worker)
    finally:
        runner.kill()
        _kill(stub, worker)
    assert runner.returncode == 128 + signal.SIGHUP, err
    assert err.strip().splitlines()[-1] == \
        "python -m titan_nvfp4.compare: stopped by SIGHUP; the arms it ran are stopped"
    assert "Traceback" not in err, err


def test_an_orphan_still_writing_the_log_keeps_the_arm_from_running(tmp_path, capsys):
    """A trainer that outlived its guard (SIGKILLed here) still writes the log: the runner names its pids when the
    arm ends, and a rerun is refused by pid until they are stopped; then it starts clean."""
    spec = _spec(tmp_path, f'"--stub.offset", "0.2", {SLOW}')
    out = tmp_path / "out"
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=compare.main([str(spec), "--only", "nvfp4"])))
    thread.start()
    stub = worker = 0
    try:
        worker, stub = _wait_for(out / "nvfp4/worker.pid"), _wait_for(out / "nvfp4/stub.pid")
        os.kill(json.loads((out / ".nvfp4.lock").read_text())["guard"], signal.SIGKILL)
        thread.join(timeout=60)
        assert result["code"] == 1
        assert f"pids {min(stub, worker)}, {max(stub, worker)} still write its log" in capsys.readouterr().err
        code, _, err = _main([str(spec), "--rerun"], capsys)
        assert code == 2 and "arm 'nvfp4': its log" in err and str(stub) in err and str(worker) in err, err
        assert "arm 'bf16'" not in err
    finally:
        _kill(stub, worker)
        thread.join(timeout=60)
    assert _stops(stub) and _stops(worker)
    code, stdout, err = _main([str(spec), "--rerun", "--timeout-s", "1"], capsys)  # now it runs, afresh
    assert code == 1 and "nvfp4: exit 124" in stdout and "bf16: exit 0" in stdout, err
    log = (out / "nvfp4.log").read_text()
    assert "\0" not in log and log.count("# compare: arm nvfp4") == 1 and "[worker] alive" in log


def test_an_edited_spec_is_refused_by_arm_and_change_and_rerun_starts_afresh(tmp_path, capsys):
    """S2: after an arm's override is edited, the steps lowered, or its job file edited, the runner names the arm
    and what changed and runs nothing; the table leaves the stale arm out; --rerun removes its log and dump folder
    (TensorBoard events, checkpoints) before running it afresh."""
    out = tmp_path / "out"
    job = tmp_path / "llama3_bf16.toml"
    job.write_bytes((REPO / "train_configs/llama3_bf16.toml").read_bytes())
    assert _main([str(_spec(tmp_path, bf16_job=job))], capsys)[0] == 0
    before = {a: (out / f"{a}.log").read_bytes() for a in ("bf16", "nvfp4")}

    spec = _spec(tmp_path, '"--stub.offset", "0.3"', bf16_job=job)
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "arm 'nvfp4'" in err and "--stub.offset 0.2 → 0.3" in err and "--rerun" in err and "arm 'bf16'" not in err
    assert before == {a: (out / f"{a}.log").read_bytes() for a in ("bf16", "nvfp4")}  # nothing ran
    code, stdout, _ = _main([str(spec), "--report-only"], capsys)
    assert code == 0 and list(_rows(out)) == ["bf16"]
    assert "Not tabled (not a run of this spec; --rerun starts them afresh): nvfp4" in stdout and "0.2 → 0.3" in stdout

    for old in ("tb/20261101-0000/events.out.tfevents.1.old", "checkpoint/step-40/.metadata"):
        (out / "nvfp4" / old).parent.mkdir(parents=True, exist_ok=True)
        (out / "nvfp4" / old).write_text("an earlier run's")
    code, stdout, err = _main([str(spec), "--rerun", "--only", "nvfp4"], capsys)
    assert code == 0, err
    assert not (out / "nvfp4/tb").exists() and not (out / "nvfp4/checkpoint").exists()
    assert (out / "nvfp4.log").read_text().count("# compare: arm nvfp4") == 1
    assert _rows(out)["nvfp4"][3].startswith("+0.3000") and "Not tabled" not in stdout

    spec = _spec(tmp_path, '"--stub.offset", "0.3"', steps=30, bf16_job=job)
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and "arm 'bf16'" in err and "arm 'nvfp4'" in err and "--training.steps 40 → 30" in err, err
    code, stdout, err = _main([str(spec), "--rerun"], capsys)
    assert code == 0 and "step 30" in stdout and "Partial" not in stdout and "Not tabled" not in stdout, err
    assert not list(out.glob(".*.old")) and not list(out.glob(".compare*"))  # no trash, no half-written outputs

    job.write_text(job.read_text() + "\n# an edit\n")
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and f"arm 'bf16': {out / 'bf16.log'} ran another spec (the job file {job} changed)" in err, err
    assert "arm 'nvfp4'" not in err


def test_logs_that_mix_runs_are_left_out_of_the_table_and_refused(tmp_path, capsys):
    """The S1 log (new steps 1-10, NUL bytes, old steps 20-40), a log with a second run appended (tee -a) and an
    older runner's log without a spec line: the first two are not tabled and refused, the third tabled as
    unchecked and refused; --rerun runs all three afresh."""
    spec = _spec(tmp_path, third=True)
    out = tmp_path / "out"
    assert _main([str(spec)], capsys)[0] == 0
    lines = (out / "nvfp4.log").read_text().splitlines(keepends=True)
    early = [ln for ln in lines if "step: " not in ln or int(ln.split("step:")[1].split()[0]) <= 10]
    late = [ln for ln in lines if "step: " in ln and int(ln.split("step:")[1].split()[0]) >= 20]
    (out / "nvfp4.log").write_bytes("".join(early).encode() + b"\0" * 300 + "".join(late).encode())
    text = (out / "no_rht.log").read_text()
    (out / "no_rht.log").write_text(text + text)
    text = (out / "bf16.log").read_text()
    (out / "bf16.log").write_text("".join(ln for ln in text.splitlines(keepends=True) if "# compare: arm" not in ln))

    code, stdout, _ = _main([str(spec), "--report-only"], capsys)
    assert code == 0 and list(_rows(out)) == ["bf16"]
    assert "NUL bytes from byte" in stdout and "second fresh run" in stdout
    assert "Not checked against this spec (no spec line: an older runner's logs, or gathered ones): bf16" in stdout
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert all(f"arm '{a}'" in err for a in ("bf16", "nvfp4", "no_rht")) and "no spec line" in err, err
    code, stdout, err = _main([str(spec), "--rerun"], capsys)
    assert code == 0 and list(_rows(out)) == ["bf16", "nvfp4", "no_rht"], err
    assert "Not tabled" not in stdout and "Not checked" not in stdout
    text = (out / "no_rht.log").read_text()  # a second run's output appended without a header (tee -a)
    again = "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("#"))
    (out / "no_rht.log").write_text(text + again)
    state = compare.read_arm_log(compare.load_spec(spec), compare.load_spec(spec).arms[2])
    assert state.status == "mixed" and "logs step 1 after step 40" in state.why


def test_runs_on_another_corpus_are_left_out_of_the_table(tmp_path, capsys):
    """A 386M ranking arm trained on 2026-12-06 on a corpus its GPU machine had rebuilt with one more package: runs
    on another corpus than the baseline's are not tabled beside it, a log whose corpus changed between starts is
    mixed, logs that name no corpus are flagged where others do, and under a spec's corpus pin a run on another
    corpus is stale (not done, not resumed)."""
    a, b = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
    spec = _spec(tmp_path, nvfp4=f'"--stub.offset", "0.2", "--stub.corpus", "{b}"', third=True)
    spec.write_text(spec.read_text().replace('common = ["--metrics.log_freq", "5"]',
                                             f'common = ["--metrics.log_freq", "5", "--stub.corpus", "{a}"]'))
    out = tmp_path / "out"
    code, stdout, _ = _main([str(spec)], capsys)
    assert code == 0 and list(_rows(out)) == ["bf16", "no_rht"], stdout
    assert f"nvfp4 (read corpus {b}, not {a}, the baseline's)" in stdout
    state = compare.read_arm_log(compare.load_spec(spec), compare.load_spec(spec).arms[1])
    assert state.status == "current" and state.corpus == b  # the arm's own log is sound: only the table leaves it out

    log = out / "no_rht.log"
    text = log.read_text()
    line = f"[rank0]:[titan] 2026-12-06 12:32:40,444 - titan_nvfp4.data.registry - INFO - Reading train.jsonl of " \
           f"/x: corpus {a} (15084 documents, ~93.51M tokens)\n"  # a resumed start: the same corpus again
    log.write_text(text + line)
    assert compare.read_arm_log(compare.load_spec(spec), compare.load_spec(spec).arms[2]).status == "current"
    log.write_text(text + line.replace(a, b))
    state = compare.read_arm_log(compare.load_spec(spec), compare.load_spec(spec).arms[2])
    assert state.status == "mixed" and f"reads train.jsonl of corpus {a}" in state.why and f"of corpus {b}" in state.why

    text = (out / "bf16.log").read_text()  # an older log: no spec line and no corpus line
    (out / "bf16.log").write_text("".join(ln for ln in text.splitlines(keepends=True)
                                          if "# compare: arm" not in ln and "corpus" not in ln))
    code, stdout, _ = _main([str(spec), "--report-only"], capsys)
    assert code == 0 and list(_rows(out)) == ["bf16", "nvfp4"], stdout
    assert f"Corpus not logged (a log from before 2026-12-06, or another dataset), so not checked against the " \
           f"others' {b} (tabled all the same; [compare] corpus would leave them out): bf16" in stdout

    text = spec.read_text().replace("baseline = ", f'corpus = "{a}"\nbaseline = ', 1)
    spec.write_text(text)
    pinned = compare.load_spec(spec)
    assert all(pinned.env(arm)["TITAN_NVFP4_CORPUS"] == a for arm in pinned.arms)  # each job checks it at start
    state = compare.read_arm_log(pinned, pinned.arms[1])
    assert state.status == "stale" and f"read corpus {b}, not the spec's ([compare] corpus = {a})" in state.why
    # under the pin, a log that trained without naming a corpus proves nothing about its data: stale, with or
    # without a spec line (the first 386M ranking arm on the rebuilt corpus predates the corpus line)
    state = compare.read_arm_log(pinned, pinned.arms[0])
    assert state.status == "stale" and "names no corpus" in state.why, state
    text_no_rht = (out / "no_rht.log").read_text()
    (out / "no_rht.log").write_text("".join(ln for ln in text_no_rht.splitlines(keepends=True) if "corpus" not in ln))
    state = compare.read_arm_log(pinned, pinned.arms[2])
    assert state.status == "stale" and "names no corpus" in state.why and not compare.is_done(pinned, pinned.arms[2])
    (out / "no_rht.log").write_text("".join(ln for ln in text_no_rht.splitlines(keepends=True) if f"corpus {b}" not in ln))
    assert compare.read_arm_log(pinned, pinned.arms[2]).status == "current"  # its corpus named: on the pin
    code, _, err = _main([str(spec)], capsys)  # refused, not skipped as done: --rerun runs it on the pinned corpus
    assert code == 2 and "arm 'nvfp4'" in err and f"read corpus {b}" in err
    spec.write_text(text.replace(f'corpus = "{a}"', 'corpus = "abc"'))
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and "[compare] corpus must be a corpus id" in err and "'abc'" in err


def test_without_a_baseline_corpus_the_table_keeps_the_most_logged_one_and_says_so_on_a_tie(tmp_path):
    from titan_nvfp4.compare.armlog import ArmLog
    from titan_nvfp4.compare.table import one_corpus

    spec = compare.load_spec(_spec(tmp_path, third=True))
    run = [type("Step", (), {"step": 40})()]  # any logged step makes a state tabled

    def states(*ids):
        return {n: ArmLog("unchecked" if n == "bf16" else "current", run, corpus=c)
                for n, c in zip(("bf16", "nvfp4", "no_rht"), ids)}
    got = one_corpus(spec, states("", "a" * 12, "a" * 12))
    assert all(s.status != "stale" for s in got.values())  # one corpus: nothing to leave out
    got = one_corpus(spec, {**states("", "a" * 12, "b" * 12), "extra": ArmLog("current", run, corpus="b" * 12)})
    assert got["nvfp4"].status == "stale" and "that of most arms" in got["nvfp4"].why
    got = one_corpus(spec, states("", "a" * 12, "b" * 12))
    assert got["no_rht"].status == "stale" and "that of the first arm tabled (a tie)" in got["no_rht"].why
    assert got["nvfp4"].status == "current" and got["bf16"].status == "unchecked"


def test_bad_runner_inputs_get_one_line(tmp_path, capsys, monkeypatch):
    """torchrun not on PATH, a spec that is a folder, --out naming a file, a log that is a folder, an output that is a
    folder: one line each naming it, no traceback."""
    spec = _spec(tmp_path, "", launcher='["torchrun", "--standalone", "-m", "torchtitan.train"]')
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = _main([str(spec)], capsys)
    assert code == 2 and err.strip() == ("python -m titan_nvfp4.compare: error: [compare] launcher: 'torchrun' is not "
                                         "on PATH (activate the environment that has it, or give its full path)"), err
    monkeypatch.undo()

    code, _, err = _main([str(tmp_path)], capsys)
    assert code == 2 and f"spec {tmp_path} is a folder; give a .toml file" in err

    (tmp_path / "a_file").write_text("")
    code, _, err = _main([str(_spec(tmp_path)), "--out", str(tmp_path / "a_file")], capsys)
    assert code == 2 and f"out folder {tmp_path / 'a_file'} is a file" in err

    (tmp_path / "out/nvfp4.log").mkdir(parents=True)
    code, _, err = _main([str(_spec(tmp_path))], capsys)
    assert code == 2 and f"arm 'nvfp4': {tmp_path / 'out/nvfp4.log'} is not a file" in err, err
    (tmp_path / "out/nvfp4.log").rmdir()
    (tmp_path / "out/compare.csv").mkdir()
    code, _, err = _main([str(_spec(tmp_path))], capsys)
    assert code == 2 and f"CSV {tmp_path / 'out/compare.csv'} is a folder" in err and "Traceback" not in err, err
