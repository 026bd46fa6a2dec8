"""The assets directory: where the offline corpus and tokenizer live, and how it is (re)built.

Layout of the directory (default ``./assets/pystdlib``, or ``$TITAN_NVFP4_DATA_DIR``)::

    train.jsonl, validation.jsonl      {"text": ...} per line, one document per line
    tokenizer.json, tokenizer_config.json
    manifest.json                      recipe, counts, sha256s; written last

A build goes to a temporary sibling directory that is renamed into place, under an ``flock`` on a
sibling ``<name>.lock`` file, so that the ranks torchrun starts together build it once and the rest
wait and reuse it; a directory whose manifest matches the current recipe is never rebuilt.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .corpus import SHUFFLE_SEED, VALIDATION_EVERY, Corpus, build_corpus, jsonl_bytes
from .tokenizer import SPECIAL_TOKENS, TRAIN_MAX_BYTES, VOCAB_SIZE, estimate_tokens, save_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

ENV_VAR = "TITAN_NVFP4_DATA_DIR"
DEFAULT_DIR = "./assets/pystdlib"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_FILES = ("train.jsonl", "validation.jsonl", "tokenizer.json", "tokenizer_config.json")
MIN_TOKENS = 10_000_000  # the corpus is meant to be at least this large; smaller only warns


def default_data_dir() -> Path:
    """Absolute assets directory: ``$TITAN_NVFP4_DATA_DIR`` if set, else ``./assets/pystdlib`` of the cwd."""
    return Path(os.path.abspath(os.path.expanduser(os.environ.get(ENV_VAR) or DEFAULT_DIR)))


def recipe() -> dict:
    """Everything the assets depend on; a directory built with a different recipe is rebuilt."""
    return {
        "format_version": FORMAT_VERSION,
        "python_implementation": platform.python_implementation(),
        "python_version": platform.python_version(),
        "shuffle_seed": SHUFFLE_SEED,
        "validation_every": VALIDATION_EVERY,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "tokenizer_train_max_bytes": TRAIN_MAX_BYTES,
    }


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The parsed ``manifest.json`` of an assets directory, or None if absent or unreadable."""
    try:
        with open(Path(path) / MANIFEST, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def manifest_matches(path: str | os.PathLike, expected_recipe: dict | None = None) -> bool:
    """Whether ``path`` holds complete assets built with ``expected_recipe`` (default: pystdlib's
    ``recipe()``); cheap: file sizes are compared, nothing is hashed."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("recipe") != (recipe() if expected_recipe is None else expected_recipe):
        return False
    sizes = manifest.get("file_bytes", {})
    for name in DATA_FILES:
        f = Path(path) / name
        if name not in sizes or not f.is_file() or f.stat().st_size != sizes[name]:
            return False
    return True


def write_file(path: Path, data: bytes) -> str:
    """Write ``data`` durably to ``path`` and return its sha256."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return hashlib.sha256(data).hexdigest()


def write_assets(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    recipe_: dict,
    tokenizer_max_bytes: int = TRAIN_MAX_BYTES,
    extra: dict | None = None,
    t0: float | None = None,
) -> dict:
    """Write ``corpus`` (both splits), a tokenizer trained on its train split and the manifest into
    ``out_dir``; return the manifest.

    The tokenizer learns from the leading train documents up to ``tokenizer_max_bytes`` (the split is
    shuffled, so that is a fixed pseudo-random sample). ``extra`` adds top-level manifest keys; ``t0``
    (a ``time.perf_counter()`` value) is when collecting the corpus began, for the build timings.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter() if t0 is None else t0
    train_bytes, val_bytes = jsonl_bytes(corpus.train), jsonl_bytes(corpus.validation)
    sha = {
        "train.jsonl": write_file(out / "train.jsonl", train_bytes),
        "validation.jsonl": write_file(out / "validation.jsonl", val_bytes),
        "corpus": hashlib.sha256(train_bytes + val_bytes).hexdigest(),
    }
    del train_bytes, val_bytes
    t1 = time.perf_counter()
    tok = train_tokenizer(corpus.train, max_bytes=tokenizer_max_bytes)  # validation stays unseen
    save_tokenizer(tok, out)
    sha["tokenizer.json"] = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    t2 = time.perf_counter()
    train_est, sample_tokens, sample_bytes = estimate_tokens(tok, corpus.train)
    val_est, _, _ = estimate_tokens(tok, corpus.validation, every=1)
    t3 = time.perf_counter()
    text_bytes = {
        "train": sum(len(t.encode("utf-8")) for t in corpus.train),
        "validation": sum(len(t.encode("utf-8")) for t in corpus.validation),
    }
    text_bytes["total"] = text_bytes["train"] + text_bytes["validation"]
    manifest = {
        "recipe": recipe_,
        "source": {k: corpus.stats[k] for k in sorted(corpus.stats)},
        "documents": {
            "train": len(corpus.train),
            "validation": len(corpus.validation),
            "total": len(corpus.train) + len(corpus.validation),
        },
        "text_bytes": text_bytes,
        "file_bytes": {name: (out / name).stat().st_size for name in DATA_FILES},
        "sha256": sha,
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "bos_token": SPECIAL_TOKENS[0],
            "bos_id": tok.token_to_id(SPECIAL_TOKENS[0]),
            "eos_token": SPECIAL_TOKENS[1],
            "eos_id": tok.token_to_id(SPECIAL_TOKENS[1]),
        },
        "tokens_estimate": {
            "total": train_est + val_est,
            "train": train_est,
            "validation": val_est,
            "method": (
                f"validation counted exactly; train extrapolated by UTF-8 bytes from every 16th "
                f"document ({sample_tokens} tokens in {sample_bytes} bytes); BOS/EOS not counted"
            ),
        },
        "build": {
            "seconds": round(t3 - t0, 2),
            "corpus_seconds": round(t1 - t0, 2),
            "tokenizer_seconds": round(t2 - t1, 2),
            "count_seconds": round(t3 - t2, 2),
            "pid": os.getpid(),
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    manifest.update(extra or {})
    # The manifest goes last: its presence marks a complete directory.
    write_file(out / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return manifest


def build_assets(out_dir: str | os.PathLike) -> dict:
    """Build the pystdlib corpus, tokenizer and manifest into the directory ``out_dir``; return the manifest.

    Not atomic and not locked by itself: ``ensure_assets`` calls it on a private temporary directory.
    """
    t0 = time.perf_counter()
    manifest = write_assets(out_dir, build_corpus(), recipe(), t0=t0)
    if manifest["tokens_estimate"]["total"] < MIN_TOKENS:
        logger.warning(
            "pystdlib corpus has only ~%d tokens (< %d) on Python %s",
            manifest["tokens_estimate"]["total"], MIN_TOKENS, platform.python_version(),
        )
    return manifest


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed), logging if we have to wait."""
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process to finish building %s", lock_path.with_suffix(""))
            t0 = time.perf_counter()
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("Lock %s acquired after %.1f s", lock_path, time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(parent: Path, name: str) -> None:
    """Delete temporary directories a crashed build left behind (call only while holding the lock)."""
    for stale in parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in parent.glob(f".{name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_built(
    target: Path,
    build: Callable[[Path], dict],
    matches: Callable[[Path], bool],
    force: bool = False,
    source: str = "Python stdlib + pydoc topics",
    env_var: str = ENV_VAR,
) -> Path:
    """Return the assets directory ``target``, first building it with ``build(tmp_dir)`` unless
    ``matches(target)``; safe for concurrent ranks (one builds under the lock, the others wait and reuse).

    ``source`` names the corpus in the log; ``env_var`` is the variable the error message suggests.
    """
    target = Path(os.path.abspath(target))
    if not force and matches(target):
        logger.debug("Reusing offline assets in %s", target)
        return target
    parent, name = target.parent, target.name
    parent.mkdir(parents=True, exist_ok=True)
    with _locked(parent / f"{name}.lock"):
        if not force and matches(target):  # another rank built it while we waited
            logger.info("Reusing offline assets in %s (built by another process)", target)
            return target
        if target.exists() and any(target.iterdir()) and read_manifest(target) is None:
            # Never replace a directory this module did not make (no manifest): it may be user data.
            raise FileExistsError(
                f"{target} exists, is not empty and has no {MANIFEST}; refusing to overwrite it. "
                f"Remove it or point {env_var} elsewhere."
            )
        _remove_leftovers(parent, name)
        logger.info("Building offline corpus and tokenizer in %s (%s)", target, source)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
        try:
            manifest = build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            if target.exists():
                old = parent / f".{name}.old-{os.getpid()}"
                os.rename(target, old)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info(
            "Built %s in %.1f s: %d documents, %.1f MB of text, ~%.2fM tokens, vocab %d",
            target,
            time.perf_counter() - t0,
            manifest["documents"]["total"],
            manifest["text_bytes"]["total"] / 1e6,
            manifest["tokens_estimate"]["total"] / 1e6,
            manifest["tokenizer"]["vocab_size"],
        )
    return target


def ensure_assets(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Return the pystdlib assets directory, building it first if missing or stale; safe for concurrent ranks."""
    target = Path(os.path.abspath(path)) if path is not None else default_data_dir()
    return ensure_built(target, build_assets, manifest_matches, force=force)
