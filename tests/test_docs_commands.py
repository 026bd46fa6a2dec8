"""Every command in README.md and docs/*.md works as written, or is at least well-formed where it needs a GPU.

Commands are the lines of ```bash blocks. Each one is sorted into a kind:
- runs on CPU, and is run here as written in a scratch directory: the tools (`python -m titan_nvfp4....`),
  `python -c`, and the training command of the quick start, which must stop with the plugin's message;
- needs a GPU or a network-less GPU machine (training, the comparison runner, scripts/, benchmarks/): its
  files must exist, its job file must parse with TorchTitan's parser, its comparison spec must load;
- installs or tests (`pip install`, `python -m pytest`): must be exactly what `.ci/run` runs.
A command of no known kind fails the test, so a new one gets a check when it is written.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from docs_pages import PAGES, REPO

DATA = Path(__file__).resolve().parent / "data"
CPU_TRAINING_MARK = "titan-nvfp4: TorchTitan training needs a CUDA or ROCm GPU"


def bash_commands(page: Path) -> list[str]:
    """The commands of a page's ```bash blocks: continuation lines joined, comments and blank lines dropped."""
    out, block, in_bash = [], [], False
    for line in page.read_text().splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if in_bash:
                out += _join(block)
                block = []
            in_bash = (not in_bash) and fence == "```bash"
            continue
        if in_bash:
            block.append(line)
    return out


def _join(lines: list[str]) -> list[str]:
    cmds, cur = [], ""
    for line in lines:
        line = _strip_comment(line).rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            cmds.append(" ".join(cur.split()))
        cur = ""
    return cmds


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


ALL = [(page, cmd) for page in PAGES for cmd in bash_commands(page)]


def _id(item) -> str:
    page, cmd = item
    return f"{page.name}:{cmd[:60]}"


_ENV_PREFIX = re.compile(r"""^(?:[A-Za-z_]\w*=(?:"[^"]*"|'[^']*'|[^\s"'])*\s+)+""")


def kind(cmd: str) -> str:
    cmd = _ENV_PREFIX.sub("", cmd)  # `VAR=value ... command`: the kind of the command
    if cmd.startswith(("pip install", "python -m pip install")) or cmd.startswith("python -m pytest"):
        return "ci"
    if cmd.startswith("mkdir "):
        return "cpu"
    if "-m torchtitan.train" in cmd or "-m titan_nvfp4.tools.emulated_dp" in cmd:
        return "train"
    if cmd.startswith("python -m titan_nvfp4.compare") and "--report-only" not in cmd:
        return "train"
    if cmd.startswith(("python -m titan_nvfp4.", "python -c ")):
        return "cpu"
    if cmd.startswith("python docs/"):  # the docs' runnable examples: on the CPU they run here
        return "cpu" if "--device cpu" in cmd else "gpu_script"
    if cmd.startswith(("bash scripts/", "source scripts/", "python scripts/", "python benchmarks/", "cd benchmarks")):
        return "gpu_script"
    if re.match(r"torchrun (--\S+ )*benchmarks/", cmd):
        return "gpu_script"
    return "unknown"


def test_every_docs_command_has_a_kind():
    assert ALL, "no ```bash blocks found"
    unknown = [f"{p.name}: {c}" for p, c in ALL if kind(c) == "unknown"]
    assert not unknown, "commands with no check in tests/test_docs_commands.py:\n" + "\n".join(unknown)


def test_readme_install_and_test_commands_are_what_ci_runs():
    readme = [c for c in bash_commands(REPO / "README.md") if kind(c) == "ci"]
    assert any(c.startswith("pip install -e") for c in readme) and "python -m pytest -q -n 2 tests" in readme
    ci = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines() if not line.strip().startswith("#")]
    for cmd in readme:
        assert cmd in ci, f"README command not run by .ci/run: {cmd}"


def test_docs_install_commands_are_the_readmes_and_test_commands_name_real_tests():
    readme = set(c for c in bash_commands(REPO / "README.md") if kind(c) == "ci")
    for page, cmd in ALL:
        if kind(cmd) != "ci":
            continue
        bare = _ENV_PREFIX.sub("", cmd)  # `TITAN_NVFP4_SLOW_TESTS=1 python -m pytest ...`: the slow tier
        if bare.startswith("python -m pytest"):
            words = shlex.split(bare)[3:]
            # options' values (-n 2, -m slow, -k expr) are not targets
            values = {i + 1 for i, w in enumerate(words) if w in ("-n", "-m", "-k", "-p")}
            targets = [w.split("::")[0] for i, w in enumerate(words) if not w.startswith("-") and i not in values]
            assert targets and all((REPO / t).exists() for t in targets), f"{page.name}: {cmd}"
        else:
            assert cmd in readme, f"{page.name}: {cmd} is not the README's install command"


def _placeholder(cmd: str) -> bool:
    return bool(re.search(r"<[^>]+>|\.\.\.|\[[^\]]*\]|\bN\b|CHECKPOINT|RUN\b|ARM\b", cmd))


def _scratch(tmp_path: Path, tensorboard: bool = False) -> Path:
    """A directory laid out like a checkout after the quick start's runs: job files, specs, two run logs
    (and, with ``tensorboard``, the runs' dump folders with TensorBoard events)."""
    for name in ("train_configs", "configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "docs", tmp_path / "docs")  # a copy: a command may write next to its inputs
    runs = tmp_path / "outputs"
    runs.mkdir()
    for arm in ("bf16", "nvfp4"):
        shutil.copy(DATA / f"llama3_{arm}.log", runs / f"llama3_{arm}.log")
        if tensorboard:
            _tensorboard_run(DATA / f"llama3_{arm}.log", runs / f"llama3_{arm}")
    return tmp_path


def _tensorboard_run(log: Path, folder: Path) -> None:
    """TensorBoard events of a run, as TorchTitan writes them under its dump folder."""
    from torch.utils.tensorboard import SummaryWriter

    from titan_nvfp4.tools.loss_log import parse_log

    writer = SummaryWriter(str(folder / "tb" / "20261127-0000"))
    for s in parse_log(log.read_text()):
        writer.add_scalar("loss_metrics/global_avg_loss", s.loss, s.step)
        writer.add_scalar("grad_norm", s.grad_norm, s.step)
        writer.add_scalar("memory/max_reserved(GiB)", s.memory_gib, s.step)
        writer.add_scalar("throughput(tps)", s.tps, s.step)
    writer.close()


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


CPU = [item for item in ALL if kind(item[1]) == "cpu"]


@pytest.mark.parametrize("item", CPU, ids=[_id(i) for i in CPU])
def test_cpu_command_runs_as_written(item, tmp_path, monkeypatch, capsys):
    page, cmd = item
    cwd = _scratch(tmp_path)
    if _placeholder(cmd) and cmd.startswith("python -m titan_nvfp4."):
        module = shlex.split(cmd)[2]
        cmd = f"python -m {module} --help"  # the arguments are the reader's: the module and its help exist
    if cmd.startswith("python -m titan_nvfp4.") and not re.search(r"[|>&;$`]", cmd):
        # a tool: run in this process (no interpreter start-up), its arguments as bash passes them
        monkeypatch.chdir(cwd)
        words = subprocess.run(["bash", "-c", f"printf '%s\\0' {cmd}"], capture_output=True, text=True,
                               check=True).stdout.split("\0")[:-1]
        monkeypatch.setattr(sys, "argv", [words[2], *words[3:]])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module may be imported already
                runpy.run_module(words[2], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        out, err = capsys.readouterr()
        assert code == 0, f"{page.name}: {cmd}\n{out[-2000:]}\n{err[-3000:]}"
        return
    cmd = re.sub(r"^python ", f"{shlex.quote(sys.executable)} ", cmd)
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{page.name}: {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_quick_start_comparison_reads_logs_and_dump_folders_alike(tmp_path, capsys, monkeypatch):
    cmds = [c for c in bash_commands(REPO / "README.md") if c.startswith("python -m titan_nvfp4.tools.loss_log")]
    assert cmds, "the README's quick start compares its two runs with loss_log"
    from titan_nvfp4.tools import loss_log

    cwd = _scratch(tmp_path, tensorboard=True)
    args = shlex.split(cmds[0])[3:]
    monkeypatch.chdir(cwd)
    loss_log.main(args)
    from_logs = capsys.readouterr().out
    loss_log.main([a.removesuffix(".log") for a in args])  # the same runs, from their TensorBoard events
    from_folders = capsys.readouterr().out
    rows = [line for line in from_logs.splitlines() if line.startswith("| llama3_")]
    assert len(rows) == 2 and "+0.27%" in rows[1], from_logs
    assert [line for line in from_folders.splitlines() if line.startswith("| llama3_")] == rows


@pytest.mark.long
def test_quick_start_training_command_on_cpu_gives_the_plugins_message(tmp_path):
    cmds = [c for c in bash_commands(REPO / "README.md") if "-m torchtitan.train" in c]
    assert cmds and cmds[0].startswith("TORCHINDUCTOR_CUDAGRAPHS=1 torchrun --nproc_per_node=1 -m torchtitan.train "
                                       "--job.config_file train_configs/llama3_nvfp4.toml --compile.enable")
    cwd = _scratch(tmp_path)
    cmd = f"set -o pipefail; {cmds[0]}"
    env = _env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count(CPU_TRAINING_MARK) == 1, out[-3000:]
    # the worker stops before TorchTitan's device set-up and before it builds the dataset: no traceback of its own
    assert "set_device" not in out and "_cuda_setDevice" not in out and "Building offline corpus" not in out
    assert not (cwd / "assets").exists()


TRAIN = [item for item in ALL if kind(item[1]) in ("train", "gpu_script")]


@pytest.mark.parametrize("item", TRAIN, ids=[_id(i) for i in TRAIN])
def test_gpu_command_names_files_that_exist(item):
    page, cmd = item
    words = shlex.split(cmd)
    paths = [w for w in words if re.search(r"\.(toml|sh|py)$", w) and not w.startswith("-")]
    for w in paths:
        assert (REPO / w).is_file() or (REPO / "benchmarks" / w).is_file(), f"{page.name}: {cmd}: no file {w}"
    jobs = [w for w in paths if w.startswith("train_configs/")]
    if jobs and kind(cmd) == "train" and not _placeholder(cmd):  # a script takes its own arguments
        from torchtitan.config import ConfigManager

        overrides = words[words.index(jobs[0]) + 1:]
        overrides = [w for w in overrides if not w.startswith(("2>", "|", "tee")) and "outputs/" not in w]
        ConfigManager().parse_args(["--job.config_file", str(REPO / jobs[0]), *overrides])
    if "scripts/e2e_bench.sh" in words and not _placeholder(cmd):
        _e2e_bench_jobs_parse(page, cmd, words)
    if cmd.startswith("python -m titan_nvfp4.compare"):
        from titan_nvfp4.compare import load_spec

        spec = next(w for w in words[3:] if not w.startswith("-"))
        cwd = os.getcwd()
        os.chdir(REPO)
        try:
            load_spec(Path(spec))
        finally:
            os.chdir(cwd)


def _e2e_bench_jobs_parse(page: Path, cmd: str, words: list[str]) -> None:
    """scripts/e2e_bench.sh runs train_configs/<CONFIG>_<arm>.toml with the command's overrides: those files exist
    and parse with them (CONFIG defaults to llama3_2b_bench, ARMS to "bf16 nvfp4", as in the script; an arm
    "nvfp4=TAG" adds the overrides of ARGS_TAG)."""
    from torchtitan.config import ConfigManager

    env = dict(w.split("=", 1) for w in words[:words.index("bash")] if "=" in w)
    args = words[words.index("scripts/e2e_bench.sh") + 1:]
    if args and not args[0].startswith("-"):  # the output folder
        args = args[1:]
    for arm in env.get("ARMS", "bf16 nvfp4").split():
        arm, _, tag = arm.partition("=")
        base, _, preset = arm.partition(":")  # "nvfp4:PRESET": the nvfp4 job with that recipe preset
        job = REPO / "train_configs" / f"{env.get('CONFIG', 'llama3_2b_bench')}_{base}.toml"
        assert job.is_file(), f"{page.name}: {cmd}: no job file {job.relative_to(REPO)}"
        preset_args = ["--quantize.linear.nvfp4.recipe", preset] if preset else []
        if tag:
            assert f"ARGS_{tag}" in env, f"{page.name}: {cmd}: arm {arm}={tag} without ARGS_{tag}"
            preset_args += shlex.split(env[f"ARGS_{tag}"])
        ConfigManager().parse_args(["--job.config_file", str(job), *preset_args, *args])
