"""Derived copies of a JSON-lines split, for comparing training layouts on equal terms.

TorchTitan hands data-parallel rank r of N the r-th contiguous 1/N of a map-style dataset
(``datasets.distributed.split_dataset_by_node``), so the documents a rank reads depend on the layout:

- ``replicate(src, dst, copies=N)``: N back-to-back copies of ``src``. Every rank of an N-way
  data-parallel run then reads ``src`` in order, as a one-rank run does (the packed token stream runs on
  across the copy boundary, as across a re-loop), so a validation loss means the same tokens in every layout.
- ``rotate(src, dst)``: the documents from the middle on, then the first half. Training a one-GPU
  control on it measures how much a different document order alone moves the loss, which is what data
  sharding changes between a one-GPU and a data-parallel run.
- ``head(src, dst, tokens, tokenizer)``: the leading documents of ``src`` (a shuffled split, so a random
  subset) up to ``tokens`` tokens of ``tokenizer`` (BOS and EOS counted, as TorchTitan's text dataset adds
  them): a corpus small enough to memorize, for the long-run regime of a model that learns it by heart.

    python -m titan_nvfp4.data.variants replicate SRC DST [--copies 2]
    python -m titan_nvfp4.data.variants rotate SRC DST
    python -m titan_nvfp4.data.variants head SRC DST --tokens 1000000 [--tokenizer assets/pystdlib]

DST is written atomically (a kill leaves the old DST or none) and may not be SRC.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..tools.atomic import refuse_output_over_input, write_bytes


def _lines(src: str | Path) -> list[bytes]:
    lines = [ln for ln in Path(src).read_bytes().splitlines(keepends=True) if ln.strip()]
    if not lines:
        raise ValueError(f"{src}: no JSON lines")
    return [ln if ln.endswith(b"\n") else ln + b"\n" for ln in lines]


def replicate(src: str | Path, dst: str | Path, copies: int = 2) -> Path:
    """Write ``copies`` back-to-back copies of the documents of ``src`` to ``dst``."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    write_bytes(dst, b"".join(_lines(src)) * copies, "DST")
    return Path(dst)


def rotate(src: str | Path, dst: str | Path) -> Path:
    """Write the documents of ``src`` from the middle one on, then the first half, to ``dst``."""
    lines = _lines(src)
    half = len(lines) // 2
    write_bytes(dst, b"".join(lines[half:] + lines[:half]), "DST")
    return Path(dst)


def head(src: str | Path, dst: str | Path, tokens: int, tokenizer: str | Path) -> tuple[Path, int, int]:
    """Write the leading documents of ``src`` up to ``tokens`` tokens to ``dst``; return (dst, documents, tokens)."""
    import json

    from tokenizers import Tokenizer

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    kept, total = [], 0
    for line in _lines(src):
        if total >= tokens:
            break
        kept.append(line)
        total += len(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids) + 2  # + BOS, EOS
    if total < tokens:
        raise ValueError(f"{src} holds only {total} tokens, fewer than the {tokens} asked for")
    write_bytes(dst, b"".join(kept), "DST")
    return Path(dst), len(kept), total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("replicate", "rotate", "head"))
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--copies", type=int, default=2, help="replicate: number of copies")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="head: tokens to keep (whole documents)")
    ap.add_argument("--tokenizer", type=Path, default=Path("assets/pystdlib"), help="head: the tokenizer's folder")
    args = ap.parse_args(argv)
    try:
        refuse_output_over_input(args.dst, [args.src], "DST")
    except ValueError as e:
        ap.error(str(e))
    if args.kind == "head":
        out, docs, total = head(args.src, args.dst, args.tokens, args.tokenizer)
        print(f"head: {args.src} -> {out} ({docs} documents, {total} tokens)")
        return
    out = replicate(args.src, args.dst, args.copies) if args.kind == "replicate" else rotate(args.src, args.dst)
    print(f"{args.kind}: {args.src} -> {out} ({len(_lines(out))} documents)")


if __name__ == "__main__":
    main()
