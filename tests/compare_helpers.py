"""A comparison spec over the stub trainer (tests/compare_stub.py), shared by the runner's tests."""

from __future__ import annotations

import sys
from pathlib import Path

STUB = str(Path(__file__).with_name("compare_stub.py"))
REPO = Path(__file__).resolve().parents[1]


def write_spec(tmp_path: Path, arms: str, extra: str = "") -> Path:
    """``tmp_path/spec.toml``: 40 steps of the stub into ``tmp_path/out``, baseline bf16, reference nvfp4, a metric
    line every 5 steps; ``extra`` lines in [compare], then ``arms``."""
    p = tmp_path / "spec.toml"
    p.write_text(f"""
[compare]
base = "{REPO / 'train_configs/llama3_nvfp4.toml'}"
steps = 40
out = "{tmp_path / 'out'}"
last = 3
baseline = "bf16"
reference = "nvfp4"
common = ["--metrics.log_freq", "5"]
launcher = ["{sys.executable}", "{STUB}"]
{extra}
{arms}""")
    return p
