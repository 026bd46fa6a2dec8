"""scripts/tune_kernels.py: the worker hands TorchTitan the training arguments; a run stopped at its timeout keeps what
it tuned for the next call to resume from."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow(reason="a device tool's worker building TorchTitan's Trainer, 11 s on 2 cores")
def test_worker_trains_with_the_arguments_after_the_separator(tmp_path):
    # TorchTitan 0.2's ConfigManager.parse_args binds sys.argv[1:] as its default when first imported; a worker that
    # set sys.argv after that import made TorchTitan reject "--worker <dump>" (exit 2 on the H200, 2026-12-05).
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "no_such_model"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tune_kernels.py"), "--worker", str(tmp_path / "d.json"),
                           "--", "--job.config_file", str(job), "--training.steps", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Unrecognized options" not in out
    # The arguments parsed, so TorchTitan built its Trainer (which then wants torchrun's LOCAL_RANK).
    assert "KeyError: 'LOCAL_RANK'" in out, out[-2000:]
    assert not (tmp_path / "d.json").exists()


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tune_kernels_script", REPO / "scripts" / "tune_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_stopped_at_the_timeout_leaves_a_partial_table_to_resume_from(tmp_path, monkeypatch):
    # The DeepSeek-V3-16B-shaped job did not finish tuning within one device call (260 s, 2026-12-06): what a stopped
    # run tuned must survive, and the next call must tune only what is missing.
    import argparse

    from titan_nvfp4.kernels import gemm, grouped_gemm, launch, quantize, shipped_tuning, swiglu  # noqa: F401

    tuner = next(t for t in launch.TUNERS if len(t.configs) > 1)
    name, entry = tuner.base_fn.__name__, shipped_tuning.config_entry(tuner.configs[1])
    base = tmp_path / "base.json"
    header = {"generated": "2026-12-05 19:13 UTC", "command": "python scripts/tune_kernels.py --jobs x.toml",
              "runs": ["x.toml (eager)"]}
    base.write_text(json.dumps({"format": shipped_tuning.FORMAT, **header, "kernels": {name: {"[1, 2]": entry}}}))
    (tmp_path / "base.kernels.json").write_text("{}")  # the base table's manifest (its content is not read here)
    seen = []

    def stopped_run(job, mode, steps, extra, scratch, timeout, table=None, record=False, logs=None):
        seen.append((job, mode, table, record))
        return {"gpu_class": "sm90", "gpu": "test", "partial": True,
                "kernels": {name: {"configs": len(tuner.configs), "shipped": 1,
                                   "choices": {"[1, 2]": entry, "[3, 4]": entry}}}}

    mod = _script()
    monkeypatch.setattr(mod, "run_job", stopped_run)
    out = tmp_path / "sm90.json"
    args = argparse.Namespace(jobs=["a.toml", "b.toml"], modes=["eager"], steps=2, extra=[], base=base, resume=True,
                              timeout=5, logs=None)
    with pytest.raises(SystemExit) as e:
        mod.tune_and_record(args, "sm90", out, {name: {"[1, 2]": entry}}, tmp_path)
    assert e.value.code == 3
    assert seen == [("a.toml", "eager", base.resolve(), False)]  # the base's choices served the run; b.toml waits
    doc = json.loads(out.read_text())
    assert "partial" in doc and "--resume" in doc["partial"]
    assert doc["runs"] == ["a.toml (eager)"] and doc["earlier"] == [header]  # the base's keys keep their provenance
    assert set(doc["kernels"][name]) == {"[1, 2]", "[3, 4]"}
    assert not (tmp_path / "sm90.kernels.json").exists()  # no manifest for a partial table
    assert doc["manifest_from"] == str(tmp_path / "base.kernels.json")  # the base's, merged once the table is done
    assert mod.base_manifest(out) == tmp_path / "base.kernels.json"
    shipped_tuning.clear()
    assert len(shipped_tuning.choices(out, name, tuner.configs)) == 2


def test_resume_needs_a_base(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tune_kernels.py"), "--resume",
                           "--out", str(tmp_path / "t.json")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--resume needs --base" in proc.stderr


def _fake_torchrun(tmp_path, monkeypatch, body: str) -> Path:
    """A stand-in ``torchrun`` (a Python script of ``body``) first on PATH; the folder it is in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!{sys.executable}\n{body}")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_a_run_past_its_timeout_is_stopped_and_its_last_snapshot_kept(tmp_path, monkeypatch):
    # A stand-in torchrun whose worker has written one snapshot and then hangs (a kernel still tuning).
    _fake_torchrun(tmp_path, monkeypatch, f"""import json, sys, time
dump = sys.argv[sys.argv.index("--worker") + 1]
json.dump({{"gpu_class": "sm90", "gpu": "test", "partial": True, "kernels": {{}}}}, open(dump, "w"))
open({str(tmp_path / "started")!r}, "w").close()
time.sleep(600)
""")
    mod = _script()
    logs = tmp_path / "logs"
    logs.mkdir()
    got = mod.run_job("train_configs/llama3_nvfp4.toml", "eager", 2, [], tmp_path, timeout=2, logs=logs)
    assert got["partial"] is True
    assert (tmp_path / "started").exists() and (logs / "llama3_nvfp4_eager.log").is_file()


def test_a_run_past_its_timeout_without_a_snapshot_fails_naming_the_job(tmp_path, monkeypatch):
    _fake_torchrun(tmp_path, monkeypatch, "import time\ntime.sleep(600)\n")
    with pytest.raises(SystemExit, match=r"llama3_nvfp4.toml \(eager\) ran past --timeout 1 s"):
        _script().run_job("train_configs/llama3_nvfp4.toml", "eager", 2, [], tmp_path, timeout=1)


def test_a_resumed_run_that_tunes_nothing_new_fails_instead_of_looping(tmp_path, monkeypatch):
    import argparse

    from titan_nvfp4.kernels import gemm, grouped_gemm, launch, quantize, shipped_tuning, swiglu  # noqa: F401

    tuner = next(t for t in launch.TUNERS if len(t.configs) > 1)
    name, entry = tuner.base_fn.__name__, shipped_tuning.config_entry(tuner.configs[0])
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"format": shipped_tuning.FORMAT, "kernels": {name: {"[1, 2]": entry}}}))

    def stopped_again(*a, **k):
        return {"gpu_class": "sm90", "gpu": "test", "partial": True,
                "kernels": {name: {"configs": len(tuner.configs), "shipped": 1, "choices": {"[1, 2]": entry}}}}

    mod = _script()
    monkeypatch.setattr(mod, "run_job", stopped_again)
    args = argparse.Namespace(jobs=["a.toml"], modes=["eager"], steps=2, extra=[], base=base, resume=True, timeout=5,
                              logs=None)
    with pytest.raises(SystemExit, match="tuned no key beyond --base"):
        mod.tune_and_record(args, "sm90", tmp_path / "out.json", {name: {"[1, 2]": entry}}, tmp_path)
    assert not (tmp_path / "out.json").exists()


def test_the_autotuning_seconds_are_read_from_tritons_lines(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[rank0]: step 1\nTriton autotuning for function _quantize_kernel,\nwith key as (8192, 2048, True, "
                   "'torch.bfloat16'),\nfinished after 3.25s,\nbest config selected: BM: 32;\nnoise\n"
                   "Triton autotuning for function _quantize_kernel,\nwith key as (4096, 2048),\nfinished after 1.5s,\n"
                   "best config selected: x;\nTriton autotuning for function _nvfp4_gemm_kernel,\nwith key as (1, 2),\n"
                   "finished after 0.75s,\nbest config selected: y;\n")
    assert _script().autotune_seconds(log) == {"_quantize_kernel": 4.75, "_nvfp4_gemm_kernel": 0.75}
    assert _script().autotune_seconds(tmp_path / "missing.log") == {}


def test_a_worker_that_outlives_its_torchrun_is_killed(tmp_path, monkeypatch):
    # torchrun starts its worker in a session of its own: if torchrun itself will not stop, killing it leaves the
    # worker holding the GPU. The stand-in torchrun ignores SIGTERM and starts a worker that writes its pid and hangs.
    worker = tmp_path / "tune_kernels.py"
    worker.write_text("import os, sys, time\nopen(sys.argv[1] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    _fake_torchrun(tmp_path, monkeypatch, f"""import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dump = sys.argv[sys.argv.index("--worker") + 1]
subprocess.Popen([sys.executable, {str(worker)!r}, dump], start_new_session=True)
time.sleep(600)
""")
    mod = _script()
    monkeypatch.setattr(mod, "STOP_GRACE_S", 1)
    with pytest.raises(SystemExit, match="ran past --timeout"):
        mod.run_job("train_configs/llama3_nvfp4.toml", "eager", 2, [], tmp_path, timeout=3)
    pid = int((tmp_path / "llama3_nvfp4_eager.json.pid").read_text())
    import time
    for _ in range(50):  # SIGKILL is delivered at once; the zombie is reaped by init
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except (ProcessLookupError, FileNotFoundError):
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the worker {pid} still runs")


def test_a_table_built_over_several_calls_names_every_run_behind_it(tmp_path):
    # Session 31 resumed the shipped table (two runs of 2026-12-05) with the 16B job: the new header must not drop them.
    mod = _script()
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"generated": "g1", "command": "c1", "runs": ["a (eager)"], "kernels": {}}))
    second = tmp_path / "second.json"
    second.write_text(json.dumps({**mod.provenance(["b (eager)"], first), "kernels": {}}))
    third = mod.provenance(["c (eager)"], second)
    assert third["runs"] == ["c (eager)"] and third["command"].startswith("python scripts/tune_kernels.py")
    assert [e["runs"] for e in third["earlier"]] == [["a (eager)"], ["b (eager)"]]
    assert third["earlier"][0] == {"generated": "g1", "command": "c1", "runs": ["a (eager)"]}
    assert "earlier" not in mod.provenance(["d (eager)"], None)
