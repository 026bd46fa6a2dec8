"""The command-line tools: usage names the module as run, --help describes every argument, and a missing
input ends with one line naming it and exit status 2 (no traceback)."""

from __future__ import annotations

import importlib

import pytest

TOOLS = {
    "titan_nvfp4.compare": ["no_such_spec.toml"],
    "titan_nvfp4.tools.loss_log": ["no_such_run.log"],
    "titan_nvfp4.tools.loss_plot": ["no_such_run.log", "--out", "x.png"],
    "titan_nvfp4.tools.e2e_report": ["no_such_run.log"],
    "titan_nvfp4.tools.memory_peak": ["no_such_snapshot.pickle"],
    "titan_nvfp4.tools.export_dense": ["no_such_checkpoint", "out.pt"],
    "titan_nvfp4.tools.export_hf": ["no_such_checkpoint", "--job.config_file", "job.toml", "--format", "bf16", "--out",
                                    "hf"],
    "titan_nvfp4.tools.eval_hf": ["no_such_folder", "--job.config_file", "job.toml"],
    "titan_nvfp4.tools.eval_run": ["no_such_checkpoint", "--job.config_file", "job.toml", "--forward", "bf16"],
}


def _run(module: str, argv: list[str], capsys) -> tuple[int, str, str]:
    main = importlib.import_module(module).main
    try:
        code = main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("module", [*TOOLS, "titan_nvfp4.tools.emulated_dp"])
def test_help_names_the_module_and_describes_every_argument(module, capsys):
    code, out, _ = _run(module, ["--help"], capsys)
    assert code == 0
    assert f"python -m {module}" in out
    doc = importlib.import_module(module).__doc__
    assert doc.strip().splitlines()[-1].strip() in out, "the whole docstring, not its first line"
    if module != "titan_nvfp4.tools.emulated_dp":  # argparse: every argument has a help text
        assert not undocumented_arguments(out), f"{module}: no help for {undocumented_arguments(out)}"


def undocumented_arguments(help_text: str) -> list[str]:
    """Arguments listed by argparse's help with no text: on its line, or indented on the next one."""
    lines = help_text.split("positional arguments:", 1)[-1].splitlines()
    missing = []
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("   ") and line.strip():
            name, _, text = line.strip().partition("  ")
            below = lines[i + 1] if i + 1 < len(lines) else ""
            if not text.strip() and not below.startswith("   "):
                missing.append(name)
    return missing


def test_undocumented_arguments_are_found():
    assert undocumented_arguments("positional arguments:\n  spec\n\noptions:\n  -h, --help  show this\n") == ["spec"]
    assert undocumented_arguments("positional arguments:\n  RUN   a run\n  --long-option LONG\n      its help\n") == []


@pytest.mark.parametrize("module", TOOLS)
def test_missing_input_is_one_line_and_exit_2(module, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(module, TOOLS[module], capsys)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"python -m {module}: error: ") and "no_such" in lines[0], err
    assert "Traceback" not in err


def test_a_bad_spec_names_the_file_and_the_key(capsys, tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text('[compare]\nbase = "train_configs/llama3_nvfp4.toml"\nsteps = 0\n')
    code, _, err = _run("titan_nvfp4.compare", [str(spec)], capsys)
    assert code == 2 and str(spec) in err and "steps" in err and len(err.strip().splitlines()) == 1
    spec.write_text("[compare\n")
    code, _, err = _run("titan_nvfp4.compare", [str(spec)], capsys)
    assert code == 2 and f"{spec}: invalid TOML" in err


def test_a_file_without_metrics_is_named(capsys, tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("no metric lines here\n")
    code, _, err = _run("titan_nvfp4.tools.loss_log", [str(log)], capsys)
    assert code == 2 and f"no TorchTitan metric lines in {log}" in err
