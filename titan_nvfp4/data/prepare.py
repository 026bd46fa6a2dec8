"""Make the offline corpus and tokenizer ready before TorchTitan builds its tokenizer.

TorchTitan's Trainer imports ``[experimental] custom_import`` before it loads the tokenizer from
``[model] hf_assets_path``, so importing this module builds the assets when missing (in
``$TITAN_NVFP4_DATA_DIR`` or ``./assets/pystdlib``) and registers the ``pystdlib`` datasets::

    [experimental]
    custom_import = "titan_nvfp4.data.prepare"
    [model]
    hf_assets_path = "./assets/pystdlib"
    [training]
    dataset = "pystdlib"

As a script it builds on demand and prints the manifest::

    python -m titan_nvfp4.data.prepare [--out DIR] [--force]
    python -m titan_nvfp4.data.prepare --corpus pysources [--out DIR] [--force] [--min-tokens N] [--site-dir DIR ...]

``--corpus pysources`` builds the larger corpus of the installed packages' sources
(``titan_nvfp4.data.pysources``; default dir ``$TITAN_NVFP4_PYSOURCES_DIR`` or ``./assets/pysources``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .assets import ensure_assets, read_manifest
from .manifest import AssetsError, corpus_id, load_manifest
from .registry import register_datasets

logger = logging.getLogger(__name__)


def prepare(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Build (if needed) the assets at ``path`` or the default dir, register the datasets, return the dir."""
    t0 = time.perf_counter()
    data_dir = ensure_assets(path, force=force)
    register_datasets(data_dir)
    logger.info(
        "Offline corpus and tokenizer ready in %s (%.1f s, corpus id %s); datasets 'pystdlib', "
        "'pystdlib_validation' and 'pystdlib_memorize' registered",
        data_dir,
        time.perf_counter() - t0,
        corpus_id(load_manifest(data_dir)),
    )
    return data_dir


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: build the assets and print their manifest as JSON."""
    parser = argparse.ArgumentParser(prog="python -m titan_nvfp4.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=("pystdlib", "pysources"), default="pystdlib",
                        help="which corpus to build (default: pystdlib)")
    parser.add_argument("--out", default=None, help="assets directory (default: $TITAN_NVFP4_DATA_DIR or "
                        "./assets/pystdlib; pysources: $TITAN_NVFP4_PYSOURCES_DIR or ./assets/pysources)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching manifest exists")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="pysources: fail below this many tokens "
                        "(default: $TITAN_NVFP4_PYSOURCES_MIN_TOKENS or 50M)")
    parser.add_argument("--site-dir", action="append", default=None,
                        help="pysources: look for the packages in this directory instead of sys.path (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.corpus != "pysources" and (args.min_tokens is not None or args.site_dir):
        parser.error("--min-tokens and --site-dir apply to --corpus pysources only")
    from .pysources import CorpusTooSmall, ensure_pysources

    try:
        if args.corpus == "pysources":
            data_dir = ensure_pysources(args.out, force=args.force, site_dirs=args.site_dir, min_tokens=args.min_tokens)
        else:
            data_dir = ensure_assets(args.out, force=args.force)
    except (CorpusTooSmall, AssetsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"path": str(data_dir), **(read_manifest(data_dir) or {})}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
else:
    prepare()
