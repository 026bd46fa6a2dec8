"""Compile the kernel specializations of a precompile manifest into Triton's cache, on several processes: what a
training process starts in the background at conversion (titan_nvfp4/kernels/precompile.py), or by hand to fill a
cache folder ahead of jobs.

    python -m titan_nvfp4.tools.precompile_kernels MANIFEST [--workers N]

Exit 0 when the manifest was read (a kernel that fails to compile is reported and compiles on first use), 2 for an
unreadable manifest, one of another Triton version, or TRITON_INTERPRET set; one summary line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import triton

from ..kernels.precompile import compile_all, default_workers, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_nvfp4.tools.precompile_kernels",
                                description="Compile the kernels of a manifest into Triton's cache.")
    p.add_argument("manifest", type=Path)
    p.add_argument("--workers", type=int, default=default_workers())
    args = p.parse_args(argv)
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
    t0 = time.perf_counter()
    done, failures = compile_all(doc, args.workers)
    for f in failures[:3]:
        print(f"titan_nvfp4 precompile: failed: {f}", file=sys.stderr)
    failed = f" ({len(failures)} failed: they compile on first use)" if failures else ""
    print(f"titan_nvfp4 precompile: {done} of {len(doc['kernels'])} kernel specializations in Triton's cache after "
          f"{time.perf_counter() - t0:.1f} s on {args.workers} processes{failed}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
