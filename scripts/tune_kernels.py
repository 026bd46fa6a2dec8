"""Regenerate the autotuning choices shipped for this GPU's class (titan_nvfp4/kernels/tuned/<class>.json).

Run on the GPU machine from the repo root, after `source scripts/device_setup.sh` and
`python -m titan_nvfp4.data.prepare`:

    python scripts/tune_kernels.py                      # the default jobs, eager and compiled, into the package
    python scripts/tune_kernels.py --jobs train_configs/llama3_nvfp4.toml --out "$OUT/sm90.json" \
        --base titan_nvfp4/kernels/tuned/sm90.json       # one job per device call (10 minutes), merged

Each (job, mode) trains a few steps under torchrun in a fresh process with the shipped choices off
(TITAN_NVFP4_SHIPPED_TUNING=0), Triton's on-disk choices off (TITAN_NVFP4_AUTOTUNE_CACHE=0) and empty Triton and
inductor caches, so every kernel benchmarks every config for every key it meets; the worker then writes what each
autotuner chose. The choices of all runs are merged (a key tuned twice keeps its first run's choice; the count of
disagreements is printed) and written atomically; the keys and benchmark runs per kernel of each run are printed
(the inventory of docs/performance.md's cold-start section).

Then each (job, mode) runs again with the new table in place, recording every kernel specialization it compiles:
the manifest of the background precompile (kernels/precompile.py) goes beside the table as <class>.kernels.json
(with --base, merged with the base table's manifest).

A job too large to tune within one device call resumes: a tuning worker writes the choices made so far every few
seconds, a run past --timeout is stopped, and its last snapshot goes into --out marked partial (no manifest, exit 3);
the next call passes that table as --base with --resume, so its keys launch their listed choice and only the keys it
lacks are benchmarked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = ["train_configs/llama3_nvfp4.toml", "train_configs/deepseek_v3_nvfp4.toml",
        "train_configs/deepseek_v3_16b_4blocks_nvfp4.toml", "train_configs/gpt_oss_nvfp4.toml",
        "train_configs/qwen3_30b_a3b_4blocks_nvfp4.toml", "train_configs/gpt_oss_20b_4blocks_nvfp4.toml"]
MODES = {"eager": [], "compiled": ["--compile.enable"]}
SNAPSHOT_S = 10  # seconds between a tuning worker's snapshots of the choices made so far
STOP_GRACE_S = 60  # seconds torchrun gets to stop its worker after SIGTERM (it kills it itself after 30)


def worker(out: Path, train_args: list[str], record: bool = False) -> None:
    """Inside torchrun: train with ``train_args``, then write every autotuner's choices to ``out`` (``record``: the
    kernel specializations compiled instead, as a precompile manifest)."""
    # Before TorchTitan's import: its ConfigManager.parse_args binds sys.argv[1:] as a default when first imported.
    sys.argv = ["torchtitan.train", *train_args]
    Path(f"{out}.pid").write_text(str(os.getpid()))  # run_job kills it by this if torchrun cannot (its own session)
    sys.path.insert(0, str(ROOT))
    import torch
    from torchtitan.train import Trainer, main

    from titan_nvfp4.kernels import launch, precompile, shipped_tuning
    from titan_nvfp4.tools.atomic import write_text

    if record:
        with precompile.recording() as rec:
            main(Trainer)
        if int(os.environ.get("RANK", "0")) == 0:
            write_text(out, json.dumps(rec.manifest()))
        return

    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes the dump (another rank's thread would touch GPU 0)
        main(Trainer)
        return

    device = int(os.environ.get("LOCAL_RANK", "0"))  # the snapshot thread's own current device would be 0

    def dump(partial: bool) -> None:
        kernels = {}
        for tuner in launch.TUNERS:
            if tuner.cache:
                kernels[tuner.base_fn.__name__] = {
                    "configs": len(tuner.configs), "shipped": tuner.shipped_hits,
                    "choices": {shipped_tuning.key_text(k): shipped_tuning.config_entry(c)
                                for k, c in list(tuner.cache.items())}}
        if partial and not kernels:  # nothing chosen yet (and CUDA perhaps not started by the training thread)
            return
        write_text(out, json.dumps({"gpu_class": shipped_tuning.gpu_class(device),
                                    "gpu": torch.cuda.get_device_name(device), "partial": partial, "kernels": kernels}))

    stop = threading.Event()

    def snapshots():  # every finished choice is on disk within seconds: a run stopped at its timeout keeps them
        while not stop.wait(SNAPSHOT_S):
            try:
                dump(partial=True)
            except Exception as e:  # noqa: BLE001 -- the run goes on; its final dump is written by the main thread
                print(f"tune_kernels worker: snapshot failed: {type(e).__name__}: {e}", flush=True)

    thread = threading.Thread(target=snapshots, daemon=True)
    thread.start()
    main(Trainer)
    stop.set()
    thread.join()
    dump(partial=False)


def run_job(job: str, mode: str, steps: int, extra: list[str], scratch: Path, timeout: int,
            table: Path | None = None, record: bool = False, logs: Path | None = None) -> dict:
    """One (job, mode) in a fresh torchrun process with empty caches and no stored choices but ``table``'s (--resume);
    its dump, marked partial when the run was stopped at ``timeout``. With ``record``: again with ``table``'s choices
    (and the caches the first run filled), recording the kernels it compiles. The run's log goes into ``logs`` (kept)
    or ``scratch``; it lists each kernel tuned, with the seconds it took (TRITON_PRINT_AUTOTUNING)."""
    name = f"{Path(job).stem}_{mode}"
    run = name + (".kernels" if record else "")
    dump, log = scratch / f"{run}.json", (logs or scratch) / f"{run}.log"
    env = {**os.environ, "TRITON_PRINT_AUTOTUNING": "1", "TITAN_NVFP4_SHIPPED_TUNING": str(table) if table else "0",
           "TITAN_NVFP4_AUTOTUNE_CACHE": "0", "TITAN_NVFP4_PRECOMPILE": "0",
           "TRITON_CACHE_DIR": str(scratch / f"{name}.triton"), "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"{name}.inductor")}
    cmd = ["torchrun", "--standalone", "--nproc_per_node=1", str(Path(__file__).resolve()),
           "--record" if record else "--worker", str(dump), "--",
           "--job.config_file", job, "--training.steps", str(steps), *MODES[mode], *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc, late = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:  # torchrun hands SIGTERM on to its worker (not left running on the GPU)
            proc.send_signal(signal.SIGTERM)
            try:
                rc, late = proc.wait(timeout=STOP_GRACE_S), True
            except subprocess.TimeoutExpired:
                proc.kill()
                rc, late = proc.wait(), True
            kill_worker(Path(f"{dump}.pid"))  # torchrun starts it in a session of its own: killing torchrun misses it
    got = json.loads(dump.read_text()) if dump.is_file() else None
    if late and got is not None and not record:  # a snapshot, or the final dump of a run finished while stopped
        if got.get("partial"):
            print(f"{job} ({mode}): stopped after {timeout} s; what it tuned so far is kept", flush=True)
        return got
    if rc != 0 or got is None:
        why = f"ran past --timeout {timeout} s" if late else f"failed with exit {rc}"
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"tune_kernels: {job} ({mode}) {why}; log {log}:\n" + "\n".join(tail))
    return got


def kill_worker(pid_file: Path) -> None:
    """SIGKILL the worker that wrote ``pid_file`` if it still runs (a stopped run must not keep the GPU)."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):  # gone (or no /proc to tell a reused pid by)
        return
    if b"tune_kernels.py" not in cmdline:  # the pid is another process's by now
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def merge(dumps: list[tuple[str, dict]], base: dict | None) -> tuple[dict, int]:
    """(kernels {name: {key: config}}, disagreements) over the runs' dumps, on top of ``base`` (the existing
    table's kernels, with --merge): a key tuned by two runs keeps the first run's choice."""
    fresh: dict[str, dict] = {}
    disagree = 0
    for _, dump in dumps:
        for name, got in dump["kernels"].items():
            mine = fresh.setdefault(name, {})
            for key, config in got["choices"].items():
                if key in mine:
                    disagree += mine[key] != config
                else:
                    mine[key] = config
    kernels = {k: dict(v) for k, v in (base or {}).items()}
    for name, mine in fresh.items():
        kernels.setdefault(name, {}).update(mine)
    return kernels, disagree


def main() -> None:
    p = argparse.ArgumentParser(prog="python scripts/tune_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", nargs="+", default=JOBS, help="job files (default: the README quick start, the MoE jobs)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    p.add_argument("--out", type=Path, help="table file (default titan_nvfp4/kernels/tuned/<this GPU's class>.json)")
    p.add_argument("--base", type=Path, help="a table whose keys that these runs do not meet are kept (several calls "
                                             "of one job each build one table)")
    p.add_argument("--resume", action="store_true", help="tune only the keys --base lacks (its choices serve the "
                                                             "others): a partial table from a run past --timeout")
    p.add_argument("--timeout", type=int, default=540, help="seconds per run (default 540); a tuning run past it "
                                                            "keeps what it tuned (--out is written partial, exit 3)")
    p.add_argument("--logs", type=Path, help="a folder to keep the runs' logs in (default: removed with the caches)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more TorchTitan arguments, for every run")
    args = p.parse_args()
    if args.resume and args.base is None:
        raise SystemExit("tune_kernels: --resume needs --base (the partial table to go on from)")
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    for job in args.jobs:
        if not (ROOT / job).is_file():
            raise SystemExit(f"tune_kernels: --jobs {job}: no such job file under {ROOT}")

    sys.path.insert(0, str(ROOT))
    import torch

    from titan_nvfp4.kernels import gemm, grouped_gemm, launch, mxfp8, quantize, shipped_tuning, swiglu  # noqa: F401

    cls = shipped_tuning.gpu_class(torch.cuda.current_device())
    out = args.out or shipped_tuning.TABLE_DIR / f"{cls}.json"
    base = None
    if args.base is not None:
        if not args.base.is_file():
            raise SystemExit(f"tune_kernels: --base {args.base}: no such table file")
        base = {k: {shipped_tuning.key_text(key): e for key, e in v.items()}
                for k, v in shipped_tuning.load(args.base.resolve()).items()}
    scratch = Path(tempfile.mkdtemp(prefix="tune_kernels_"))  # the runs' caches, kept for the recording runs
    try:
        tune_and_record(args, cls, out, base, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tune_and_record(args, cls: str, out: Path, base, scratch: Path) -> None:
    """Tune every (job, mode), write the table at ``out``, then record the kernels each compiles with it."""
    import torch
    import triton

    from titan_nvfp4.kernels import launch, shipped_tuning
    from titan_nvfp4.tools.atomic import write_text

    dumps, partial = [], None
    pairs = [(job, mode) for job in args.jobs for mode in args.modes]
    for job, mode in pairs:
        if partial:  # the runs after a stopped one wait for the resumed call
            break
        dump = run_job(job, mode, args.steps, args.extra, scratch, args.timeout,
                       table=args.base.resolve() if args.resume else None, logs=args.logs)
        if dump["partial"]:
            partial = f"{job} ({mode})"
        if dump["gpu_class"] != cls:
            raise SystemExit(f"tune_kernels: {job} ran on {dump['gpu_class']}, this machine is {cls}")
        tuned = {name: len(k["choices"]) - k.get("shipped", 0) for name, k in dump["kernels"].items()}
        runs = sum(tuned[name] * k["configs"] for name, k in dump["kernels"].items())
        print(f"{job} ({mode}): {sum(tuned.values())} keys tuned, {runs} benchmark runs", flush=True)
        seconds = autotune_seconds((args.logs or scratch) / f"{Path(job).stem}_{mode}.log")
        for name, k in sorted(dump["kernels"].items()):
            spent = f", {seconds[name]:.1f} s" if name in seconds else ""
            print(f"    {name}: {tuned[name]} keys x {k['configs']} configs{spent}"
                  + (f" (+{k['shipped']} from --base)" if k.get("shipped") else ""), flush=True)
        if seconds:
            print(f"    autotuning took {sum(seconds.values()):.1f} s of the run", flush=True)
        dumps.append((f"{job} ({mode})", dump))
    kernels, disagree = merge(dumps, base)
    if partial and base is not None and all(k in base.get(n, {}) for n, v in kernels.items() for k in v):
        raise SystemExit(f"tune_kernels: {partial} tuned no key beyond --base {args.base} within --timeout "
                         f"{args.timeout} s (its first step alone takes longer?): give a longer --timeout")
    manifest_from = base_manifest(args.base)
    doc = {"format": shipped_tuning.FORMAT, "gpu_class": cls, "gpu": dumps[0][1]["gpu"] if dumps else None,
           "torch": torch.__version__, "triton": triton.__version__,
           **provenance([name for name, _ in dumps], args.base),
           **({"partial": f"{partial} stopped at --timeout: resume with --base {out} --resume"} if partial else {}),
           # the manifest the finished table's will be merged onto (a partial table has none beside it)
           **({"manifest_from": str(manifest_from)} if partial and manifest_from is not None else {}),
           "kernels": {k: dict(sorted(v.items())) for k, v in sorted(kernels.items())}}
    write_text(out, json.dumps(doc, indent=1) + "\n", option="--out")
    shipped_tuning.clear()
    tuners = {t.base_fn.__name__: t for t in launch.TUNERS}
    for name in kernels:  # every entry is one of its kernel's configs, as a launch will check
        if name not in tuners:
            raise SystemExit(f"tune_kernels: {out}: kernel {name!r} is no autotuned kernel of this package")
        shipped_tuning.choices(out, name, tuners[name].configs)
    total = sum(len(v) for v in kernels.values())
    print(f"tune_kernels: wrote {out}: {total} keys over {len(kernels)} kernels ({disagree} keys chosen differently "
          f"by two runs: the first run's choice kept)")
    if partial:
        print(f"tune_kernels: {partial} was stopped at --timeout {args.timeout} s: {out} is partial and has no "
              f"manifest; go on with --base {out} --resume", flush=True)
        raise SystemExit(3)
    record_kernels(args, out, pairs, scratch)


def record_kernels(args, table: Path, runs: list[tuple[str, str]], scratch: Path) -> None:
    """Each (job, mode) again with ``table`` in place and the caches its tuning run filled, recording the kernel
    specializations compiled; the merged manifest (on top of --base's, if it has one) is written beside ``table`` as
    <name>.kernels.json."""
    import triton

    from titan_nvfp4.kernels import precompile
    from titan_nvfp4.tools.atomic import write_text

    manifests = []
    kept_path = base_manifest(args.base)
    if kept_path is not None:
        kept = precompile.load(kept_path)
        if kept["triton"] == triton.__version__:
            manifests.append(kept)
        else:
            print(f"tune_kernels: {kept_path} is for Triton {kept['triton']}: not merged", flush=True)
    try:
        for job, mode in runs:
            got = run_job(job, mode, args.steps, args.extra, scratch, args.timeout, table=table.resolve(), record=True,
                          logs=args.logs)
            print(f"{job} ({mode}): {len(got['kernels'])} kernel specializations compiled"
                  + (f"; not recordable: {', '.join(got['not_recorded'])}" if got.get("not_recorded") else ""),
                  flush=True)
            for u in got.get("unfaithful", []):
                print(f"  left out, its manifest entry would compile another kernel: {u['kernel']}: "
                      + "; ".join(u["differs"]), flush=True)
            manifests.append(got)
    except SystemExit:
        stale = kernels_path(table)
        if stale.is_file():  # it lists the old table's choices
            stale.unlink()
            print(f"tune_kernels: removed {stale}, which listed the kernels of the table before this one", flush=True)
        raise
    doc = precompile.merge(manifests)
    doc.update(provenance([f"{j} ({m})" for j, m in runs], kept_path if len(manifests) > len(runs) else None))
    out = kernels_path(table)
    write_text(out, json.dumps(doc, indent=1) + "\n", option="--out")
    precompile.load(out)
    print(f"tune_kernels: wrote {out}: {len(doc['kernels'])} kernel specializations", flush=True)


def provenance(runs: list[str], base: Path | None) -> dict:
    """The header of a table or manifest written now: when, by which command, from which runs; with the ``base`` it
    was built on, that file's own header (and the ones it kept) under "earlier", so that a table tuned over several
    calls (--base ... --resume) still names every run behind its entries."""
    doc = {"generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python scripts/tune_kernels.py " + " ".join(sys.argv[1:]), "runs": runs}
    if base is not None:
        kept = json.loads(base.read_text())
        doc["earlier"] = kept.get("earlier", []) + [{k: kept[k] for k in ("generated", "command", "runs") if k in kept}]
    return doc


def autotune_seconds(log: Path) -> dict[str, float]:
    """{kernel: seconds} its keys' autotuning took in a run's log (Triton's TRITON_PRINT_AUTOTUNING lines: compiles
    and benchmarks of every candidate)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    out: dict[str, float] = {}
    for name, sec in re.findall(r"Triton autotuning for function (\w+),\s*with key as .*?,\s*finished after "
                                r"([0-9.]+)s", text, flags=re.S):
        out[name] = out.get(name, 0.0) + float(sec)
    return out


def base_manifest(base: Path | None) -> Path | None:
    """The manifest a table built on ``base`` merges onto: the one beside it, or, for a partial table, the one its
    own base had (its "manifest_from"); None if neither exists (or no base)."""
    if base is None:
        return None
    if kernels_path(base).is_file():
        return kernels_path(base)
    try:
        origin = json.loads(base.read_text()).get("manifest_from")
    except (OSError, json.JSONDecodeError):
        return None
    return Path(origin) if origin and Path(origin).is_file() else None


def kernels_path(table: Path) -> Path:
    """The precompile manifest beside a tuning table: sm90.json → sm90.kernels.json."""
    return table.with_name(table.stem + ".kernels.json")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("--worker", "--record"):
        rest = sys.argv[3:]
        worker(Path(sys.argv[2]), rest[1:] if rest[:1] == ["--"] else rest, record=sys.argv[1] == "--record")
    else:
        main()
