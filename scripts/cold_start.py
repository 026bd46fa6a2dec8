"""Cold and warm start of TorchTitan jobs, BF16 against NVFP4: seconds from launch to the first "step:" log line.

    python scripts/cold_start.py OUT_DIR [--configs llama3 deepseek_v3] [--modes eager compiled] [--steps 3]

For each config C (train_configs/C_bf16.toml and C_nvfp4.toml) and mode (eager; compiled: --compile.enable), each
arm runs `torchrun --standalone --nproc_per_node=1 -m torchtitan.train --job.config_file ... --training.steps N`
twice: cold, with fresh empty TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR, then warm, with the caches the cold
run filled. The NVFP4 arms use what the package ships for the GPU (--shipped 1: the autotuning choices and the
background precompile of the kernel manifest); --shipped table: the choices only; --shipped 0: neither (several:
one arm each, e.g. --shipped 1 table 0).
Writes OUT_DIR/cold_start.md (the table; atomically), each run's log, and prints the table. Run it after
`source scripts/device_setup.sh` and `python -m titan_nvfp4.data.prepare` (scripts/cold_start.sh does both).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"\bstep:\s*\d+")
MODES = {"eager": [], "compiled": ["--compile.enable"]}
#: --shipped value: (TITAN_NVFP4_SHIPPED_TUNING, TITAN_NVFP4_PRECOMPILE, the arm's name suffix, its label suffix)
SHIPPED = {"1": ("1", "1", "", ""), "table": ("1", "0", "_noprecompile", " (shipped choices, no precompile)"),
           "0": ("0", "0", "_noship", " (nothing shipped)")}


def timed_run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[float | None, float, int]:
    """(seconds to the first "step:" line or None, seconds to exit, exit status) of one run, its output in ``log``."""
    start = time.monotonic()
    first = None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        watchdog = threading.Timer(timeout, proc.kill)  # a run that hangs is stopped (its status: -9)
        watchdog.start()
        try:
            for line in proc.stdout:
                f.write(line)
                if first is None and STEP.search(line):
                    first = time.monotonic() - start
        finally:
            rc = proc.wait()
            watchdog.cancel()
    return first, time.monotonic() - start, rc


def report(out: Path, rows: list) -> str:
    """The table of the arms run so far, written to OUT/cold_start.md (atomically: after every arm, so a call that
    runs out of time keeps what it measured)."""
    from titan_nvfp4.tools.atomic import write_text

    import torch
    import triton

    def s(x):
        return "—" if x is None else f"{x:.1f}"

    gpu = [torch.cuda.get_device_name()] if torch.cuda.is_available() else []
    lines = [f"# Cold and warm start, launch to the first step ({datetime.datetime.now(datetime.timezone.utc):%F %H:%M} UTC)",
             "", f"GPU: {gpu[0] if gpu else '?'}; torch {torch.__version__}, triton {triton.__version__}; "
             f"`python scripts/cold_start.py {' '.join(sys.argv[1:])}`", "",
             "| job | mode | arm | cold: first step (s) | warm: first step (s) | cold: exit (s) | warm: exit (s) | "
             "cold / BF16 | warm / BF16 |", "|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for c, mode, arm, ((f1, t1, r1), (f2, t2, r2)) in rows:
        if arm == "bf16":
            base[(c, mode)] = (f1, f2)
        b1, b2 = base.get((c, mode), (None, None))
        ratio = lambda a, b: "—" if a is None or not b else f"{a / b:.2f}×"  # noqa: E731
        bad = "" if r1 == r2 == 0 else f" (exit {r1}/{r2})"
        lines.append(f"| {c} | {mode} | {arm}{bad} | {s(f1)} | {s(f2)} | {t1:.1f} | {t2:.1f} | {ratio(f1, b1)} | "
                     f"{ratio(f2, b2)} |")
    text = "\n".join(lines) + "\n"
    write_text(out / "cold_start.md", text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(prog="python scripts/cold_start.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output folder (logs, cold_start.md)")
    p.add_argument("--configs", nargs="+", default=["llama3"], help="C of train_configs/C_{bf16,nvfp4}.toml")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=list(MODES))
    p.add_argument("--shipped", nargs="+", default=["1"], choices=list(SHIPPED),
                   help="NVFP4 arms with the shipped choices and precompile (1), the choices only (table), neither (0)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run before it is stopped (default 240)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more TorchTitan arguments for every run")
    args = p.parse_args()
    for c in args.configs:
        for arm in ("bf16", "nvfp4"):
            if not (ROOT / f"train_configs/{c}_{arm}.toml").is_file():
                raise SystemExit(f"cold_start: --configs {c}: no train_configs/{c}_{arm}.toml")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))

    rows = []
    for c in args.configs:
        for mode in args.modes:
            arms = [("bf16", "1")] + [("nvfp4", s) for s in args.shipped]
            for arm, shipped in arms:
                table, pre, suffix, label = SHIPPED[shipped]
                name = f"{c}_{arm}_{mode}{suffix}"
                caches = args.out / f"{name}.caches"
                shutil.rmtree(caches, ignore_errors=True)
                env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
                       "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TITAN_NVFP4_SHIPPED_TUNING": table,
                       "TITAN_NVFP4_PRECOMPILE": pre}
                cmd = ["torchrun", "--standalone", "--nproc_per_node=1", "-m", "torchtitan.train", "--job.config_file",
                       f"train_configs/{c}_{arm}.toml", "--training.steps", str(args.steps), *MODES[mode], *args.extra]
                got = []
                for temp in ("cold", "warm"):
                    first, total, rc = timed_run(cmd, env, args.out / f"{name}_{temp}.log", args.timeout)
                    print(f"{name} {temp}: first step {first if first is None else round(first, 1)} s, exit {rc} "
                          f"after {total:.1f} s", flush=True)
                    got.append((first, total, rc))
                shutil.rmtree(caches, ignore_errors=True)
                rows.append((c, mode, arm + label, got))
                text = report(args.out, rows)
    print(text)

if __name__ == "__main__":
    main()
