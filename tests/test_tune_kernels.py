"""scripts/tune_kernels.py's worker hands TorchTitan the training arguments, not its own command line."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
