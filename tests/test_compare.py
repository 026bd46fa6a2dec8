"""The comparison runner (titan_nvfp4/compare/) end to end with a stub trainer process that writes
TorchTitan's log lines or TensorBoard events (tests/compare_stub.py): table, CSV, plot, skipping arms
already done, failures reported; and the spec's validation, key by key."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from titan_nvfp4 import compare

from compare_helpers import REPO, STUB, write_spec


def _spec(tmp_path: Path, arms: str, extra: str = "") -> Path:
    return write_spec(tmp_path, arms, extra)


ARMS = """
[[arm]]
name = "nvfp4"
overrides = ["--stub.offset", "0.2"]
[[arm]]
name = "bf16"
base = "%s"
[[arm]]
name = "half_way"
mode = "eager"
overrides = ["--stub.offset", "0.1", "--metrics.enable_tensorboard"]
""" % (REPO / "train_configs/llama3_bf16.toml")


def test_runner_end_to_end_with_logs_and_tensorboard(tmp_path, capsys):
    spec = _spec(tmp_path, ARMS)
    assert compare.main([str(spec)]) == 0
    out = capsys.readouterr().out
    assert "[1/3] nvfp4: exit 0" in out and "[3/3] half_way: exit 0" in out and "step 40" in out
    table, per_step = (tmp_path / "out/compare.md").read_text().split("\n\n")[:2]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:] if line.startswith("|")}
    assert per_step.splitlines()[0] == "| run | validation loss @ 20 | validation loss @ 40 |"
    assert list(rows) == ["bf16", "nvfp4", "half_way"]  # the baseline first, then the gap reference
    assert rows["nvfp4"][3].startswith("+0.2000 ± 0.0000")  # Δ vs bf16: the stub's offset, same "noise"
    assert rows["half_way"][3].startswith("+0.1000") and rows["half_way"][4] == "50.0%"  # half the gap closed
    assert rows["nvfp4"][5] == f"{8.0 / 40 ** 0.5 + 0.3:.4f} (40)" and rows["nvfp4"][6] == "+0.2000"  # validation
    assert rows["half_way"][5] == "–"  # it logged to TensorBoard only: no validation lines
    csv = (tmp_path / "out/compare.csv").read_text().splitlines()
    assert csv[0] == "run,step,loss,grad_norm,memory_gib,tps" and len(csv) == 1 + 3 * 9  # steps 1, 5, ..., 40
    assert (tmp_path / "out/compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train_configs/llama3_bf16.toml" in (tmp_path / "out/bf16.log").read_text().splitlines()[0]
    assert "step:" not in (tmp_path / "out/half_way.log").read_text()  # its losses came from TensorBoard
    # the default mode compiles under CUDA graphs; an arm's own mode wins
    assert "compile True, TORCHINDUCTOR_CUDAGRAPHS=1" in (tmp_path / "out/bf16.log").read_text()
    assert (tmp_path / "out/bf16.log").read_text().startswith("# TORCHINDUCTOR_CUDAGRAPHS=1 ")
    assert "compile False, TORCHINDUCTOR_CUDAGRAPHS=0" in (tmp_path / "out/half_way.log").read_text()

    assert compare.main([str(spec)]) == 0  # every arm is done: nothing runs again
    assert capsys.readouterr().out.count("already reached step 40") == 3

    # --out: the logs of two partial runs gathered in another folder give the same table from the logs
    other = tmp_path / "gathered"
    other.mkdir()
    for name in ("bf16", "nvfp4"):
        (other / f"{name}.log").write_text((tmp_path / f"out/{name}.log").read_text())
    assert compare.main([str(spec), "--report-only", "--out", str(other)]) == 0
    gathered = (other / "compare.md").read_text()
    assert "No logged steps yet: half_way" in gathered and "+0.2000 ± 0.0000" in gathered

    # under a corpus pin, TensorBoard events show no corpus: an arm whose losses only they hold is stale, its log
    # there (a header, no metric line) or not
    import dataclasses

    pinned = dataclasses.replace(compare.load_spec(spec), corpus="a" * 12)
    arm = pinned.by_name()["half_way"]
    assert compare.read_arm_log(pinned, arm).status == "stale"
    (tmp_path / "out/half_way.log").unlink()
    state = compare.read_arm_log(pinned, arm)
    assert state.status == "stale" and "only TensorBoard events, which name no corpus" in state.why, state
    assert compare.read_arm_log(compare.load_spec(spec), arm).status == "unchecked"  # no pin: flagged, tabled


def test_a_failing_arm_is_reported_and_the_others_still_tabled(tmp_path, capsys):
    arms = ARMS.replace('overrides = ["--stub.offset", "0.2"]', 'overrides = ["--stub.offset", "0.2", "--stub.fail_at", "12"]')
    assert compare.main([str(_spec(tmp_path, arms))]) == 1
    out = capsys.readouterr()
    assert "[1/3] nvfp4: exit 1" in out.out and "step 10" in out.out
    assert "arms that failed: nvfp4" in out.err
    assert compare.main([str(_spec(tmp_path, arms)), "--only", "bf16"]) == 0  # just that arm
    assert "[2/3] bf16: already reached step 40" in capsys.readouterr().out  # done: not run again
    with pytest.raises(SystemExit) as e:  # another mode is another run: refused, naming the arm and the change
        compare.main([str(_spec(tmp_path, arms)), "--only", "bf16", "--mode", "compile"])
    assert e.value.code == 2 and "arm 'bf16'" in (err := capsys.readouterr().err) and "CUDAGRAPHS=1 → 0" in err
    assert compare.main([str(_spec(tmp_path, arms)), "--only", "bf16", "--mode", "compile", "--rerun"]) == 0
    assert "[2/3] bf16: exit 0" in capsys.readouterr().out
    assert "compile True, TORCHINDUCTOR_CUDAGRAPHS=0" in (tmp_path / "out/bf16.log").read_text()


def _log_field(log: Path, pattern: str) -> list[str]:
    import re
    return re.findall(pattern, log.read_text())


def test_parallel_arms_overlap_each_on_its_own_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the runner's to choose (the suite may set it)
    arms = ARMS.replace('"--stub.offset", "0.2"', '"--stub.offset", "0.2", "--stub.sleep", "0.03"') \
               .replace('base = "%s"' % (REPO / "train_configs/llama3_bf16.toml"),
                        'base = "%s"\noverrides = ["--stub.sleep", "0.03"]' % (REPO / "train_configs/llama3_bf16.toml"))
    assert compare.main([str(_spec(tmp_path, arms, "parallel = 2"))]) == 0
    out = tmp_path / "out"
    span = {a: (float(_log_field(out / f"{a}.log", r"at (\d+\.\d+)")[0]), float(_log_field(out / f"{a}.log", r"done at (\d+\.\d+)")[0]))
            for a in ("nvfp4", "bf16")}
    assert span["nvfp4"][0] < span["bf16"][1] and span["bf16"][0] < span["nvfp4"][1]  # the two ran at once
    gpus = {a: _log_field(out / f"{a}.log", r"CUDA_VISIBLE_DEVICES=(\S+),")[0] for a in ("nvfp4", "bf16", "half_way")}
    assert {gpus["nvfp4"], gpus["bf16"]} == {"3", "5"} and gpus["half_way"] in ("3", "5")
    assert "on GPU 3" in capsys.readouterr().out
    assert "+0.2000 ± 0.0000" in (out / "compare.md").read_text()  # the same table as one at a time
    threads = _log_field(out / "nvfp4.log", r"(?m)^# .*OMP_NUM_THREADS=(\d+)")
    assert threads == [str(max(1, (os.cpu_count() or 1) // 2))]  # the host's cores shared between the two slots


def test_parallel_arms_keep_the_callers_openmp_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert compare.main([str(_spec(tmp_path, ARMS, "parallel = 2"))]) == 0
    assert not _log_field(tmp_path / "out" / "nvfp4.log", r"(?m)^# .*OMP_NUM_THREADS=(\d+)")


def test_a_stopped_arm_resumes_from_its_checkpoint(tmp_path, capsys):
    arms = ARMS.replace('"--stub.offset", "0.2"', '"--stub.offset", "0.2", "--stub.fail_at", "25"')
    spec = _spec(tmp_path, arms, "checkpoint_interval = 10")
    assert compare.main([str(spec)]) == 1  # nvfp4 stops at step 25, after its step-20 checkpoint
    assert sorted(p.name for p in (tmp_path / "out/nvfp4/checkpoint").iterdir()) == ["step-10", "step-20"]
    capsys.readouterr()
    assert compare.main([str(spec)]) == 0  # the others are done; nvfp4 resumes after step 20 and finishes
    out = capsys.readouterr().out
    assert "nvfp4: exit 0" in out and "(resumed)" in out and out.count("already reached step 40") == 2
    log = (tmp_path / "out/nvfp4.log").read_text()
    assert log.count("--checkpoint.enable") == 2 and "from step 1," in log and "from step 21," in log
    assert "+0.2000 ± 0.0000" in (tmp_path / "out/compare.md").read_text()  # as if it had never stopped
    assert compare.main([str(spec), "--only", "nvfp4", "--rerun"]) == 1  # afresh (checkpoints dropped): stops at 25
    assert "from step 1," in (tmp_path / "out/nvfp4.log").read_text().split("--checkpoint.enable")[-1]


def _stops(pid: int, within_s: float = 10) -> bool:
    """Whether process ``pid`` is gone within ``within_s`` (a zombie, with no init reaping it here, counts)."""
    import time

    def alive() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.time() + within_s
    while alive() and time.time() < deadline:
        time.sleep(0.1)
    return not alive()


def test_a_timeout_stops_the_arms_whole_process_group(tmp_path, capsys):
    arms = ARMS.replace('"--stub.offset", "0.2"', '"--stub.offset", "0.2", "--stub.child", "--stub.sleep", "0.2"')
    assert compare.main([str(_spec(tmp_path, arms)), "--only", "nvfp4", "--timeout-s", "2"]) == 1
    assert "nvfp4: exit 124" in capsys.readouterr().out
    assert _stops(int((tmp_path / "out/nvfp4/child.pid").read_text()))


def test_a_torchtitan03_spec_names_configs_of_a_module(tmp_path):
    """module = ...: base and the arms' bases are config names (no job files), each arm runs --module M --config C
    with the top-level --dump_folder of TorchTitan 0.3."""
    arms = '[[arm]]\nname = "bf16"\nbase = "llama3_debug_bf16"\n[[arm]]\nname = "nvfp4"\noverrides = ["--stub.offset", "0.2"]\n'
    spec = _spec(tmp_path, arms, 'module = "titan_nvfp4.integration_v03.configs"').read_text()
    (tmp_path / "spec.toml").write_text(spec.replace(str(REPO / "train_configs/llama3_nvfp4.toml"), "llama3_debug_nvfp4"))
    s = compare.load_spec(tmp_path / "spec.toml")
    cmd = s.command(s.arms[0])
    assert cmd[2:8] == ["--module", "titan_nvfp4.integration_v03.configs", "--config", "llama3_debug_bf16",
                        "--training.steps", "40"]
    assert cmd[8:10] == ["--dump_folder", str(tmp_path / "out/bf16")] and "--job.config_file" not in cmd
    assert compare.main([str(tmp_path / "spec.toml")]) == 0
    assert "Starting job from llama3_debug_nvfp4 (module titan_nvfp4.integration_v03.configs)" in \
        (tmp_path / "out/nvfp4.log").read_text()
    assert "+0.2000 ± 0.0000" in (tmp_path / "out/compare.md").read_text()


@pytest.mark.parametrize("extra,arms,needles", [
    ("stepz = 3", ARMS, ["stepz", "unknown [compare] keys"]),
    ("", ARMS.replace('name = "half_way"', 'name = "bf16"'), ["'bf16'", "unique"]),
    ("", '[[arm]]\nname = "bf16"', ["at least two"]),
    ("", ARMS.replace('"0.1", "--metrics', '0.1, "--metrics'), ["half_way", "overrides", "list of strings"]),
    ("", ARMS.replace('name = "nvfp4"', 'name = "nvfp4"\ncolor = "red"'), ["nvfp4", "unknown keys", "color"]),
    ("", ARMS + '[[arm]]\nname = "x"\nbase = "nope.toml"', ["'x'", "nope.toml"]),
    ('mode = "cudagraphs"', ARMS, ["[compare] mode", "'cudagraphs'", "'compile+cudagraphs'", "'eager'"]),
    ("parallel = 0", ARMS, ["[compare] parallel", ">= 1", "0"]),
    ("module = 3", ARMS, ["[compare] module must be a string"]),
    ('checkpoint_interval = "10"', ARMS, ["[compare] checkpoint_interval", "'10'"]),
    ("", ARMS.replace('mode = "eager"', 'mode = "fast"'), ["arm 'half_way' mode", "'fast'"]),
], ids=["unknown_key", "duplicate_arm", "one_arm", "override_not_string", "unknown_arm_key", "missing_base", "bad_mode",
        "bad_arm_mode", "parallel_zero", "module_not_string", "interval_not_int"])
def test_bad_specs_are_refused_by_key(tmp_path, extra, arms, needles):
    with pytest.raises(ValueError) as e:
        compare.load_spec(_spec(tmp_path, arms, extra))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("launcher", ['[""]', '["  "]', '["python", ""]'])
def test_an_empty_launcher_is_refused_at_load(tmp_path, launcher):
    path = _spec(tmp_path, ARMS)
    text = path.read_text()
    start = text.index("launcher = [")
    path.write_text(text[:start] + f"launcher = {launcher}" + text[text.index("]", start) + 1:])
    with pytest.raises(ValueError, match=r"\[compare\] launcher must be a non-empty list of non-empty words"):
        compare.load_spec(path)


def test_baseline_must_be_an_arm(tmp_path):
    spec = _spec(tmp_path, ARMS).read_text().replace('baseline = "bf16"', 'baseline = "fp8"')
    (tmp_path / "spec.toml").write_text(spec)
    with pytest.raises(ValueError, match="baseline = 'fp8' is not an arm"):
        compare.load_spec(tmp_path / "spec.toml")


def test_shipped_spec_parses(monkeypatch):
    monkeypatch.chdir(REPO)  # the spec's paths are relative to the repo root, where the runner runs
    spec = compare.load_spec(REPO / "configs/compare/llama3_debug.toml")
    assert spec.baseline == "bf16" and spec.reference == "nvfp4" and len(spec.arms) == 9
    cmd = spec.command(spec.arms[2])
    assert cmd[-2:] == ["--quantize.linear.nvfp4.rht", "False"] and "--job.dump_folder" in cmd
    assert "--compile.enable" in cmd and spec.env(spec.arms[2])["TORCHINDUCTOR_CUDAGRAPHS"] == "1"  # the fastest mode


def test_gpt_oss_arms_take_the_default_mode_like_any_other(tmp_path):
    """gpt_oss trains under CUDA graph trees (its attention masks built without graphs: torchtitan_fixes.py; H100,
    2026-11-28), so its arms get compile+cudagraphs like Llama3's; a spec's or an arm's mode still wins."""
    arms = f"""
[[arm]]
name = "bf16"
base = "{REPO / 'train_configs/gpt_oss_bf16.toml'}"
[[arm]]
name = "nvfp4"
mode = "eager"
"""
    spec = compare.load_spec(_spec(tmp_path, arms))
    assert [spec.arm_mode(a) for a in spec.arms] == ["compile+cudagraphs", "eager"]
    assert spec.env(spec.arms[0])["TORCHINDUCTOR_CUDAGRAPHS"] == "1" and "--compile.enable" in spec.command(spec.arms[0])
    spec = compare.load_spec(_spec(tmp_path, arms, 'mode = "compile"'))
    assert [spec.arm_mode(a) for a in spec.arms] == ["compile", "eager"]


def test_stopping_the_runner_stops_the_running_arms(tmp_path):
    """SIGTERM to the runner (as a device call's limit or Ctrl-C would stop it) also stops the arm it runs: the arm
    leads its own process group, so the runner takes it down itself."""
    import os
    import signal
    import subprocess
    import time

    arms = ARMS.replace('"--stub.offset", "0.2"', '"--stub.offset", "0.2", "--stub.child", "--stub.sleep", "0.5"')
    runner = subprocess.Popen([sys.executable, "-m", "titan_nvfp4.compare", str(_spec(tmp_path, arms)), "--only",
                               "nvfp4"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid_file = tmp_path / "out/nvfp4/child.pid"
    deadline = time.time() + 60
    while not pid_file.is_file() and time.time() < deadline:
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    runner.send_signal(signal.SIGTERM)
    runner.wait(timeout=60)
    assert runner.returncode != 0

    assert _stops(pid)


def _device_tree(tmp_path: Path, sleep_s: str = "0.1"):
    """A tree as the device tool copies it (scripts/compare_on_device.sh, device setup and kernel-cache packing
    stubbed, the arms tests/compare_stub.py sleeping ``sleep_s`` a step) and ``call(*args, wait_s)``, one device
    call: in a session of its own, killed once the call returns, as the device tool may do."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "tests").mkdir()
    shutil.copy(REPO / "tests/compare_stub.py", repo / "tests")
    (repo / ".kernel_cache/triton").mkdir(parents=True)
    (repo / ".kernel_cache/triton/kernel.bin").write_text("compiled")
    shutil.copy(REPO / "scripts/compare_on_device.sh", repo / "scripts")
    (repo / "scripts/device_setup.sh").write_text(
        f'export PYTHONPATH={REPO}:$PWD TRITON_CACHE_DIR=$PWD/.kernel_cache/triton\n')
    (repo / "scripts/save_kernel_cache.sh").write_text(
        'echo "kernel caches packed from $TRITON_CACHE_DIR: $(ls "$TRITON_CACHE_DIR")"\n')
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this interpreter (a venv's)
    (tmp_path / "bin/python").chmod(0o755)
    arms = ARMS.replace('"--stub.offset", "0.2"', f'"--stub.offset", "0.2", "--stub.sleep", "{sleep_s}"')
    spec = _spec(tmp_path, arms)
    spec.write_text(spec.read_text().replace(str(STUB), "tests/compare_stub.py"))  # relative: read from the tree

    def call(*args, wait_s, state=tmp_path / "state", stop_after_s=None):
        out = tmp_path / f"OUT{len(list(tmp_path.glob('OUT*')))}"
        out.mkdir()
        env = {**os.environ, "OUT": str(out), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "WAIT_S": str(wait_s),
               "POLL_S": "1", "COMPARE_STATE_DIR": str(state)}
        p = subprocess.Popen(["bash", "scripts/compare_on_device.sh", *args], cwd=repo, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=stop_after_s if stop_after_s is not None else 120)
        except subprocess.TimeoutExpired:  # the device tool's time limit: SIGTERM to the call
            p.send_signal(signal.SIGTERM)
            stdout, stderr = p.communicate(timeout=60)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), out

    return repo, spec, call


def _packed_logs(out: Path) -> dict[str, str]:
    import tarfile

    with tarfile.open(out / "logs.tar.xz") as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_a_detached_run_trains_on_between_device_calls(tmp_path):
    """scripts/compare_on_device.sh --detach starts the runner in a session of its own and returns (124 while it
    runs) with the logs so far; a second --detach is refused while it runs; --wait waits for it and returns its exit
    status with every arm's full log, the table and the plot in $OUT. Between calls the device tool copies the
    tree afresh and replaces the carried kernel caches: the runner runs from a snapshot and on copies of the
    caches, so removing the tree's files and caches after --detach stops nothing (the arms' launcher is a path
    in the tree, read when each arm starts). Device setup and kernel-cache packing stubbed; the arms are
    tests/compare_stub.py."""
    import shutil

    repo, spec, call = _device_tree(tmp_path)  # each step 0.1 s: still running at the second --detach
    r, _ = call("--wait", wait_s=1)
    assert r.returncode == 1 and "no detached run" in r.stderr
    # refused before anything starts: logs inside the tree but outside outputs/, a state folder holding the tree
    r, _ = call("--detach", str(spec), "--out", "docs/ranking", wait_s=0)
    assert r.returncode == 1 and "use a folder under outputs/" in r.stderr and not (tmp_path / "state").exists()
    r, _ = call("--detach", str(spec), wait_s=0, state=tmp_path)
    assert r.returncode == 1 and "holds this tree" in r.stderr and (repo / "scripts/compare_on_device.sh").is_file()
    r, _ = call("--detach", str(spec), "--only", "nvfp4", "bf16", wait_s=0)
    assert r.returncode == 124 and "runner detached" in r.stdout, r.stdout + r.stderr
    pid = int((tmp_path / "state/pid").read_text())
    assert os.getsid(pid) == pid  # the recorded pid leads the runner's own session
    r, _ = call("--detach", str(spec), wait_s=0)
    assert r.returncode == 1 and "still going" in r.stderr
    shutil.rmtree(repo / "tests")  # the next call's copy of the tree, mid-way; the carry replaces .kernel_cache
    shutil.rmtree(repo / ".kernel_cache")
    r, out = call("--wait", wait_s=100)
    assert r.returncode == 0, r.stdout + r.stderr
    # the copy of device_setup.sh's cache folder that the runner used, kept from --detach
    assert f"kernel caches packed from {tmp_path / 'state/cache/TRITON'}: kernel.bin" in r.stdout
    assert (out / "compare.md").is_file() and (out / "compare.png").is_file()
    logs = _packed_logs(out)
    assert set(logs) == {"nvfp4.log", "bf16.log"}
    assert all("step: 40 " in text for text in logs.values())


def test_a_detached_run_killed_cut_short_or_misdirected_loses_no_log(tmp_path):
    """compare_on_device.sh removes only state folders it made, never a logs' folder inside one, and reads --out=DIR
    as the runner does; a --wait cut short by a signal still packs the logs so far; a runner killed without an exit
    status is reported at once (not waited on until WAIT_S), with the logs; a --detach that fails leaves no earlier
    run's state for --wait to report as its own."""
    _, spec, call = _device_tree(tmp_path, sleep_s="1.0")  # 40 steps: 40 s an arm, killed long before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.log").write_text("keep")
    r, _ = call("--detach", str(spec), wait_s=0, state=mine)
    assert r.returncode == 1 and "did not make" in r.stderr and (mine / "results.log").read_text() == "keep"
    r, _ = call("--detach", str(spec), "--out", str(tmp_path / "state/logs"), wait_s=0)
    assert r.returncode == 1 and "inside COMPARE_STATE_DIR" in r.stderr, r.stderr
    r, _ = call("--detach", str(spec), "--out=docs/ranking", wait_s=0)
    assert r.returncode == 1 and "use a folder under outputs/" in r.stderr, r.stderr
    r, _ = call("--detach", str(spec), "--out=", wait_s=0)
    assert r.returncode == 1 and "--out names no folder" in r.stderr, r.stderr
    (tmp_path / "a_file").write_text("keep")
    r, _ = call("--detach", str(spec), wait_s=0, state=tmp_path / "a_file")
    assert r.returncode == 1 and "did not make" in r.stderr and (tmp_path / "a_file").read_text() == "keep"

    r, _ = call("--detach", str(spec), "--only", "nvfp4", wait_s=0)
    assert r.returncode == 124, r.stdout + r.stderr
    import time

    log, deadline = tmp_path / "out/nvfp4.log", time.time() + 90
    while not (log.is_file() and "step:" in log.read_text()) and time.time() < deadline:  # a loaded machine
        time.sleep(0.5)
    r, out = call("--wait", wait_s=100, stop_after_s=3)  # the device tool's limit: SIGTERM
    assert r.returncode == 124 and "stopped by a signal" in r.stdout, r.stdout + r.stderr
    assert "step:" in _packed_logs(out)["nvfp4.log"]
    pid = int((tmp_path / "state/pid").read_text())
    os.killpg(pid, signal.SIGKILL)  # the runner's session, killed: no exit status written
    r, out = call("--wait", wait_s=100)
    assert r.returncode == 1 and "ended without an exit status" in r.stderr, r.stdout + r.stderr
    assert "step:" in _packed_logs(out)["nvfp4.log"]
    r, _ = call("--detach", str(spec), "--out", "docs/ranking", wait_s=0)  # refused after the old state went
    assert r.returncode == 1
    r, _ = call("--wait", wait_s=1)
    assert r.returncode == 1 and "no detached run" in r.stderr


def test_logs_brought_back_from_a_device_call_are_judged_before_they_land(tmp_path, capsys):
    """--import-logs takes each arm's log from a tar (a device call's logs.tar.xz) or a folder into the output folder
    only if it is a run of this spec with more logged steps than the log there, which it must continue unless
    --replace-logs; stale logs, unknown arms, failed starts and logs with fewer steps are left out, by name."""
    import re
    import tarfile

    arms = ARMS.split("[[arm]]\nname = \"half_way\"")[0]  # nvfp4 and bf16, both logging metric lines
    spec = _spec(tmp_path, arms)
    assert compare.main([str(spec)]) == 0
    run = tmp_path / "out"
    full = {n: (run / f"{n}.log").read_text() for n in ("nvfp4", "bf16")}
    archive = tmp_path / "logs.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for n in full:
            tar.add(run / f"{n}.log", arcname=f"./{n}.log")
    capsys.readouterr()

    def imported(source, *extra):
        rc = compare.main([str(spec), "--import-logs", str(source), "--out", str(tmp_path / "home"), *extra])
        return rc, [line for line in capsys.readouterr().out.splitlines() if line.startswith("compare: ")]

    rc, lines = imported(archive)
    assert rc == 0 and lines[:2] == ["compare: nvfp4: imported, step 40 of 40 (complete)",
                                     "compare: bf16: imported, step 40 of 40 (complete)"], lines
    assert {n: (tmp_path / "home" / f"{n}.log").read_text() for n in full} == full
    assert "+0.2000" in (tmp_path / "home/compare.md").read_text()  # the table, from the imported logs
    rc, lines = imported(archive)
    assert "compare: bf16: already there (the same log, step 40)" in lines
    # the same run's log, cut after its last step but before the lines after it (a final validation, the end):
    # the full one continues it, though it reaches no further step
    tail = full["bf16"].rindex("step: 40 ")
    (tmp_path / "home/bf16.log").write_text(full["bf16"][: full["bf16"].index("\n", tail) + 1])
    rc, lines = imported(archive)
    assert "compare: bf16: imported, step 40 of 40 (complete)" in lines
    assert (tmp_path / "home/bf16.log").read_text() == full["bf16"]

    # a partial log is continued by the complete one; a log of another run of the arm needs --replace-logs
    cut = full["bf16"][: full["bf16"].index("step: 25 ")]
    cut = cut[: cut.rindex("\n") + 1]
    (tmp_path / "home/bf16.log").write_text(cut)
    rc, lines = imported(archive)
    assert "compare: bf16: imported, step 40 of 40 (complete)" in lines
    other = cut.replace("loss:", "loss:  9", 1)  # the same steps, other numbers: another run
    (tmp_path / "home/bf16.log").write_text(other)
    rc, lines = imported(archive)
    assert any(line.startswith("compare: bf16: skipped, the log there holds another run") for line in lines)
    assert (tmp_path / "home/bf16.log").read_text() == other
    rc, lines = imported(archive, "--replace-logs")
    assert (tmp_path / "home/bf16.log").read_text() == full["bf16"]
    (tmp_path / "home/bf16.log").write_text("")  # an empty log there: continued by any
    rc, lines = imported(archive)
    assert "compare: bf16: imported, step 40 of 40 (complete)" in lines
    # a finished log of another spec there (stale: it carries no steps a table may show) is another run all the same
    finished_elsewhere = re.sub(r"spec [0-9a-f]{16}", "spec " + "0" * 16, full["bf16"])
    (tmp_path / "home/bf16.log").write_text(finished_elsewhere)
    cut_archive = tmp_path / "cut.tar"
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut/bf16.log").write_text(cut)
    with tarfile.open(cut_archive, "w") as tar:
        tar.add(tmp_path / "cut/bf16.log", arcname="bf16.log")
    rc, lines = imported(cut_archive)
    assert any(line.startswith("compare: bf16: skipped, the log there holds another run of the arm (stale:")
               for line in lines), lines
    assert (tmp_path / "home/bf16.log").read_text() == finished_elsewhere
    rc, lines = imported(archive, "--replace-logs")
    assert (tmp_path / "home/bf16.log").read_text() == full["bf16"]
    # two members of one name (a hand-made archive): which is the arm's cannot be told
    twice = tmp_path / "twice.tar"
    with tarfile.open(twice, "w") as tar:
        tar.add(tmp_path / "cut/bf16.log", arcname="sub/bf16.log")
        tar.add(run / "bf16.log", arcname="./bf16.log")
    with pytest.raises(SystemExit):
        imported(twice)
    assert "holds two logs named bf16.log (sub/bf16.log and ./bf16.log)" in capsys.readouterr().err

    # a folder source: another spec's log, an arm the spec lacks, a failed start, and --only
    folder = tmp_path / "incoming"
    folder.mkdir()
    stale = re.sub(r"spec [0-9a-f]{16}", "spec " + "0" * 16, full["nvfp4"].replace("--training.steps 40",
                                                                                  "--training.steps 30"))
    (folder / "nvfp4.log").write_text(stale)  # as a run of the spec with 30 steps would have logged it
    (folder / "stranger.log").write_text(full["bf16"])
    (folder / "bf16.log").write_text(full["bf16"][: full["bf16"].index("step:")])
    (tmp_path / "home/nvfp4.log").unlink()
    (tmp_path / "home/bf16.log").unlink()
    rc, lines = imported(folder)
    assert any(line.startswith(f"compare: nvfp4: skipped, stale: {folder}: nvfp4.log ran another spec")
               and "--training.steps 30 → 40" in line for line in lines), lines
    assert "compare: stranger: skipped, not an arm of this spec" in lines
    assert "compare: bf16: skipped, no logged step (a run that failed at its start)" in lines
    assert not (tmp_path / "home/nvfp4.log").exists() and not (tmp_path / "home/bf16.log").exists()
    rc, lines = imported(archive, "--only", "nvfp4")
    assert (tmp_path / "home/nvfp4.log").is_file() and not (tmp_path / "home/bf16.log").exists()

    for argv, why in (([str(spec), "--import-logs", str(tmp_path / "none.tar")], "no such file or folder"),
                      ([str(spec), "--import-logs", str(spec)], "not a readable tar archive"),
                      ([str(spec), "--replace-logs"], "--replace-logs goes with --import-logs"),
                      ([str(spec), "--ou", str(tmp_path)], "unrecognized arguments: --ou")):
        with pytest.raises(SystemExit):
            compare.main(argv)
        assert why in capsys.readouterr().err
