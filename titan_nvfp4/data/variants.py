"""Derived copies of a JSON-lines split, for comparing training layouts on equal terms.

TorchTitan hands data-parallel rank r of N the r-th contiguous 1/N of a map-style dataset
(``datasets.distributed.split_dataset_by_node``), so the documents a rank reads depend on the layout:

- ``replicate(src, dst, copies=N)``: N back-to-back copies of ``src``. Every rank of an N-way
  data-parallel run then reads ``src`` in order, as a one-rank run does (the packed token stream runs on
  across the copy boundary, as across a re-loop), so a validation loss means the same tokens in every layout.
- ``rotate(src, dst)``: the documents from the middle on, then the first half. Training a one-GPU
  control on it measures how much a different document order alone moves the loss, which is what data
  sharding changes between a one-GPU and a data-parallel run.

    python -m titan_nvfp4.data.variants replicate SRC DST [--copies 2]
    python -m titan_nvfp4.data.variants rotate SRC DST
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _lines(src: str | Path) -> list[bytes]:
    lines = [ln for ln in Path(src).read_bytes().splitlines(keepends=True) if ln.strip()]
    if not lines:
        raise ValueError(f"{src}: no JSON lines")
    return [ln if ln.endswith(b"\n") else ln + b"\n" for ln in lines]


def replicate(src: str | Path, dst: str | Path, copies: int = 2) -> Path:
    """Write ``copies`` back-to-back copies of the documents of ``src`` to ``dst``."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    Path(dst).write_bytes(b"".join(_lines(src)) * copies)
    return Path(dst)


def rotate(src: str | Path, dst: str | Path) -> Path:
    """Write the documents of ``src`` from the middle one on, then the first half, to ``dst``."""
    lines = _lines(src)
    half = len(lines) // 2
    Path(dst).write_bytes(b"".join(lines[half:] + lines[:half]))
    return Path(dst)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("replicate", "rotate"))
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--copies", type=int, default=2, help="replicate: number of copies")
    args = ap.parse_args(argv)
    out = replicate(args.src, args.dst, args.copies) if args.kind == "replicate" else rotate(args.src, args.dst)
    print(f"{args.kind}: {args.src} -> {out} ({len(_lines(out))} documents)")


if __name__ == "__main__":
    main()
