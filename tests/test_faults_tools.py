"""Issue 66, the tools under faults: a kill mid-write, an output naming an input, appended logs, several
TensorBoard runs in one dump folder, corrupted checkpoint bytes, a NaN loss, and unwritable outputs. Each is made
for real (SIGKILL of a subprocess, a log appended to, bits flipped on disk) and must leave a clear one-line error
or the right result, never a lost input or a mixed run."""

import os
import pickle
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from titan_nvfp4.tools import e2e_report, export_dense, loss_log, loss_plot

def metric(step: int, loss: float) -> str:
    return (f"[titan] 2026-11-30 10:00:00,000 - root - INFO - step: {step:2}  loss: {loss:8.5f}  grad_norm:  1.0000  "
            f"memory:  2.50GiB(3.00%)  tps: 1,000  tflops: 1.00  mfu: 0.10%\n")


def run_log(steps, offset: float = 0.0, start: int = 1) -> str:
    """A TorchTitan console log of one run logging ``steps`` (from ``start``: a resume when > 1)."""
    return (f"[titan] INFO - Training starts at step {start}\n"
            + "".join(metric(s, 8.0 / s ** 0.5 + offset) for s in steps))


def error_of(capsys, call) -> str:
    """The one stderr line of a tool that ends with exit status 2."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------- D1, D2: outputs


def _export_writing_half_then_hanging(src: Path, out: Path, marker: Path) -> None:
    """In a forked child: export_dense whose torch.save writes half of its bytes, names the file it writes in
    ``marker``, then hangs until killed."""
    import io

    real = torch.save

    def half_then_hang(obj, f, *a, **k):
        buf = io.BytesIO()
        real(obj, buf)
        with open(f, "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            fh.flush()
        # whole or absent: a marker seen while it was being written read '' (a flake under CI's load, 2026-12-07)
        marker.with_suffix(".part").write_text(str(f))
        os.replace(marker.with_suffix(".part"), marker)
        time.sleep(120)
    torch.save = half_then_hang
    export_dense.main([str(src), str(out)])


def test_export_dense_killed_mid_write_leaves_the_old_output_whole(tmp_path):
    """D1: SIGKILL while OUT.pt is half written: the previous OUT.pt is untouched and loads (the half-written
    bytes were a temporary beside it). The child is forked: it needs no second import of torch."""
    import multiprocessing

    src, out, marker = tmp_path / "m.pt", tmp_path / "dense.pt", tmp_path / "writing"
    torch.save({"w": torch.arange(4096.0)}, src)
    torch.save({"old": torch.ones(3)}, out)
    before = out.read_bytes()
    p = multiprocessing.get_context("fork").Process(target=_export_writing_half_then_hanging, args=(src, out, marker))
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and p.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), f"the child never wrote (exit code {p.exitcode})"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.join()
    assert p.exitcode == -signal.SIGKILL
    partial = Path(marker.read_text())
    assert partial != out and partial.parent == out.parent and 0 < partial.stat().st_size  # the half write
    assert out.read_bytes() == before and torch.equal(torch.load(out)["old"], torch.ones(3))


def test_export_dense_refuses_its_input_as_output(tmp_path, capsys):
    """D1: OUT naming the checkpoint file, or a file inside the checkpoint folder, is refused by name."""
    src = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, src)
    before = src.read_bytes()
    err = error_of(capsys, lambda: export_dense.main([str(src), str(src)]))
    assert f"output file {src} would overwrite the input {src}" in err
    assert src.read_bytes() == before
    ck = _dcp(tmp_path / "step-1")
    metadata = (ck / ".metadata").read_bytes()
    err = error_of(capsys, lambda: export_dense.main([str(ck), str(ck / ".metadata")]))
    assert "is inside the checkpoint folder" in err and (ck / ".metadata").read_bytes() == metadata


@pytest.mark.parametrize("tool", ["loss_log --csv", "e2e_report --json", "loss_plot --out"])
def test_an_output_naming_an_input_is_refused(tmp_path, capsys, tool):
    """D2: ``loss_log a.log b.log --csv b.log`` (and the other tools' outputs) refused by name, the log kept."""
    module, option = tool.split()
    a, b = tmp_path / "a.log", tmp_path / ("b.png" if module == "loss_plot" else "b.log")  # --out needs an image name
    a.write_text(run_log([1, 10, 20]))
    b.write_text(run_log([1, 10, 20], 0.1))
    before = b.read_bytes()
    main = {"loss_log": loss_log.main, "e2e_report": e2e_report.main, "loss_plot": loss_plot.main}[module]
    err = error_of(capsys, lambda: main([str(a), str(b), option, str(b)]))
    assert f"{option} {b} would overwrite the input {b}" in err
    assert b.read_bytes() == before


# ------------------------------------------------------------------------------------- S4: appended logs


def test_a_rerun_appended_to_a_log_is_read_as_its_own_run(tmp_path, capsys):
    """S4: a complete 300-step run, then (tee -a) a rerun that crashed at step 120: the log reads as the rerun,
    at step 120, with a note naming the file and the line where it starts; a resume (step 201 on) is one run."""
    base, log = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    base.write_text(run_log(range(10, 301, 10)))
    log.write_text(run_log([1, *range(10, 301, 10)], 0.05))
    first_run_lines = len(log.read_text().splitlines())
    with open(log, "a") as f:  # the rerun, appended
        f.write(run_log([1, *range(10, 121, 10)], 0.2) + "Traceback (most recent call last):\nRuntimeError: boom\n")
    runs = loss_log.split_log(log.read_text())
    assert [r.line for r in runs] == [1, first_run_lines + 1] and runs[-1].steps[-1].step == 120
    assert loss_log.parse_log(log.read_text())[-1].step == 120  # the runner's entry point reads the last run too
    loss_log.main([str(base), str(log), "--last", "1", "--markdown"])
    out, err = capsys.readouterr()
    assert "| nvfp4 | 120 |" in out and "+0.2000" in out  # the rerun against bf16 at step 120, not Δ 0 at 300
    assert f"note: {log} holds 2 training runs (a run restarts at step 1 at line {first_run_lines + 1})" in err
    report = e2e_report.summarize_run("nvfp4", log.read_text(), skip=0)
    assert report.steps_logged == 13 and "2 runs in the log" in report.notes[0]

    resumed = tmp_path / "resumed.log"  # crashed at 230, resumed from the step-200 checkpoint: one run
    resumed.write_text(run_log([1, *range(10, 231, 10)]) + run_log(range(210, 301, 10), 0.01, start=201))
    runs = loss_log.split_log(resumed.read_text())
    assert len(runs) == 1 and [s.step for s in runs[0].steps] == [1, *range(10, 301, 10)]
    assert runs[0].steps[-8].loss == pytest.approx(8.0 / 230 ** 0.5 + 0.01, abs=1e-5)  # the resumed run's 230


def test_a_log_with_only_validation_lines_is_an_error(tmp_path, capsys):
    log = tmp_path / "val.log"
    log.write_text("[titan] INFO - validate step:  1  loss:  8.0730\n[titan] INFO - validate step: 50  loss:  5.1\n")
    for main in (loss_log.main, lambda a: loss_plot.main([*a, "--out", str(tmp_path / "x.png")])):
        err = error_of(capsys, lambda: main([str(log)]))
        assert f"no TorchTitan metric lines in {log} (validation lines only)" in err


# ------------------------------------------------------------------------------------- S3: TensorBoard runs


def _tb_run(folder: Path, steps, offset: float, wall: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(folder))
    for s in steps:
        w.add_scalar("loss_metrics/global_avg_loss", 8.0 / s ** 0.5 + offset, s, walltime=wall + s)
        w.add_scalar("throughput(tps)", 1000.0, s, walltime=wall + s)
    w.close()


def test_a_dump_folder_with_several_tensorboard_runs_reads_the_newest(tmp_path, capsys):
    """S3: an old 100-step run and a new 30-step one in one dump folder: the new run alone (not steps 31-100 of the
    old), said on stderr; a resume written to a later folder continues the new run."""
    pytest.importorskip("tensorboard")
    dump = tmp_path / "nvfp4"
    _tb_run(dump / "tb" / "20261120-0900", range(1, 101), 0.0, 1e9)
    _tb_run(dump / "tb" / "20261130-1000", range(1, 31), 0.5, 2e9)
    steps, _ = loss_log.tensorboard_run(dump)
    assert [s.step for s in steps] == list(range(1, 31)) and steps[-1].loss == pytest.approx(8 / 30 ** 0.5 + 0.5)
    loss_log.main([str(dump)])
    out, err = capsys.readouterr()
    assert "steps=30 " in out
    assert "reading only the newest, tb/20261130-1000" in err and "tb/20261120-0900" in err
    _tb_run(dump / "tb" / "20261130-1100", range(21, 51), 0.5, 3e9)  # resumed after the step-20 checkpoint
    runs = loss_log.tensorboard_runs(dump)
    assert [r.where for r in runs] == ["tb/20261120-0900", "tb/20261130-1000, tb/20261130-1100"]
    assert [s.step for s in runs[-1].steps] == list(range(1, 51))


# ------------------------------------------------------------------------------------- S9, O: checkpoints


def _dcp(path: Path) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {"a.weight": torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),
                       "b.weight": torch.ones(32)}, "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))
    return path


def _entry(ck: Path, fqn: str):
    info = [v for k, v in pickle.loads((ck / ".metadata").read_bytes()).storage_data.items() if k.fqn == fqn]
    return info[0]


def _flip(path: Path, offset: int, mask: int = 0x04) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_corrupted_checkpoint_bytes_are_reported_not_exported(tmp_path, capsys):
    """S9 and O: one flipped payload bit of a DCP entry (caught by the entry's CRC-32), a truncated or missing data
    file (by .metadata's offsets), a truncated .metadata, a .metadata edit DCP itself refuses (its
    CheckpointException), a flipped bit in a torch.save file, and NaN weights: each a one-line error naming the
    file or entry, no output written."""
    out = tmp_path / "dense.pt"
    ck = _dcp(tmp_path / "good")
    export_dense.main([str(ck), str(out)])
    assert torch.equal(torch.load(out)["model"]["b.weight"], torch.ones(32))
    out.unlink()
    capsys.readouterr()

    def broken(name, damage):
        bad = tmp_path / name
        _dcp(bad)
        damage(bad)
        return error_of(capsys, lambda: export_dense.main([str(bad), str(out)]))

    a = _entry(ck, "model.a.weight")
    err = broken("bits", lambda c: _flip(c / a.relative_path, a.offset + a.length // 2))
    assert "entry model.a.weight" in err and "CRC-32" in err and "bits/__0_0.distcp" in err
    err = broken("truncated", lambda c: os.truncate(c / a.relative_path, a.offset + 100))
    assert f"__0_0.distcp is {a.offset + 100:,} bytes, but .metadata stores entries up to byte" in err and "(truncated)" in err
    err = broken("missing", lambda c: (c / a.relative_path).unlink())
    assert "__0_0.distcp is missing" in err
    err = broken("metadata", lambda c: os.truncate(c / ".metadata", 100))
    assert ".metadata cannot be read" in err

    def resize(c):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        md = pickle.loads((c / ".metadata").read_bytes())
        md.state_dict_metadata["model.a.weight"].size = torch.Size([32, 128])
        md.state_dict_metadata["model.a.weight"].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 128]))]
        (c / ".metadata").write_bytes(pickle.dumps(md))
    err = broken("resized", resize)
    assert err.startswith("python -m titan_nvfp4.tools.export_dense: error: cannot read checkpoint") and "mismatch sizes" in err

    pt = tmp_path / "m.pt"
    torch.save({"w": torch.arange(1000.0)}, pt)
    _flip(pt, pt.read_bytes().find(torch.tensor([500.0]).numpy().tobytes()))
    assert torch.load(pt)["w"][500] != 500  # torch.load itself reads the changed value
    err = error_of(capsys, lambda: export_dense.main([str(pt), str(out)]))
    assert f"checkpoint {pt} is damaged" in err and "CRC-32" in err
    torch.save({"w": torch.tensor([1.0, float("nan")])}, pt)
    err = error_of(capsys, lambda: export_dense.main([str(pt), str(out)]))
    assert "weights hold NaN or Inf, not exported: w (1 of 2)" in err
    assert not out.exists()


# ------------------------------------------------------------------------------------- S10: a NaN loss


def test_a_nan_loss_is_a_gap_in_the_smoothed_curves(tmp_path, monkeypatch):
    """S10: one NaN loss at step 30: the EMA and the difference's EMA are NaN there and finite after it."""
    import math

    from matplotlib.axes import Axes

    smoothed = loss_plot.ema([1.0, float("nan"), 3.0, float("inf"), 3.0], 0.5)
    assert math.isnan(smoothed[1]) and math.isnan(smoothed[3])
    assert smoothed[2] == pytest.approx(1.75 / 0.75) and smoothed[4] == pytest.approx(2.375 / 0.875)
    plotted = []
    real_plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: plotted.append((kw.get("label"), list(a[1]) if len(a) > 1 else []))
                        or real_plot(self, *a, **kw))
    a, b = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    a.write_text(run_log(range(10, 101, 10)))
    b.write_text(run_log(range(10, 101, 10), 0.1).replace(f"loss: {8 / 30 ** 0.5 + 0.1:8.5f}", "loss:      nan"))
    loss_plot.main([str(a), str(b), "--out", str(tmp_path / "curves.png")])
    smoothed = {label: v for label, v in plotted if label in ("nvfp4", "nvfp4 − bf16")}
    for label, values in smoothed.items():
        assert math.isnan(values[2]) and all(math.isfinite(v) for v in values[3:]), (label, values)
    assert smoothed["nvfp4 − bf16"][-1] == pytest.approx(0.1, abs=1e-4)


# ------------------------------------------------------------------------------------- O: unwritable outputs


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs /sys, a folder that refuses new files")
@pytest.mark.parametrize("tool", ["loss_log --csv", "e2e_report --json", "loss_plot --out", "export_dense output file"])
def test_an_output_in_a_read_only_folder_is_a_message(tmp_path, capsys, tool):
    """O: /sys refuses a new file even to root, for whom os.access calls it writable: one line naming the output,
    exit 2 (for another user, os.access already says it is not writable)."""
    module = tool.split()[0]
    target = Path("/sys") / ("x.png" if module == "loss_plot" else "x.out")
    if target.exists():
        pytest.skip(f"{target} exists")
    log = tmp_path / "a.log"
    log.write_text(run_log([1, 10, 20]))
    if module == "export_dense":
        torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
        argv, main = [str(tmp_path / "m.pt"), str(target)], export_dense.main
    else:
        argv = [str(log), tool.split()[1], str(target)]
        main = {"loss_log": loss_log.main, "e2e_report": e2e_report.main, "loss_plot": loss_plot.main}[module]
    err = error_of(capsys, lambda: main(argv))
    assert re.search(rf"{tool.split(maxsplit=1)[1]} {target}: (cannot write: \w|the folder /sys is not writable)", err), err
    assert not target.exists()


def test_an_output_folder_where_a_file_is_expected_is_a_message(tmp_path, capsys):
    log = tmp_path / "a.log"
    log.write_text(run_log([1, 10, 20]))
    err = error_of(capsys, lambda: loss_log.main([str(log), "--csv", str(tmp_path)]))
    assert f"--csv {tmp_path} is a folder; name a file" in err
    (tmp_path / "dir.png").mkdir()
    err = error_of(capsys, lambda: loss_plot.main([str(log), "--out", str(tmp_path / "dir.png")]))
    assert "is a folder; name a file" in err


def test_emulated_dp_bad_job_file_or_batch_is_a_message(tmp_path, capsys, monkeypatch):
    """O: a missing --job.config_file, and a batch the launcher cannot split (raised inside TorchTitan's trainer),
    end with one line instead of a traceback."""
    from types import SimpleNamespace

    import torchtitan.train
    from torchtitan.config import ConfigManager
    from torchtitan.protocols import train_spec

    from titan_nvfp4.tools import emulated_dp as E

    err = error_of(capsys, lambda: E.main(["--data-parallel", "2", "--job.config_file", str(tmp_path / "no.toml")]))
    assert f"--job.config_file {tmp_path / 'no.toml'}: no such file" in err
    monkeypatch.setattr(ConfigManager, "parse_args", ConfigManager.parse_args)  # main patches both: restored after
    monkeypatch.setattr(train_spec, "get_train_spec", train_spec.get_train_spec)

    def trainer_building_its_dataloader(trainer_class):  # what TorchTitan's Trainer does with the patched spec
        job = SimpleNamespace(training=SimpleNamespace(local_batch_size=4))
        E.emulate(lambda **kw: None, 4)(dp_world_size=3, dp_rank=0, tokenizer=None, job_config=job)
    monkeypatch.setattr(torchtitan.train, "main", trainer_building_its_dataloader)
    err = error_of(capsys, lambda: E.main(["--data-parallel", "4"]))
    assert "--data-parallel 4 is not a multiple of this run's data-parallel degree 3" in err
