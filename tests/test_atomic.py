"""titan_nvfp4.tools.atomic: outputs appear whole or not at all, and an output naming an input is refused."""

import os
import signal
import subprocess
import sys

import pytest

from titan_nvfp4.tools import atomic


def test_write_text_replaces_whole_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "a.csv"
    out.write_text("old")
    atomic.write_text(out, "new")
    assert out.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    out = tmp_path / "a.csv"
    out.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_file(out) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv"]


def test_sigkill_mid_write_keeps_the_old_file(tmp_path):
    out = tmp_path / "big.bin"
    out.write_bytes(b"old")
    code = ("import sys, time\nfrom titan_nvfp4.tools import atomic\n"
            "with atomic.atomic_file(sys.argv[1]) as tmp:\n"
            "    f = open(tmp, 'wb'); f.write(b'x' * 1000); f.flush(); print('writing', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert out.read_bytes() == b"old"


def test_output_over_input_is_refused_by_name(tmp_path):
    log = tmp_path / "b.log"
    log.write_text("x")
    with pytest.raises(ValueError, match=r"--csv .*b\.log would overwrite the input"):
        atomic.refuse_output_over_input(log, [tmp_path / "a.log", log], "--csv")
    with pytest.raises(ValueError, match="would overwrite the input"):
        atomic.refuse_output_over_input(tmp_path, [log], "--out")  # a folder output holding an input
    atomic.refuse_output_over_input(tmp_path / "c.csv", [log], "--csv")


def test_bad_targets_name_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"--out .* is a folder"):
        atomic.write_text(tmp_path, "x", "--out")
    with pytest.raises(ValueError, match=r"--out .*does not exist"):
        atomic.write_text(tmp_path / "missing" / "a.csv", "x", "--out")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(ValueError, match=r"--out .*not writable"):
            atomic.write_text(ro / "a.csv", "x", "--out")
    finally:
        ro.chmod(0o755)


def test_atomic_dir_whole_or_nothing(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(out) as d:
            (d / "config.json").write_text("{}")
            raise RuntimeError("failed export")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic.atomic_dir(out) as d:
        (d / "config.json").write_text("{}")
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(ValueError, match="exists and is not empty"):
        with atomic.atomic_dir(out):
            pass
    with atomic.atomic_dir(out, replace=True) as d:
        (d / "new.json").write_text("1")
    assert sorted(p.name for p in out.iterdir()) == ["new.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
