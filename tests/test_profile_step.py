"""scripts/profile_step.sh with MEMORY=1: after the time profile, each arm runs again with allocation history and the
report of what is live at each arm's memory peak lands in OUT/memory_peak.md, the snapshots themselves removed.
torchrun and the device setup are stubbed (no GPU): the stub writes the snapshot TorchTitan would."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_TORCHRUN = r'''#!{python}
import pickle, sys
from pathlib import Path
args = sys.argv[1:]
dump = Path(args[args.index("--job.dump_folder") + 1])
arm = "nvfp4" if "nvfp4" in args[args.index("--job.config_file") + 1] else "bf16"
print("step: 10  loss:  5.0")
if "--profiling.enable_memory_snapshot" in args:
    mib = 2**20
    size = (300 if arm == "nvfp4" else 200) * mib
    frames = [{{"filename": "/x/titan_nvfp4/ops/grouped.py" if arm == "nvfp4" else "/x/torchtitan/models/moe/moe.py",
                "line": 7, "name": "forward"}}]
    snap = {{"segments": [{{"device": 0, "address": 0, "total_size": size,
                             "blocks": [{{"size": size, "state": "active_allocated", "frames": frames}}]}}],
             "device_traces": [[{{"action": "alloc", "addr": 0, "size": size, "frames": frames}}]]}}
    folder = dump / "memory_snapshot" / "iteration_10"
    folder.mkdir(parents=True)
    (folder / "rank0_memory_snapshot.pickle").write_bytes(pickle.dumps(snap))
'''


@pytest.mark.slow(reason="two profiled stand-in runs, 24 s on 2 cores")
def test_memory_peaks_of_both_arms_are_reported_and_the_snapshots_removed(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts/profile_step.sh", repo / "scripts")
    (repo / "scripts/device_setup.sh").write_text(f"export PYTHONPATH={REPO}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(_TORCHRUN.format(python=sys.executable))
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEMORY": "1", "CONFIG": "deepseek_v3"}
    r = subprocess.run(["bash", "scripts/profile_step.sh", "out"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (repo / "out/memory_peak.md").read_text()
    assert "## bf16: peak 0.20 GiB live" in report
    assert "## nvfp4: peak 0.29 GiB live, at event 1 of 1; +0.10 GiB against bf16" in report
    assert "`titan_nvfp4/ops/grouped.py:7 forward`" in report
    left = sorted(p.name for p in (repo / "out").iterdir())
    assert not [n for n in left if n.endswith(".pickle") or n.startswith(("mem_", "dump_"))], left
    assert {"bf16_memory.log", "nvfp4_memory.log", "memory_peak.md"} <= set(left)
