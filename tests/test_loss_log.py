"""The log reader used to compare training runs."""

from pathlib import Path

import pytest

from titan_nvfp4.tools.loss_log import main, parse_log, parse_validation, summarize

_LOG = """[titan] 2026-11-22 23:00:00,000 - root - INFO - Training starts at step 1
[titan] 2026-11-22 23:00:01,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  7.65430  \x1b[33mgrad_norm:  2.1000  \x1b[34mmemory:  1.23GiB(1.55%)  \x1b[34mtps: 1,234  \x1b[36mtflops: 0.10  \x1b[35mmfu: 0.01%\x1b[39m
[titan] 2026-11-22 23:00:02,000 - root - INFO - step: 10  loss:  6.00000  grad_norm:  1.5000  memory:  1.50GiB(1.90%)  tps: 50,000  tflops: 1.00  mfu: 0.10%
[titan] 2026-11-22 23:00:03,000 - root - INFO - step: 20  loss:  5.00000  grad_norm:  1.0000  memory:  1.40GiB(1.80%)  tps: 52,000  tflops: 1.00  mfu: 0.10%
"""
_VAL = "[titan] 2026-11-25 10:00:00,000 - root - INFO - \x1b[33mvalidate step: {s:2}  \x1b[32mloss: {v:7.4f}  memory:  1.00GiB\n"


def test_parse_colored_and_plain_lines():
    steps = parse_log(_LOG)
    assert [s.step for s in steps] == [1, 10, 20]
    assert steps[0].loss == pytest.approx(7.6543) and steps[0].tps == 1234
    assert steps[1].memory_gib == 1.5


def test_summary_and_cli(tmp_path, capsys):
    a, b = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    a.write_text(_LOG)
    b.write_text(_LOG.replace("5.00000", "5.50000"))
    rows = summarize({"bf16": parse_log(a.read_text()), "nvfp4": parse_log(b.read_text())}, last=2)
    assert rows[0]["final_loss"] == pytest.approx(5.5)
    assert rows[1]["final_loss"] == pytest.approx(5.75) and rows[1]["delta"] == pytest.approx(0.25)
    main([str(a), str(b), "--last", "1", "--markdown", "--csv", str(tmp_path / "m.csv")])
    out = capsys.readouterr().out
    assert "| nvfp4 | 20 |" in out and "+0.5000" in out
    assert (tmp_path / "m.csv").read_text().count("\n") == 7


def test_paired_standard_error_of_the_difference():
    """Shared batch noise cancels: a run that is the baseline plus 0.1 ± 0.01 has a small s.e. although
    the losses themselves swing by whole units from step to step."""
    import math

    from titan_nvfp4.tools.loss_log import StepMetrics

    swings = [4.0, 2.0, 5.0, 1.5, 3.0, 4.5]
    offsets = [0.09, 0.11, 0.10, 0.09, 0.11, 0.10]
    base = [StepMetrics(10 * i, v, 1.0, 1.0, 1) for i, v in enumerate(swings)]
    run = [StepMetrics(10 * i, v + o, 1.0, 1.0, 1) for i, (v, o) in enumerate(zip(swings, offsets))]
    rows = summarize({"a": base, "b": run}, last=6)
    mean = sum(offsets) / 6
    se = math.sqrt(sum((o - mean) ** 2 for o in offsets) / 5 / 6)
    assert rows[1]["delta"] == pytest.approx(mean) and rows[1]["delta_se"] == pytest.approx(se)
    assert rows[1]["delta_se"] < 0.01 and rows[0]["delta_se"] == 0.0


def test_validation_loss_compared_at_the_last_validated_step(tmp_path, capsys):
    val = _VAL
    a, b, c = tmp_path / "one_gpu.log", tmp_path / "fsdp2.log", tmp_path / "no_val.log"
    a.write_text(_LOG + val.format(s=10, v=6.5) + val.format(s=20, v=5.25))
    b.write_text(_LOG + val.format(s=10, v=6.4) + val.format(s=20, v=5.5))
    c.write_text(_LOG)
    assert parse_log(a.read_text()) == parse_log(_LOG)  # validation lines are not training steps
    main([str(a), str(b), str(c), "--last", "1", "--markdown"])
    out = capsys.readouterr().out
    assert "| 5.2500 (20) | +0.0000 |" in out and "| 5.5000 (20) | +0.2500 |" in out
    assert "| no_val | 20 |" in out and "| – | – |" in out
    assert "| run | validation loss @ 10 | validation loss @ 20 |" in out
    assert "| fsdp2 | 6.4000 | 5.5000 |" in out and "| no_val | – | – |" in out


def test_layouts_compared_across_seeds(tmp_path, capsys):
    """--group pools runs by name: one GPU (3 runs) against EP2 (2 runs) at each validated step, with the
    Welch standard error of the difference of the means and the share of pairs in which EP2 is lower; a
    run goes to the first group it matches, and a bad spec is an error that names it."""
    import math
    import statistics

    one = {"a": 5.6, "a@seed43": 5.5, "a@rotated": 5.7}
    ep2 = {"a_ep2": 5.3, "a_ep2@seed43": 5.65}
    for name, v in {**one, **ep2}.items():
        (tmp_path / f"{name}.log").write_text(_LOG + _VAL.format(s=20, v=v))
    logs = [str(tmp_path / f"{n}.log") for n in {**one, **ep2}]
    main(logs + ["--last", "1", "--group", "1 GPU=a,a@*", "--group", "EP2=a_ep2*"])
    out = capsys.readouterr().out
    se = math.sqrt(statistics.variance(ep2.values()) / 2 + statistics.variance(one.values()) / 3)
    assert f"| 20 | 1 GPU | 3 | 5.6000 ± 0.1000 | 5.5000–5.7000 |  |  |" in out
    delta = statistics.fmean(ep2.values()) - 5.6
    assert f"| 20 | EP2 | 2 | 5.4750 ± {statistics.stdev(ep2.values()):.4f} | 5.3000–5.6500 | {delta:+.4f} ± {se:.4f} | 67% |" in out
    with pytest.raises(SystemExit):
        main(logs + ["--group", "EP2"])
    assert "--group 'EP2': expected NAME=PATTERN" in capsys.readouterr().err


def test_training_loss_windows_pooled_per_group(tmp_path, capsys):
    """--train-windows pools each run's mean training loss over a window of logged steps, per group, with
    the same statistics as the validation table; a malformed window is an error that names it."""
    import math
    import statistics

    step20 = {"one@dp2_seed1": 5.0, "one@dp2_seed2": 5.4, "ep2@seed1": 4.8, "ep2@seed2": 5.0, "ep2@seed3": 5.6}
    for name, v in step20.items():
        (tmp_path / f"{name}.log").write_text(_LOG.replace("5.00000", f"{v:.5f}"))
    logs = [str(tmp_path / f"{n}.log") for n in step20]
    main(logs + ["--group", "1 GPU=one@*", "--group", "EP2=ep2@*", "--train-windows", "10-20,1-1"])
    out = capsys.readouterr().out
    assert "Training loss, mean of the logged steps in each window" in out
    one = [(6.0 + v) / 2 for k, v in step20.items() if k.startswith("one")]
    ep2 = [(6.0 + v) / 2 for k, v in step20.items() if k.startswith("ep2")]
    se = math.sqrt(statistics.variance(one) / 2 + statistics.variance(ep2) / 3)
    lower = sum((a < b) + 0.5 * (a == b) for a in ep2 for b in one) / 6  # 3.5 of 6 pairs: a tie counts half
    assert f"| 10–20 | 1 GPU | 2 | {statistics.fmean(one):.4f} ± {statistics.stdev(one):.4f} |" in out
    assert (f"| 10–20 | EP2 | 3 | {statistics.fmean(ep2):.4f} ± {statistics.stdev(ep2):.4f} | 5.4000–5.8000 | "
            f"{statistics.fmean(ep2) - statistics.fmean(one):+.4f} ± {se:.4f} | {100 * lower:.0f}% |") in out
    assert "| 1–1 | EP2 | 3 | 7.6543 ± 0.0000 |" in out  # step 1 alone: the same in every run
    for bad in ("10", "20-10", "a-b"):
        with pytest.raises(SystemExit):
            main(logs + ["--group", "1 GPU=one@*", "--train-windows", bad])
        assert f"--train-windows: {bad!r}" in capsys.readouterr().err


def test_a_run_stopped_early_is_compared_at_the_steps_it_reached():
    """A baseline that fell from 5 to 1 after step 20 and a run 0.1 above it that stopped at step 20: the
    difference is +0.1 at the run's own steps, not its final loss against the baseline's later, lower one."""
    from titan_nvfp4.tools.loss_log import StepMetrics

    def run(losses):
        return [StepMetrics(step=10 * (i + 1), loss=v, grad_norm=1.0, memory_gib=1.0, tps=1) for i, v in enumerate(losses)]

    base = run([5.0, 4.0, 1.0, 1.0])
    rows = summarize({"bf16": base, "nvfp4": run([5.1, 4.1])}, last=2)
    assert rows[1]["steps"] == 20 and rows[1]["final_loss"] == pytest.approx(4.6)
    assert rows[1]["delta"] == pytest.approx(0.1) and rows[1]["delta_se"] == pytest.approx(0.0, abs=1e-12)
    assert rows[1]["rel_delta_pct"] == pytest.approx(100 * 0.1 / 4.5)


def test_group_gap_closed_with_its_error_bar(tmp_path, capsys):
    """--gap with --group: a third group's share of the gap between the first two groups' means, with the
    delta-method s.e. checked against numerical derivatives; a one-run group takes the pooled seed variance."""
    import math
    import statistics

    from titan_nvfp4.tools.loss_log import pool_groups

    values = {"bf16": {1: 1.00}, "bf16_seed2": {1: 1.02}, "nvfp4": {1: 1.20}, "nvfp4_seed2": {1: 1.26},
              "rank32": {1: 1.12}}
    groups = [("bf16", ["bf16*"]), ("nvfp4", ["nvfp4*"]), ("rank32", ["rank32"])]
    rows = {r["group"]: r for r in pool_groups(values, groups, gap=True)}
    m1, m2, m = 1.01, 1.23, 1.12
    assert rows["rank32"]["closed_pct"] == pytest.approx(100 * (m2 - m) / (m2 - m1))
    assert "closed_pct" not in rows["nvfp4"] and "closed_pct" not in pool_groups(values, groups)[-1]
    pooled = (statistics.variance([1.00, 1.02]) + statistics.variance([1.20, 1.26])) / 2
    var = {"m1": statistics.variance([1.00, 1.02]) / 2, "m2": statistics.variance([1.20, 1.26]) / 2, "m": pooled}

    def share(m1, m2, m):
        return 100 * (m2 - m) / (m2 - m1)
    at, h, total = dict(m1=m1, m2=m2, m=m), 1e-6, 0.0
    for k in at:
        up, down = dict(at), dict(at)
        up[k] += h
        down[k] -= h
        total += ((share(**up) - share(**down)) / (2 * h)) ** 2 * var[k]
    assert rows["rank32"]["closed_se_pct"] == pytest.approx(math.sqrt(total), rel=1e-4)
    assert rows["rank32"]["se"] == pytest.approx(math.sqrt(pooled + var["m1"]))  # Δ of a one-run group: pooled too
    logs = []
    for name, v in values.items():
        p = tmp_path / f"{name}.log"
        p.write_text(_LOG.replace("5.00000", f"{v[1]:.5f}"))
        logs.append(str(p))
    main([*logs, "--group", "bf16=bf16*", "--group", "nvfp4=nvfp4*", "--group", "rank32=rank32", "--gap",
          "--train-windows", "20-20"])
    out = capsys.readouterr().out
    assert "gap closed ± s.e." in out and f"| {rows['rank32']['closed_pct']:.0f}% ± " in out
    assert "| step | group |" not in out  # no validation lines: no (empty) validation table
    assert "| 20–20 | rank32 | 1 | 1.1200 | 1.1200–1.1200 |" in out  # one run: no s.d. column value


def test_empty_log_is_an_error():
    with pytest.raises(ValueError, match="no TorchTitan metric lines"):
        summarize({"x": parse_log("nothing here")})


def test_gap_closed_by_a_third_run(tmp_path, capsys):
    logs = []
    for name, final in (("bf16", "5.00000"), ("nvfp4", "5.40000"), ("nvfp4_lora32", "5.30000")):
        p = tmp_path / f"{name}.log"
        p.write_text(_LOG.replace("5.00000", final))
        logs.append(str(p))
    main([*logs, "--last", "1", "--markdown", "--gap"])
    out = capsys.readouterr().out
    assert "gap to nvfp4 closed" in out
    assert "| nvfp4_lora32 | 20 | 7.6543 | 5.3000 | +0.3000 ± nan (+6.00%) | 25.0% |" in out  # 1 step: no s.e.
    rows = summarize({n: parse_log(open(p).read()) for n, p in zip("abc", logs)}, last=1, gap=True)
    assert "gap_closed_pct" not in rows[1] and rows[2]["gap_closed_pct"] == pytest.approx(25.0)


def test_loss_plot_writes_a_png(tmp_path):
    from titan_nvfp4.tools.loss_plot import ema, main as plot_main

    assert ema([2.0, 4.0], 0.5) == pytest.approx([2.0, 2.0 / 3 * 4.0 + 1.0 / 3 * 2.0 * 1.0])  # bias-corrected
    a, b = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    a.write_text(_LOG)
    b.write_text(_LOG.replace("5.00000", "5.50000"))
    out = tmp_path / "curves.png"
    plot_main([str(a), str(b), "--out", str(out)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    val = _VAL  # validation adds its own lines
    a.write_text(_LOG + val.format(s=10, v=6.5) + val.format(s=20, v=5.2))
    b.write_text(_LOG + val.format(s=10, v=6.6) + val.format(s=20, v=5.4))
    with_val = tmp_path / "with_validation.png"
    plot_main([str(a), str(b), "--out", str(with_val)])
    assert with_val.read_bytes()[:8] == data[:8] and with_val.read_bytes() != data


def test_loss_plot_log_scale(tmp_path, monkeypatch):
    """--log-y puts the loss panel on a log scale, for runs and for groups, and the differences in % of the
    first run's: a run 10% above the reference plots +10 (not +0.5)."""
    from matplotlib.axes import Axes

    from titan_nvfp4.tools.loss_plot import main as plot_main

    calls = []
    monkeypatch.setattr(Axes, "set_yscale", lambda self, value, **kw: calls.append(("scale", value)))
    monkeypatch.setattr(Axes, "set_ylabel", lambda self, label, **kw: calls.append(("label", label)))
    plotted = []
    real_plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: plotted.append(list(a[1]) if len(a) > 1 else [])
                        or real_plot(self, *a, **kw))
    a, b = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    a.write_text(_LOG)
    b.write_text(_LOG.replace("5.00000", "5.50000"))
    plot_main([str(a), str(b), "--out", str(tmp_path / "runs.png")])
    assert ("scale", "log") not in calls and ("label", "Δ loss") in calls and [0.0, 0.0, 0.5] in plotted
    calls.clear(), plotted.clear()
    plot_main([str(a), str(b), "--out", str(tmp_path / "runs.png"), "--log-y"])
    assert ("scale", "log") in calls and ("label", "Δ loss (% of bf16)") in calls
    assert [0.0, 0.0, pytest.approx(10.0)] in plotted
    calls.clear()
    plot_main([str(a), str(b), "--out", str(tmp_path / "groups.png"), "--log-y", "--group", "b=bf16", "--group", "n=nvfp4"])
    assert ("scale", "log") in calls and ("label", "Δ mean loss (% of b)") in calls


def test_loss_plot_pools_groups(tmp_path, capsys):
    """--group plots layouts pooled over seeds: per group the mean and s.d. of the training loss at the steps
    every run logged and of the validation loss; a group that matches no run is an error naming it."""
    import statistics

    from titan_nvfp4.tools.loss_plot import group_curves, main as plot_main

    losses = {"one@s1": 5.0, "one@s2": 5.4, "ep2@s1": 4.8, "ep2@s2": 5.0, "ep2@s3": 5.6}
    logs = []
    for i, (name, v) in enumerate(losses.items()):
        p = tmp_path / f"{name}.log"
        p.write_text(_LOG.replace("5.00000", f"{v:.5f}") + _VAL.format(s=20, v=v + 0.5) + _VAL.format(s=10, v=6.0 + i))
        logs.append(str(p))
    runs = {Path(p).stem: parse_log(Path(p).read_text()) for p in logs}
    val = {Path(p).stem: parse_validation(Path(p).read_text()) for p in logs}
    groups = [("1 GPU", ["one@*"]), ("EP2", ["ep2@*"])]
    members, curves, vals = group_curves(runs, groups, val)
    assert members == {"1 GPU": ["one@s1", "one@s2"], "EP2": ["ep2@s1", "ep2@s2", "ep2@s3"]}
    steps, stats = curves["EP2"]
    assert steps == [1, 10, 20]
    assert stats[2] == pytest.approx((statistics.fmean([4.8, 5.0, 5.6]), statistics.stdev([4.8, 5.0, 5.6])))
    assert stats[0] == pytest.approx((7.6543, 0.0))
    assert vals["1 GPU"][0] == [10, 20]
    assert vals["1 GPU"][1][1] == pytest.approx((5.7, statistics.stdev([5.5, 5.9])))
    out = tmp_path / "groups.png"
    plot_main(logs + ["--out", str(out), "--group", "1 GPU=one@*", "--group", "EP2=ep2@*"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"no run matches group\(s\) \['TP2'\]"):
        group_curves(runs, groups + [("TP2", ["tp2*"])], val)
    with pytest.raises(SystemExit):
        plot_main(logs + ["--out", str(out), "--group", "EP2"])
    assert "--group 'EP2': expected NAME=PATTERN" in capsys.readouterr().err


def test_two_logs_of_one_file_name_are_told_apart_by_name_equals_path(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, rerun = tmp_path / "a" / "nvfp4.log", tmp_path / "b" / "nvfp4.log"
    first.write_text(_LOG)
    rerun.write_text(_LOG.replace("5.00000", "5.50000"))
    with pytest.raises(SystemExit):
        main([str(first), str(rerun)])
    err = capsys.readouterr().err
    assert "two runs named 'nvfp4'" in err and "NAME=PATH" in err
    main([str(first), f"rerun={rerun}", "--last", "1", "--markdown"])
    out = capsys.readouterr().out
    assert "| rerun | 20 |" in out and "+0.5000" in out
    with pytest.raises(SystemExit):  # a NAME=PATH whose path is missing names that path and how it was read
        main([str(first), f"rerun={tmp_path / 'missing.log'}"])
    err = capsys.readouterr().err
    assert "missing.log" in err and "read as NAME=PATH" in err
    with pytest.raises(SystemExit):  # --csv may not replace an input given as NAME=PATH
        main([str(first), f"rerun={rerun}", "--csv", str(rerun)])
    assert rerun.read_text() == _LOG.replace("5.00000", "5.50000")
    odd = tmp_path / "lr=3.log"  # an existing file whose name holds '=' is a path, named by its stem
    odd.write_text(_LOG)
    main([str(first), str(odd), "--last", "1", "--markdown"])
    assert "| lr=3 | 20 |" in capsys.readouterr().out
