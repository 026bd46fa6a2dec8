"""The comparison runner (titan_nvfp4/compare.py) end to end with a stub trainer process that writes
TorchTitan's log lines or TensorBoard events (tests/compare_stub.py): table, CSV, plot, skipping arms
already done, failures reported; and the spec's validation, key by key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from titan_nvfp4 import compare

STUB = str(Path(__file__).with_name("compare_stub.py"))
REPO = Path(__file__).resolve().parents[1]


def _spec(tmp_path: Path, arms: str, extra: str = "") -> Path:
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


ARMS = """
[[arm]]
name = "nvfp4"
overrides = ["--stub.offset", "0.2"]
[[arm]]
name = "bf16"
base = "%s"
[[arm]]
name = "half_way"
overrides = ["--stub.offset", "0.1", "--metrics.enable_tensorboard"]
""" % (REPO / "train_configs/llama3_bf16.toml")


def test_runner_end_to_end_with_logs_and_tensorboard(tmp_path, capsys):
    spec = _spec(tmp_path, ARMS)
    assert compare.main([str(spec)]) == 0
    out = capsys.readouterr().out
    assert "[1/3] nvfp4: exit 0" in out and "[3/3] half_way: exit 0" in out and "step 40" in out
    table = (tmp_path / "out/compare.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:] if line.startswith("|")}
    assert list(rows) == ["bf16", "nvfp4", "half_way"]  # the baseline first, then the gap reference
    assert rows["nvfp4"][3].startswith("+0.2000 ± 0.0000")  # Δ vs bf16: the stub's offset, same "noise"
    assert rows["half_way"][3].startswith("+0.1000") and rows["half_way"][4] == "50.0%"  # half the gap closed
    csv = (tmp_path / "out/compare.csv").read_text().splitlines()
    assert csv[0] == "run,step,loss,grad_norm,memory_gib,tps" and len(csv) == 1 + 3 * 9  # steps 1, 5, ..., 40
    assert (tmp_path / "out/compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train_configs/llama3_bf16.toml" in (tmp_path / "out/bf16.log").read_text().splitlines()[0]
    assert "step:" not in (tmp_path / "out/half_way.log").read_text()  # its losses came from TensorBoard

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


def test_a_failing_arm_is_reported_and_the_others_still_tabled(tmp_path, capsys):
    arms = ARMS.replace('overrides = ["--stub.offset", "0.2"]', 'overrides = ["--stub.offset", "0.2", "--stub.fail_at", "12"]')
    assert compare.main([str(_spec(tmp_path, arms))]) == 1
    out = capsys.readouterr()
    assert "[1/3] nvfp4: exit 1" in out.out and "step 10" in out.out
    assert "arms that failed: nvfp4" in out.err
    assert compare.main([str(_spec(tmp_path, arms)), "--only", "bf16"]) == 0  # --only runs just that arm
    assert "[2/3] bf16: exit 0" in capsys.readouterr().out


@pytest.mark.parametrize("extra,arms,needles", [
    ("stepz = 3", ARMS, ["stepz", "unknown [compare] keys"]),
    ("", ARMS.replace('name = "half_way"', 'name = "bf16"'), ["'bf16'", "unique"]),
    ("", '[[arm]]\nname = "bf16"', ["at least two"]),
    ("", ARMS.replace('"0.1", "--metrics', '0.1, "--metrics'), ["half_way", "overrides", "list of strings"]),
    ("", ARMS.replace('name = "nvfp4"', 'name = "nvfp4"\ncolor = "red"'), ["nvfp4", "unknown keys", "color"]),
    ("", ARMS + '[[arm]]\nname = "x"\nbase = "nope.toml"', ["'x'", "nope.toml"]),
], ids=["unknown_key", "duplicate_arm", "one_arm", "override_not_string", "unknown_arm_key", "missing_base"])
def test_bad_specs_are_refused_by_key(tmp_path, extra, arms, needles):
    with pytest.raises(ValueError) as e:
        compare.load_spec(_spec(tmp_path, arms, extra))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


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
