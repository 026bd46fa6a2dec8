"""``pysources``: a larger offline corpus made of the installed packages' Python sources and docs.

The ``pystdlib`` corpus (about 10M tokens) is too small for a convergence run of 100M+ tokens. The GPU
machines carry large pure-Python packages (torch, transformers, numpy, pandas, sympy, ...) that need no
network, so this corpus takes, for each package of the fixed list ``PACKAGES`` found on ``sys.path``
(missing ones are skipped and listed in the manifest), every ``.py`` / ``.pyi`` source and ``.md`` /
``.rst`` / ``.txt`` doc file inside the package directory, in sorted order:

- files over ``MAX_FILE_BYTES`` (generated stubs, data tables), files that are not UTF-8 and files with
  NUL bytes are skipped and counted;
- test directories are kept (their files counted as ``test_files``): they are Python written by the
  same authors, ``pystdlib`` keeps CPython's ``Lib/test`` likewise, and without them the corpus loses a
  quarter of its text; the size cap bounds their fixture data and exact copies are dropped anyway;
- exact duplicates (sha256 of the text) and empty files are dropped, the first copy in list order kept;
- the documents are shuffled with a fixed seed and every ``VALIDATION_EVERY``-th one held out, so the
  split is by file and no text is in both splits.

The byte-level BPE tokenizer (``VOCAB_SIZE`` = 2048, as pystdlib's) is trained, as pystdlib's, on the
leading shuffled train documents, here up to ``TOKENIZER_SAMPLE_BYTES``: a fixed pseudo-random sample,
since training on the whole corpus would take many minutes. The build fails with ``CorpusTooSmall``
when the estimated token count is below ``min_tokens`` (``MIN_TOKENS`` = 50M, enough for 100M training
tokens in two epochs; ``$TITAN_NVFP4_PYSOURCES_MIN_TOKENS`` or ``--min-tokens`` change it).

Built on first use in ``$TITAN_NVFP4_PYSOURCES_DIR`` or ``./assets/pysources`` with the same layout,
manifest (checked by sha256 on reuse), lock and kill-safe (re)build as pystdlib (``assets.ensure_built``); ahead of a run::

    python -m titan_nvfp4.data.prepare --corpus pysources

and in a job file (the import builds when missing and registers the datasets before the tokenizer loads)::

    [experimental]
    custom_import = "titan_nvfp4.data.prepare_pysources"
    [model]
    hf_assets_path = "./assets/pysources"
    [training]
    dataset = "pysources"          # validation: "pysources_validation"
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import sysconfig
import time
from importlib.metadata import PathDistribution
from pathlib import Path
from typing import Iterator, Sequence

from .assets import FORMAT_VERSION, ensure_built, manifest_matches, write_assets  # noqa: F401 (ps.manifest_matches)
from .manifest import AssetsError, corpus_id, load_manifest
from .corpus import SHUFFLE_SEED, Corpus, collect_unique, split_documents
from .registry import register_splits
from .tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, training_sample

logger = logging.getLogger(__name__)

NAME = "pysources"
TRAIN_NAME = "pysources"
VALIDATION_NAME = "pysources_validation"
ENV_VAR = "TITAN_NVFP4_PYSOURCES_DIR"
MIN_TOKENS_ENV_VAR = "TITAN_NVFP4_PYSOURCES_MIN_TOKENS"
DEFAULT_DIR = "./assets/pysources"

# Import names, in the order their files are read (the first copy of a duplicated file is kept). Adding or removing
# one changes the corpus, its tokenizer and every loss on it. pydantic, listed here until 2026-12-06, is not: the GPU
# image lacks it, and the export wheels of 2026-12-05 (scripts/device_requirements.txt) brought it, which changed the
# corpus under the 386M study (built from the 52 packages here, without it).
PACKAGES = (
    "torch", "torchgen", "functorch", "torchvision", "torchaudio", "torchao", "torchdata", "torchtitan",
    "triton", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "huggingface_hub",
    "datasets", "pyarrow", "numpy", "scipy", "pandas", "sklearn", "sympy", "mpmath", "networkx",
    "matplotlib", "mpl_toolkits", "PIL", "jinja2", "markupsafe", "yaml", "pygments", "setuptools", "pip",
    "_pytest", "pluggy", "fsspec", "filelock", "requests", "urllib3", "packaging", "tqdm",
    "dill", "multiprocess", "aiohttp", "tensorboard", "fontTools", "einops", "click", "werkzeug",
    "pyparsing", "dateutil", "typing_extensions",
)
EXTENSIONS = (".py", ".pyi", ".md", ".rst", ".txt")
TEST_DIR_NAMES = ("test", "tests")
MAX_FILE_BYTES = 512 * 1024
SEED = SHUFFLE_SEED
VALIDATION_EVERY = 100
TOKENIZER_SAMPLE_BYTES = 16_000_000
MIN_TOKENS = 50_000_000
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


class CorpusTooSmall(RuntimeError):
    """The installed packages give fewer tokens than the configured minimum."""


def default_data_dir() -> Path:
    """Absolute assets directory: ``$TITAN_NVFP4_PYSOURCES_DIR`` if set, else ``./assets/pysources``."""
    return Path(os.path.abspath(os.path.expanduser(os.environ.get(ENV_VAR) or DEFAULT_DIR)))


def default_min_tokens() -> int:
    """``$TITAN_NVFP4_PYSOURCES_MIN_TOKENS`` if set, else ``MIN_TOKENS``; an AssetsError naming the variable
    when it is not a whole number >= 0."""
    value = os.environ.get(MIN_TOKENS_ENV_VAR, "").strip()
    if not value:
        return MIN_TOKENS
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise AssetsError(f"{MIN_TOKENS_ENV_VAR}={value!r}: not a whole number of tokens >= 0")
    return tokens


def default_site_dirs() -> list[Path]:
    """The ``sys.path`` directories packages are imported from, in order (not the standard library)."""
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    dirs, seen = [], set()
    for entry in sys.path:
        if not entry:
            continue
        real = os.path.realpath(entry)
        parts = set(Path(real).parts)
        in_stdlib = any(real == s or real.startswith(s + os.sep) for s in stdlib)
        if real in seen or not os.path.isdir(real) or (in_stdlib and not parts & {"site-packages", "dist-packages"}):
            continue
        seen.add(real)
        dirs.append(Path(real))
    return dirs


def _distributions(site_dir: Path) -> dict[str, tuple[str, str]]:
    """``{top-level import name: (distribution name, version)}`` from the ``*.dist-info`` and
    ``*.egg-info`` directories in ``site_dir``."""
    found: dict[str, tuple[str, str]] = {}
    for info in sorted(list(site_dir.glob("*.dist-info")) + list(site_dir.glob("*.egg-info"))):
        if not info.is_dir():
            continue
        dist = PathDistribution(info)
        try:
            name, version = dist.metadata["Name"], dist.version
        except Exception:  # broken metadata: the package is still read, its version is "unknown"
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        if not top:
            top = sorted({Path(str(f)).parts[0].removesuffix(".py") for f in (dist.files or []) if Path(str(f)).parts})
        for t in top:
            found.setdefault(t, (str(name), str(version)))
    return found


def locate_packages(
    packages: Sequence[str] = PACKAGES, site_dirs: Sequence[str | os.PathLike] | None = None
) -> tuple[dict, list[str]]:
    """Find each package (a directory ``<name>/`` or a module ``<name>.py``) in the first site dir holding it.

    Returns ``({name: {"path", "distribution", "version"}}, missing_names)``; versions come from the
    distribution metadata beside the package ("unknown" if none names it). Nothing is imported.
    """
    dirs = [Path(d) for d in (site_dirs if site_dirs is not None else default_site_dirs())]
    dists: dict[Path, dict] = {}
    found, missing = {}, []
    for name in packages:
        for d in dirs:
            for cand in (d / name, d / f"{name}.py"):
                if cand.is_dir() or (cand.suffix == ".py" and cand.is_file()):
                    break
            else:
                continue
            if d not in dists:
                dists[d] = _distributions(d)
            dist, version = dists[d].get(name, ("unknown", "unknown"))
            found[name] = {"path": str(cand), "distribution": dist, "version": version}
            break
        else:
            missing.append(name)
    return found, missing


def iter_package_files(
    path: str | os.PathLike, stats: dict, max_file_bytes: int = MAX_FILE_BYTES
) -> Iterator[tuple[str, str]]:
    """Yield ``(relative_path, text)`` for the kept files of one package, sorted; count in ``stats``.

    ``stats`` gets ``files``/``bytes``/``test_files`` (files yielded) and the skipped counts
    ``oversized``, ``undecodable``, ``binary`` (NUL bytes) and ``unreadable``.
    """
    root = Path(path)
    for key in ("files", "bytes", "test_files", "oversized", "undecodable", "binary", "unreadable"):
        stats.setdefault(key, 0)
    if root.is_file():
        walk: Iterator = iter([(str(root.parent), [], [root.name])])
        base = root.parent
    else:
        walk, base = os.walk(root), root.parent
    for dirpath, dirnames, filenames in walk:
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(EXTENSIONS):
                continue
            full = os.path.join(dirpath, name)
            try:
                if os.path.getsize(full) > max_file_bytes:
                    stats["oversized"] += 1
                    continue
                with open(full, "rb") as fh:
                    raw = fh.read()
            except OSError:  # dangling link or unreadable file
                stats["unreadable"] += 1
                continue
            if b"\0" in raw:
                stats["binary"] += 1
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats["undecodable"] += 1
                continue
            rel = os.path.relpath(full, base).replace(os.sep, "/")
            stats["files"] += 1
            stats["bytes"] += len(raw)
            if set(rel.split("/")[:-1]) & set(TEST_DIR_NAMES):
                stats["test_files"] += 1
            yield rel, text


def recipe(
    packages: Sequence[str] = PACKAGES,
    site_dirs: Sequence[str | os.PathLike] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
    validation_every: int = VALIDATION_EVERY,
) -> dict:
    """Everything the assets depend on, including the versions of the packages found; a directory built
    with a different recipe (another package version, say) is rebuilt."""
    found, _ = locate_packages(packages, site_dirs)
    return {
        "format_version": FORMAT_VERSION,
        "corpus": NAME,
        "python_implementation": platform.python_implementation(),
        "python_version": platform.python_version(),
        "packages": list(packages),
        "package_versions": {name: found[name]["version"] for name in found},
        "extensions": list(EXTENSIONS),
        "test_dirs": "included",
        "max_file_bytes": max_file_bytes,
        "shuffle_seed": SEED,
        "validation_every": validation_every,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "tokenizer_train_max_bytes": tokenizer_sample_bytes,
    }


def build_pysources_corpus(
    packages: Sequence[str] = PACKAGES,
    site_dirs: Sequence[str | os.PathLike] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    validation_every: int = VALIDATION_EVERY,
) -> Corpus:
    """Collect, dedupe, shuffle and split the packages' files; a pure function of the installed files."""
    found, missing = locate_packages(packages, site_dirs)
    per_package: dict[str, dict] = {name: {} for name in found}
    counts: dict = {"duplicates": 0, "empty": 0}
    sources = [(name, iter_package_files(found[name]["path"], per_package[name], max_file_bytes)) for name in found]
    docs = collect_unique(sources, counts)
    train, validation = split_documents(docs, SEED, validation_every)
    for name in found:
        per_package[name] = {**found[name], **per_package[name], "documents": counts.get(name, 0)}
    skipped = {k: sum(p[k] for p in per_package.values()) for k in ("oversized", "undecodable", "binary", "unreadable")}
    skipped.update(duplicates=counts["duplicates"], empty=counts["empty"])
    stats = {
        "site_dirs": [str(d) for d in (site_dirs if site_dirs is not None else default_site_dirs())],
        "packages": per_package,
        "missing_packages": missing,
        "files_read": sum(p["files"] for p in per_package.values()),
        "bytes_read": sum(p["bytes"] for p in per_package.values()),
        "test_files_read": sum(p["test_files"] for p in per_package.values()),
        "skipped": skipped,
    }
    return Corpus(train=train, validation=validation, stats=stats)


def _shortfall(tokens: int, min_tokens: int, corpus: Corpus, bound: bool = False) -> CorpusTooSmall:
    s = corpus.stats
    what = f"at most {tokens:,} tokens (one per byte)" if bound else f"about {tokens:,} tokens"
    return CorpusTooSmall(
        f"pysources corpus too small: {what} from {s['files_read']:,} files ({s['bytes_read'] / 1e6:.1f} MB) of "
        f"{len(s['packages'])} packages, {min_tokens - tokens:,} tokens short of the minimum {min_tokens:,}. "
        f"Missing packages: {', '.join(s['missing_packages']) or 'none'}. Install more of "
        f"titan_nvfp4.data.pysources.PACKAGES, or lower the minimum ({MIN_TOKENS_ENV_VAR} or --min-tokens)."
    )


def build_pysources_assets(
    out_dir: str | os.PathLike,
    packages: Sequence[str] = PACKAGES,
    site_dirs: Sequence[str | os.PathLike] | None = None,
    min_tokens: int | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
    validation_every: int = VALIDATION_EVERY,
    recipe_: dict | None = None,
) -> dict:
    """Build corpus, tokenizer and manifest into ``out_dir``; return the manifest.

    Raises ``CorpusTooSmall`` (before training the tokenizer when the text has fewer bytes than
    ``min_tokens``) if the token estimate is below ``min_tokens``. Not locked: see ``ensure_pysources``.
    """
    min_tokens = default_min_tokens() if min_tokens is None else min_tokens
    recipe_ = recipe_ or recipe(packages, site_dirs, max_file_bytes, tokenizer_sample_bytes, validation_every)
    t0 = time.perf_counter()
    corpus = build_pysources_corpus(packages, site_dirs, max_file_bytes, validation_every)
    text_bytes = sum(len(t.encode("utf-8")) for t in corpus.train + corpus.validation)
    if text_bytes < min_tokens:  # byte-level BPE never makes more tokens than bytes
        raise _shortfall(text_bytes, min_tokens, corpus, bound=True)
    sample = training_sample(corpus.train, tokenizer_sample_bytes)
    extra = {
        "min_tokens": min_tokens,
        "tokenizer_training": {
            "sample": (
                f"the leading documents of the shuffled train split up to {tokenizer_sample_bytes} bytes of "
                f"UTF-8 (fixed by the shuffle seed), not the whole split"
            ),
            "documents": len(sample),
            "bytes": sum(len(t.encode("utf-8")) for t in sample),
        },
    }
    del sample
    manifest = write_assets(out_dir, corpus, recipe_, tokenizer_max_bytes=tokenizer_sample_bytes, extra=extra, t0=t0)
    if manifest["tokens_estimate"]["total"] < min_tokens:
        raise _shortfall(manifest["tokens_estimate"]["total"], min_tokens, corpus)
    return manifest


def ensure_pysources(
    path: str | os.PathLike | None = None,
    force: bool = False,
    packages: Sequence[str] = PACKAGES,
    site_dirs: Sequence[str | os.PathLike] | None = None,
    min_tokens: int | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
    validation_every: int = VALIDATION_EVERY,
) -> Path:
    """Return the pysources assets directory, building it first if missing or stale (lock shared with
    concurrent ranks, as ``assets.ensure_assets``)."""
    target = Path(os.path.abspath(path)) if path is not None else default_data_dir()
    min_tokens = default_min_tokens() if min_tokens is None else min_tokens  # a bad variable fails before the lock
    recipe_ = recipe(packages, site_dirs, max_file_bytes, tokenizer_sample_bytes, validation_every)
    build = functools.partial(
        build_pysources_assets, packages=packages, site_dirs=site_dirs, min_tokens=min_tokens,
        max_file_bytes=max_file_bytes, tokenizer_sample_bytes=tokenizer_sample_bytes,
        validation_every=validation_every, recipe_=recipe_,
    )
    return ensure_built(
        target, build, recipe_, force=force, env_var=ENV_VAR, from_env=path is None and bool(os.environ.get(ENV_VAR)),
        source=f"pysources: {len(recipe_['package_versions'])} of {len(packages)} packages",
    )


def register_pysources(data_dir: str | os.PathLike | None = None) -> None:
    """Add (or refresh) ``pysources`` / ``pysources_validation`` in TorchTitan's dataset table; idempotent.

    A dataset path that does not exist yet is built on first load by ``ensure_pysources``."""
    path = Path(os.path.abspath(data_dir)) if data_dir is not None else default_data_dir()
    register_splits(
        {TRAIN_NAME: "train.jsonl", VALIDATION_NAME: "validation.jsonl"}, path,
        ensure=ensure_pysources, corpus_name=NAME,
    )


def prepare_pysources(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Build (if needed) the pysources assets, register their datasets, return the directory."""
    t0 = time.perf_counter()
    data_dir = ensure_pysources(path, force=force)
    register_pysources(data_dir)
    logger.info("pysources corpus and tokenizer ready in %s (%.1f s, corpus id %s); datasets %r and %r registered",
                data_dir, time.perf_counter() - t0, corpus_id(load_manifest(data_dir)), TRAIN_NAME, VALIDATION_NAME)
    return data_dir
