"""scripts/e2e_ab.sh: --prepare copies a git revision's files into ab/<rev>; the device form runs e2e_bench.sh on
the tree, then the NVFP4 arm from each copy with the same kernel caches, reported against the tree's BF16 run.
torchrun and the device setup are stubbed (no GPU): the stub records where and with which caches each arm ran."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOG = REPO / "tests" / "data" / "llama3_bf16.log"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.mark.slow(reason="two revisions' corpus builds and four stand-in runs, 30 s on 2 cores")
def test_e2e_ab_runs_each_revision_from_its_copy_against_one_bf16_run(tmp_path):
    repo = tmp_path / "repo"
    for d in ("scripts", "titan_nvfp4", "train_configs", "configs", "benchmarks", "tests"):
        (repo / d).mkdir(parents=True)
        (repo / d / "keep").write_text("")
    (repo / "pyproject.toml").write_text("")
    for script in ("e2e_ab.sh", "e2e_bench.sh"):
        shutil.copy(REPO / "scripts" / script, repo / "scripts")
    setup = repo / "scripts/device_setup.sh"
    setup.write_text(f"export PYTHONPATH={REPO}\necho 'setup of the head'\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "head")
    _git(repo, "checkout", "-q", "-b", "feature/x")
    setup.write_text(f"export PYTHONPATH={REPO}\necho 'setup of feature/x'\n")
    _git(repo, "commit", "-q", "-am", "feature")
    _git(repo, "checkout", "-q", "main")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\necho "$PWD $TRITON_CACHE_DIR $*" >> {tmp_path}/runs.txt\ncat {LOG}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CONFIG": "llama3", "SKIP": "2",
           "AB_WORK": str(tmp_path / "work"),
           "TITAN_NVFP4_DATA_DIR": str(tmp_path / "assets")}  # one corpus for both revisions: the second reuses it
    env.pop("TRITON_CACHE_DIR", None)

    r = subprocess.run(["bash", "scripts/e2e_ab.sh", "--prepare", "feature/x"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "feature/x" in (repo / "ab/feature_x/scripts/device_setup.sh").read_text()

    r = subprocess.run(["bash", "scripts/e2e_ab.sh", "out", "feature/x", "--", "--training.steps", "10"], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = (tmp_path / "runs.txt").read_text().splitlines()
    assert len(runs) == 3, runs  # head BF16, head NVFP4, the copy's NVFP4
    cwds, caches = [line.split()[0] for line in runs], {line.split()[1] for line in runs}
    assert cwds == [str(repo)] * 2 + [str(repo / "ab/feature_x")]
    assert caches == {str(repo / ".kernel_cache/triton")}
    assert all("llama3_nvfp4.toml" in line for line in runs[1:]) and "--training.steps 10" in runs[2]
    assert "setup of feature/x" in (tmp_path / "work/feature_x/device_setup.log").read_text()
    assert (tmp_path / "work/feature_x/llama3_bf16_bsconfig.log").read_text() == LOG.read_text()
    report = (repo / "out/ab.md").read_text()
    assert report.index("## head") < report.index("## feature_x")
    assert report.count("step-time ratio") == 2 and "setup: setup of feature/x" in report
    # few files come back from the device: the report and the three training logs, nothing in folders
    assert sorted(p.name for p in (repo / "out").iterdir()) == ["ab.md", "feature_x_nvfp4.log", "head_bf16.log",
                                                               "head_nvfp4.log"]
    assert (repo / "out/head_bf16.log").read_text() == LOG.read_text()

    r = subprocess.run(["bash", "scripts/e2e_ab.sh", "out", "nothing"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no ab/nothing" in r.stderr
