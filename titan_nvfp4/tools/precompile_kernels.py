"""Compile the kernel specializations of a precompile manifest into Triton's cache, on several processes: what a
training process starts in the background at conversion (titan_nvfp4/kernels/precompile.py), or by hand to fill a
cache folder ahead of jobs.

    python -m titan_nvfp4.tools.precompile_kernels MANIFEST [--workers N] [--stop-with PID] [--only I,J,...]
    python -m titan_nvfp4.tools.precompile_kernels MANIFEST --time
    python -m titan_nvfp4.tools.precompile_kernels MANIFEST --rehash

One compile of a selection per cache folder at a time (a lock file there: a second one finds it taken and exits 0;
--only, the entries at these indices, which a training process passes for those missing from its cache, has a lock
of its own per selection). With --stop-with, the compile ends when process PID (the training process that started
it) is gone, also when that was killed (torchrun ends a worker's process group; this one runs in its own session).
Exit 0 when the manifest was read (a kernel that fails to compile is reported and compiles on first use), 2 for an
unreadable manifest, a bad --only, one of another Triton version, or TRITON_INTERPRET set; one summary line on stderr.

--time compiles every entry once, one after another, into a throwaway cache folder, for the manifest's target
(no GPU needed: Triton carries ptxas), and writes each one's compile time ("compile_s", seconds on this machine,
the kernel without its launcher) and its "experts_only" class into MANIFEST; the background compile takes the
longest first. Nothing is written if an entry fails to compile.

--rehash, after an edit to a recorded kernel (or to a file above it: Triton's source hash covers the kernel's
starting line) that leaves its specializations as they were (same parameters and constexprs): compiles every entry
once for the manifest's target as --time does, then writes each recorded kernel's source hash and source
fingerprint for today's source into MANIFEST (tests/test_precompile.py fails until then). Needs the manifest's Triton
version. Nothing is written if an entry fails to compile. An edit that changes a kernel's parameters needs a new
recording instead (scripts/tune_kernels.py on the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import triton

from ..kernels.precompile import (classified, default_workers, jit_object, kernel_function, load, source_and_options,
                                  source_fingerprint)
from ..kernels.precompile_process import fill, stop_with
from .atomic import write_text

def _selection(text: str, doc: dict) -> list[int]:
    """The entry indices of --only (ValueError naming the option and the value when not indices of the manifest)."""
    try:
        only = [int(i) for i in text.split(",")]
    except ValueError:
        only = []
    n = len(doc["kernels"])
    if not only or any(not 0 <= i < n for i in only) or len(set(only)) != len(only):
        raise ValueError(f"--only {text}: expected distinct indices of the manifest's {n} kernels, comma-separated")
    return only


def time_compiles(doc: dict) -> list[float]:
    """Each entry's compile time in seconds, compiled one after another into a throwaway cache folder for the
    manifest's target (after one untimed compile, which pays this process's one-time start of the compiler)."""
    from triton.backends.compiler import GPUTarget
    target = GPUTarget(doc["target"]["backend"], doc["target"]["arch"], doc["target"]["warp_size"])
    before = os.environ.get("TRITON_CACHE_DIR")
    times = []
    try:
        with tempfile.TemporaryDirectory(prefix="titan_nvfp4_time_") as tmp:
            for i, entry in enumerate([doc["kernels"][0], *doc["kernels"]]):
                os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, str(i))  # a fresh folder: no cache hit
                src, options = source_and_options(entry)
                t0 = time.perf_counter()
                triton.compile(src, target=target, options=options)
                times.append(time.perf_counter() - t0)
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
    return times[1:]


def _time(path: Path, doc: dict) -> int:
    """--time: compile_s and experts_only written into the manifest at ``path`` (atomically; nothing on a failure)."""
    if not doc["kernels"]:
        print(f"titan_nvfp4 precompile: {path} lists no kernel: nothing to time", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    try:
        times = time_compiles(doc)
    except Exception as e:  # noqa: BLE001 (one line naming the manifest; the file is left as it was)
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"titan_nvfp4 precompile: {path}: a kernel did not compile ({type(e).__name__}: {first}): nothing "
              "written", file=sys.stderr)
        return 2
    doc["kernels"] = [{**classified(e), "compile_s": round(s, 3)} for e, s in zip(doc["kernels"], times)]
    write_text(path, json.dumps(doc, indent=1) + "\n", option="manifest")
    slowest = max(zip(times, doc["kernels"]), key=lambda t: t[0])
    print(f"titan_nvfp4 precompile: wrote the compile times of {len(times)} kernel specializations into {path} "
          f"({time.perf_counter() - t0:.1f} s in all; the longest {slowest[0]:.1f} s, {slowest[1]['name']})",
          file=sys.stderr)
    return 0


def _rehash(path: Path, doc: dict) -> int:
    """--rehash: the recorded kernels' source hashes and fingerprints for today's source, written into the manifest
    at ``path`` (atomically; nothing when an entry fails to compile)."""
    try:
        time_compiles(doc)
    except Exception as e:  # noqa: BLE001 (one line naming the manifest; the file is left as it was)
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"titan_nvfp4 precompile: {path}: a kernel did not compile ({type(e).__name__}: {first}): nothing "
              "written", file=sys.stderr)
        return 2
    changed = []
    for kernel in sorted(doc.get("sources", {})):
        module, name = kernel.split(":", 1)
        source = kernel_function(module, name).cache_key
        if doc["sources"][kernel] != source:
            changed.append(kernel)
        doc["sources"][kernel] = source
        doc.setdefault("fingerprints", {})[kernel] = source_fingerprint(jit_object(module, name))
    write_text(path, json.dumps(doc, indent=1) + "\n", option="manifest")
    print(f"titan_nvfp4 precompile: {path}: {len(doc['sources'])} kernels' source hashes and fingerprints written "
          f"({len(changed)} hashes changed{': ' + ', '.join(changed) if changed else ''}); every entry compiled",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_nvfp4.tools.precompile_kernels",
                                description="Compile the kernels of a manifest into Triton's cache.")
    p.add_argument("manifest", type=Path)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--stop-with", type=int, metavar="PID", help="end when this parent process is gone")
    p.add_argument("--only", metavar="I,J,...", help="compile only the entries at these indices")
    p.add_argument("--time", action="store_true",
                   help="measure each entry's compile time serially and write it (compile_s) into the manifest")
    p.add_argument("--rehash", action="store_true",
                   help="write the recorded kernels' source hashes and fingerprints for today's source (module docstring)")
    args = p.parse_args(argv)
    if args.stop_with is not None:
        stop_with(args.stop_with)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("titan_nvfp4 precompile: TRITON_INTERPRET is set: the kernels run in Triton's interpreter, nothing to "
              "compile", file=sys.stderr)
        return 2
    try:
        doc = load(args.manifest)
    except ValueError as e:
        print(f"titan_nvfp4 precompile: {e}", file=sys.stderr)
        return 2
    if doc["triton"] != triton.__version__:
        print(f"titan_nvfp4 precompile: {args.manifest} is for Triton {doc['triton']}, this is {triton.__version__}: "
              "nothing compiled", file=sys.stderr)
        return 2
    if args.time:
        return _time(args.manifest, doc)
    if args.rehash:
        return _rehash(args.manifest, doc)
    try:
        only = None if args.only is None else _selection(args.only, doc)
    except ValueError as e:
        print(f"titan_nvfp4 precompile: {e}", file=sys.stderr)
        return 2
    return fill(doc, args.workers, only)


if __name__ == "__main__":
    sys.exit(main())
