"""The end-to-end benchmark report: parsing TorchTitan 0.2.2 logs into step time, tps, memory and ratio."""

import json

import pytest

from titan_nvfp4.tools.e2e_report import main, summarize_run, tokens_per_step

B, S = 32, 2048
TOKENS = B * S


def metric_line(step: int, loss: float, tps: float, mem_gib: float, color: bool = False) -> str:
    """A metric line exactly as torchtitan/components/metrics.py (0.2.2) MetricsProcessor.log prints it."""
    c = [f"\x1b[{n}m" for n in (31, 32, 33, 36, 34, 36, 35, 39)] if color else [""] * 8
    grad_norm, pct = 0.5, 100 * mem_gib / 79.18
    tflops = 2.7e9 * tps / 1e12
    mfu = 100 * tflops * 1e12 / 9.89e14
    msg = (
        f"{c[0]}step: {step:2}  "
        f"{c[1]}loss: {loss:8.5f}  "
        f"{c[2]}grad_norm: {grad_norm:7.4f}  "
        f"{c[3]}memory: {mem_gib:5.2f}GiB"
        f"({pct:.2f}%)  "
        f"{c[4]}tps: {round(tps):,}  "
        f"{c[5]}tflops: {tflops:,.2f}  "
        f"{c[6]}mfu: {mfu:.2f}%{c[7]}"
    )
    return f"[titan] 2026-11-24 10:00:{step:02d},000 - root - INFO - {msg}"


def make_log(step_ms: list[float], mem: list[float], loss0: float = 8.0, color: bool = False) -> str:
    """A TorchTitan log of len(step_ms) steps at log_freq 1, with the trainer-init line and noise around it."""
    head = [
        "[titan] 2026-11-24 10:00:00,000 - root - INFO - Starting job: Llama3 2B_bench",
        "[titan] 2026-11-24 10:00:00,100 - root - INFO - Trainer is initialized with local batch size "
        f"{B}, global batch size {B}, gradient accumulation steps 1, sequence length {S}, total steps "
        f"{len(step_ms)} (warmup 5)",
        "[titan] 2026-11-24 10:00:00,200 - root - INFO - Training starts at step 1",
    ]
    lines = [metric_line(i + 1, loss0 - 0.1 * i, TOKENS / (ms / 1000), m, color)
             for i, (ms, m) in enumerate(zip(step_ms, mem))]
    lines.insert(1, "[titan] 2026-11-24 10:00:01,000 - root - INFO - Synchronizing and adjusting timeout")
    tail = ["[titan] 2026-11-24 10:01:00,000 - root - INFO - Sleeping 2 seconds for other ranks to complete",
            "[titan] 2026-11-24 10:01:02,000 - root - INFO - Training completed"]
    return "\n".join(head + lines + tail) + "\n"


# BF16: two slow warm-up steps, then 400/410/420/430 ms; NVFP4: warm-up, then 1200/1210/1220/1230 ms.
BF16 = make_log([5000, 900, 400, 410, 420, 430], [70.0, 71.5, 71.5, 71.62, 71.6, 71.6])
NVFP4 = make_log([9000, 2000, 1200, 1210, 1220, 1230], [75.0, 60.0, 60.25, 60.5, 60.5, 60.5], color=True)


def test_tokens_per_step_from_init_line():
    assert tokens_per_step(BF16) == TOKENS
    assert tokens_per_step("no such line") is None


def test_summary_skips_warmup():
    r = summarize_run("bf16", BF16, skip=2)
    assert (r.steps_logged, r.steps_measured) == (6, 4)
    # medians of 400/410/420/430 ms; tps is rounded to an integer in the log, so within 0.01%
    assert r.step_ms == pytest.approx(415.0, rel=1e-4)
    assert r.tps == pytest.approx((TOKENS / 0.410 + TOKENS / 0.420) / 2, rel=1e-4)  # median of an even count
    assert r.peak_memory_gib == 71.62  # max of the measured steps, not warm-up step 1's 70.0
    assert r.final_loss == pytest.approx(7.5)
    assert r.notes == []
    n = summarize_run("nvfp4", NVFP4, skip=2)  # colored lines parse too
    assert n.step_ms == pytest.approx(1215.0, rel=1e-4) and n.peak_memory_gib == 60.5


def test_markdown_and_json(tmp_path, capsys):
    a, b, j = tmp_path / "llama3_2b_bench_bf16.log", tmp_path / "llama3_2b_bench_nvfp4.log", tmp_path / "r.json"
    a.write_text(BF16)
    b.write_text(NVFP4)
    main([str(a), str(b), "--skip", "2", "--json", str(j)])
    out = capsys.readouterr().out
    assert "| llama3_2b_bench_bf16 | 65,536 | 4 | 415.0 |" in out
    assert "| llama3_2b_bench_nvfp4 | 65,536 | 4 | 1215.0 |" in out
    assert "llama3_2b_bench_nvfp4/llama3_2b_bench_bf16 step-time ratio: 2.928" in out  # 1215 / 415
    rows = json.loads(j.read_text())["runs"]
    assert rows[0]["step_time_ratio"] == pytest.approx(1.0)
    assert rows[1]["step_time_ratio"] == pytest.approx(1215 / 415, rel=1e-4)


def test_failed_run_is_reported_not_fatal(tmp_path, capsys):
    oom = make_log([5000], [79.0]) + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    a, b = tmp_path / "bf16.log", tmp_path / "nvfp4.log"
    a.write_text(BF16)
    b.write_text(oom)
    main([str(a), str(b), "--skip", "2"])
    out = capsys.readouterr().out
    assert "out of memory; no step after the first 2 logged" in out
    assert "nvfp4/bf16 step-time ratio: —" in out


def test_autotuner_shared_memory_message_is_not_an_out_of_memory():
    # inductor logs this for a flex-attention candidate it skips; the run goes on (H200, 2026-12-06)
    skipped = (
        "select_algorithm.py:3924] [1/0] No valid triton configs. OutOfMemoryError: out of resource: "
        "triton_flex_attention Required: 361472 Hardware limit:232448\n"
    )
    r = summarize_run("x", skipped + BF16, skip=2)
    assert "out of memory" not in r.notes
    assert r.step_ms == pytest.approx(415.0, rel=1e-4)


def test_tokens_override_without_init_line():
    text = "\n".join(line for line in BF16.splitlines() if "Trainer is initialized" not in line)
    assert summarize_run("x", text, skip=2).step_ms is None
    assert summarize_run("x", text, skip=2, tokens=TOKENS).step_ms == pytest.approx(415.0, rel=1e-4)


def test_missing_log_gets_a_row(tmp_path, capsys):
    a = tmp_path / "bf16.log"
    a.write_text(BF16)
    main([str(a), str(tmp_path / "nvfp4.log"), "--skip", "2"])
    assert "| nvfp4 | — | 0 | — |" in capsys.readouterr().out


def test_peak_active_memory_from_the_tensorboard_events_beside_a_log(tmp_path, capsys):
    """e2e_bench.sh gives each arm the dump folder LOG-stem.dump with --metrics.enable_tensorboard: the report takes
    the peak active memory of the measured steps from its events (reserved memory keeps the first steps' peaks)."""
    from torch.utils.tensorboard import SummaryWriter

    a, b, j = tmp_path / "bf16.log", tmp_path / "nvfp4.log", tmp_path / "r.json"
    a.write_text(BF16)
    b.write_text(NVFP4)
    writer = SummaryWriter(str(tmp_path / "nvfp4.dump" / "tb" / "20261206-0700"))
    for step, active in enumerate([74.0, 50.0, 41.0, 41.5, 41.25, 41.0], start=1):  # step 1: compiles, autotuning
        writer.add_scalar("loss_metrics/global_avg_loss", 8.0 - 0.1 * step, step)
        writer.add_scalar("memory/max_active(GiB)", active, step)
    writer.close()
    main([str(a), str(b), "--skip", "2", "--json", str(j)])
    out = capsys.readouterr().out
    assert "| peak memory GiB (max reserved) | peak active GiB |" in out
    assert "| 60.50 | 41.50 |" in out and "| 71.62 | — |" in out  # no dump folder beside bf16.log
    rows = json.loads(j.read_text())["runs"]
    assert rows[1]["peak_active_gib"] == 41.5 and rows[0]["peak_active_gib"] is None
