"""Arms that start from another arm's checkpoint (``branch_from``, ``branch_step``), end to end with the stub
trainer (tests/compare_stub.py): the runner keeps the parent's checkpoint of that step as it trains, starts the
branch from it after every other arm, records which run of the parent it branched from, and judges the branch
stale once the parent's log holds another run; the spec's checks, key by key."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_nvfp4 import compare
from titan_nvfp4.compare import runner
from titan_nvfp4.compare.armlog import identity, read_arm_log

from compare_helpers import REPO, write_spec


def _spec(tmp_path: Path, branch: str = 'branch_from = "nvfp4"\nbranch_step = 10', seeds: str = "[42, 43]",
          extra: str = "checkpoint_interval = 10", switch: str = "") -> Path:
    """The branching arm first in the spec (the runner still runs it last), with ``switch`` added to its overrides;
    the parent draws a progress bar (a carriage return in its log, inside the stamped bytes)."""
    return write_spec(tmp_path, f"""
[[arm]]
name = "switch"
overrides = ["--stub.offset", "0.1"{switch}]
seeds = {seeds}
{branch}
[[arm]]
name = "bf16"
base = "{REPO / 'train_configs/llama3_bf16.toml'}"
seeds = [42, 43]
[[arm]]
name = "nvfp4"
overrides = ["--stub.offset", "0.2", "--stub.sleep", "0.02", "--stub.progress"]
seeds = [42, 43]
""", extra)


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(runner, "BRANCH_POLL_S", 0.02)  # the stub saves every 0.2 s, TorchTitan every few minutes


def test_a_branch_starts_from_its_parents_checkpoint_after_the_other_arms(tmp_path, capsys, fast_poll):
    spec_path = _spec(tmp_path)
    assert compare.main([str(spec_path)]) == 0
    out = capsys.readouterr().out
    order = [line.split("]")[1].split(":")[0].strip() for line in out.splitlines() if ": exit 0" in line]
    assert order == ["bf16", "bf16_seed2", "nvfp4", "nvfp4_seed2", "switch", "switch_seed2"]
    spec = compare.load_spec(spec_path)
    arms = spec.by_name()
    assert arms["switch_seed2"].branch_from == "nvfp4_seed2"  # the parent's replicate of the same seed
    # TorchTitan kept only steps 30 and 40; the runner kept 10, whole
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in (out_dir / "nvfp4/checkpoint").iterdir()) == ["step-30", "step-40"]
    kept = out_dir / "nvfp4/branch/step-10"
    assert (kept / ".metadata").is_file() and (kept / "__0_0.distcp").read_text() == "state at step 10"
    log = (out_dir / "switch_seed2.log").read_text()
    assert "--checkpoint.initial_load_path " + str(kept).replace("nvfp4/", "nvfp4_seed2/") in log
    assert "# compare: branch of nvfp4_seed2 at step 10, whose log's first " in log
    assert "from step 11," in log and " step: 10 " not in log and " step: 40 " in log
    state = read_arm_log(spec, arms["switch_seed2"])
    assert state.status == "current" and state.steps[0].step == 15  # log_freq 5: steps 15, 20, ... 40
    table = (out_dir / "compare.md").read_text()
    assert "| switch | 2 | " in table  # paired with bf16 on both seeds
    # the branch's identity does not depend on where the out folder is
    assert "<out>/nvfp4/branch/step-10" in identity(spec, arms["switch"])["command"]


def test_a_branch_of_a_parent_run_no_longer_there_is_stale_and_refused(tmp_path, capsys, fast_poll):
    spec_path = _spec(tmp_path, seeds="[42]")
    assert compare.main([str(spec_path)]) == 0
    spec = compare.load_spec(spec_path)
    assert compare.main([str(spec_path), "--only", "nvfp4", "--rerun"]) == 0  # another run of the parent
    capsys.readouterr()
    state = read_arm_log(spec, spec.by_name()["switch"])
    assert state.status == "stale" and "do not pair" in state.why and "nvfp4.log" in state.why
    assert "| switch |" not in (tmp_path / "out/compare.md").read_text()
    with pytest.raises(SystemExit):
        compare.main([str(spec_path), "--only", "switch"])
    assert "--rerun starts it afresh" in capsys.readouterr().err
    # the rerun kept its own step 10: --rerun of the branch alone starts it from that run, which then pairs
    assert compare.main([str(spec_path), "--only", "switch", "--rerun"]) == 0
    assert read_arm_log(spec, spec.by_name()["switch"]).status == "current"


def test_a_branch_whose_parent_checkpoint_is_not_kept_is_refused_naming_it(tmp_path, capsys, fast_poll):
    spec_path = _spec(tmp_path, seeds="[42]")
    assert compare.main([str(spec_path), "--only", "bf16", "nvfp4"]) == 0
    import shutil

    shutil.rmtree(tmp_path / "out/nvfp4/branch")  # another machine: the parent's log came back, its checkpoint not
    capsys.readouterr()
    with pytest.raises(SystemExit):
        compare.main([str(spec_path), "--only", "switch"])
    err = capsys.readouterr().err
    assert "arm 'switch' starts from the checkpoint of 'nvfp4' at step 10" in err and "--only nvfp4 switch" in err
    assert not (tmp_path / "out/switch.log").exists()


def test_a_parent_that_stops_before_the_branch_step_leaves_the_branch_unrun(tmp_path, capsys, fast_poll):
    spec_path = _spec(tmp_path, seeds="[42]")
    text = spec_path.read_text().replace('"--stub.sleep", "0.02"', '"--stub.fail_at", "5"')
    spec_path.write_text(text)
    assert compare.main([str(spec_path)]) == 1
    out = capsys.readouterr().out
    assert "switch: not run: the checkpoint of 'nvfp4' at step 10 it starts from is not in" in out


@pytest.mark.parametrize("branch,seeds,extra,needles", [
    ('branch_from = "nvfp4"', "[42]", "checkpoint_interval = 10", ["'switch'", "both branch_from and branch_step"]),
    ('branch_from = "nvfp4"\nbranch_step = 15', "[42]", "checkpoint_interval = 10",
     ["branch_step = 15", "multiple of [compare] checkpoint_interval = 10"]),
    ('branch_from = "nvfp4"\nbranch_step = 10', "[42]", "", ["checkpoint_interval = 0"]),
    ('branch_from = "nvfp4"\nbranch_step = 40', "[42]", "checkpoint_interval = 10", ["branch_step = 40", "below"]),
    ('branch_from = "fp8"\nbranch_step = 10', "[42]", "checkpoint_interval = 10", ["branch_from = 'fp8' is not an arm"]),
    ('branch_from = "nvfp4"\nbranch_step = 10', "[44]", "checkpoint_interval = 10",
     ["(seed 44) branches from 'nvfp4'", "no arm of seed 44", "[42, 43]"]),
    ('branch_from = "nvfp4"\nbranch_step = "10"', "[42]", "checkpoint_interval = 10", ["branch_step", "'10'"]),
    ('branch_from = "switch"\nbranch_step = 10', "[42]", "checkpoint_interval = 10", ["'switch' branch_from = 'switch'"]),
], ids=["step_missing", "step_not_saved", "no_checkpoints", "step_past_end", "no_parent", "no_parent_seed",
        "step_not_int", "itself"])
def test_bad_branches_are_refused_by_key(tmp_path, branch, seeds, extra, needles):
    with pytest.raises(ValueError) as e:
        compare.load_spec(_spec(tmp_path, branch, seeds, extra))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_a_branch_whose_parent_changed_in_the_spec_is_stale(tmp_path, fast_poll):
    spec_path = _spec(tmp_path, seeds="[42]")
    assert compare.main([str(spec_path)]) == 0
    spec_path.write_text(spec_path.read_text().replace('"--stub.offset", "0.2"', '"--stub.offset", "0.3"'))
    spec = compare.load_spec(spec_path)
    state = read_arm_log(spec, spec.by_name()["switch"])
    assert state.status == "stale" and "not a run of this spec" in state.why and "first 10 steps" in state.why


def test_a_branch_resumes_from_its_own_checkpoint_and_restarts_from_the_kept_one_before_it(tmp_path, capsys,
                                                                                         fast_poll):
    spec_path = _spec(tmp_path, seeds="[42]", switch=', "--stub.fail_at", "25"')
    assert compare.main([str(spec_path)]) == 1  # the branch saves its step 20, then stops at 25
    capsys.readouterr()
    assert compare.main([str(spec_path), "--only", "switch"]) == 0
    assert "(resumed)" in capsys.readouterr().out
    log = (tmp_path / "out/switch.log").read_text()
    assert "from step 11," in log and "from step 21," in log and log.count("# compare: branch of nvfp4") == 1
    spec = compare.load_spec(spec_path)
    assert read_arm_log(spec, spec.by_name()["switch"]).status == "current"
    # stopped before its own first save (step 15), or with a save cut short (no .metadata): fresh from the kept point
    spec_path.write_text(spec_path.read_text().replace('"--stub.fail_at", "25"', '"--stub.fail_at", "15"'))
    assert compare.main([str(spec_path), "--only", "switch", "--rerun"]) == 1  # the edited arm: afresh
    (tmp_path / "out/switch/checkpoint/step-10").mkdir(parents=True)  # a save cut short by a kill
    capsys.readouterr()
    assert compare.main([str(spec_path), "--only", "switch"]) == 1
    assert "(resumed)" not in capsys.readouterr().out
    log = (tmp_path / "out/switch.log").read_text()
    assert log.count("from step 11,") == 1 and "from step 1," not in log and ", fresh" in log


def test_a_branch_and_its_parent_brought_back_together_still_pair_wherever_they_land(tmp_path, capsys, fast_poll):
    """Logs go through a tar as bytes (the parent's progress bar's carriage return included, which text mode would
    turn into a newline and break the stamp), and into another out folder (--out)."""
    import tarfile

    spec_path = _spec(tmp_path, seeds="[42]")
    assert compare.main([str(spec_path)]) == 0
    assert b"\r" in (tmp_path / "out/nvfp4.log").read_bytes()
    with tarfile.open(tmp_path / "logs.tar.xz", "w:xz") as tar:
        for log in (tmp_path / "out").glob("*.log"):
            tar.add(log, arcname=f"./{log.name}")
    home = tmp_path / "kept"
    capsys.readouterr()
    assert compare.main([str(spec_path), "--import-logs", str(tmp_path / "logs.tar.xz"), "--out", str(home)]) == 0
    assert "switch: imported, step 40 of 40 (complete)" in capsys.readouterr().out
    assert (home / "nvfp4.log").read_bytes() == (tmp_path / "out/nvfp4.log").read_bytes()
    assert "| switch | 40 |" in (home / "compare.md").read_text()


def test_an_imported_branch_pairs_with_the_parent_in_the_folder_not_the_one_in_the_archive(tmp_path, capsys,
                                                                                             fast_poll):
    """A branch alone is imported beside its parent already kept; a branch whose parent in the archive is another run
    than the folder's (kept there: it is as long) is skipped, naming the folder's: it would not pair in the table."""
    import shutil

    spec_path = _spec(tmp_path, seeds="[42]")
    assert compare.main([str(spec_path)]) == 0
    home = tmp_path / "kept"
    home.mkdir()
    shutil.copy(tmp_path / "out/nvfp4.log", home)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tmp_path / "out/switch.log", alone)
    capsys.readouterr()
    assert compare.main([str(spec_path), "--import-logs", str(alone), "--out", str(home), "--report-only"]) == 0
    assert "switch: imported, step 40 of 40 (complete)" in capsys.readouterr().out
    fresh = tmp_path / "fresh"  # holds another run of the parent, as long as the archive's
    fresh.mkdir()
    (fresh / "nvfp4.log").write_bytes((tmp_path / "out/nvfp4.log").read_bytes().replace(b"loss:", b"loss: ", 1))
    capsys.readouterr()
    assert compare.main([str(spec_path), "--import-logs", str(tmp_path / "out"), "--out", str(fresh),
                         "--report-only"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4: kept the log there" in out
    assert "switch: skipped, stale" in out and str(fresh / "nvfp4.log") in out
