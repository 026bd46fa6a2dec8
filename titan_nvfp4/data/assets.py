"""The assets directory: where the offline corpus and tokenizer live, and how it is (re)built.

Layout of the directory (default ``./assets/pystdlib``, or ``$TITAN_NVFP4_DATA_DIR``)::

    train.jsonl, validation.jsonl      {"text": ...} per line, one document per line
    tokenizer.json, tokenizer_config.json
    manifest.json                      recipe, counts, sha256s; written last

A build goes to a temporary sibling directory, under an ``flock`` on a sibling ``<name>.lock`` file, so
that the ranks torchrun starts together build it once and the rest wait and reuse it. A directory is
reused when its manifest records the current recipe and every data file has the size and sha256 the
manifest records (``manifest.check_files``); otherwise it is rebuilt. A first build renames the temporary
directory into place; a rebuild moves the new files in one by one, the manifest last, and touches only the
builder's own files (``DATA_FILES``, the manifest, the ``memorize_<N>.jsonl`` splits derived from the old
train split): anything else in the directory is kept. A kill at any point leaves either a complete
directory or one whose old manifest disagrees with its files, which the next run rebuilds.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .corpus import SHUFFLE_SEED, VALIDATION_EVERY, Corpus, build_corpus, jsonl_bytes
from .manifest import DATA_FILES, MANIFEST, AssetsError, ManifestError, check_files, load_manifest
from .tokenizer import SPECIAL_TOKENS, TRAIN_MAX_BYTES, VOCAB_SIZE, estimate_tokens, save_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

ENV_VAR = "TITAN_NVFP4_DATA_DIR"
DEFAULT_DIR = "./assets/pystdlib"
FORMAT_VERSION = 2  # 2: the manifest records the sha256 of every data file, checked on each reuse
# Written by registry.memorize_split from train.jsonl: stale once the split is rebuilt, so a rebuild removes them.
DERIVED = re.compile(r"memorize_\d+\.jsonl")
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


def stale_reason(path: str | os.PathLike, expected_recipe: dict | None = None) -> str | None:
    """Why the assets directory ``path`` cannot be reused as it is (one line), or None when it can: its manifest
    records ``expected_recipe`` (default: pystdlib's ``recipe()``) and every data file has the size and sha256
    the manifest records."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist"
    try:
        manifest = load_manifest(path)
    except ManifestError as e:
        return str(e)
    expected = recipe() if expected_recipe is None else expected_recipe
    if manifest.get("recipe") != expected:
        return f"{path / MANIFEST}: built with another recipe ({_recipe_change(manifest.get('recipe'), expected)})"
    try:
        check_files(path, manifest)
    except AssetsError as e:
        return str(e)
    return None


def _recipe_change(old: object, new: dict) -> str:
    if not isinstance(old, dict):
        return "none recorded"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    said = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" if len(repr(old.get(k)) + repr(new.get(k))) < 60 else k
            for k in keys[:3]]
    return ", ".join(said) + (", ..." if len(keys) > 3 else "")


def manifest_matches(path: str | os.PathLike, expected_recipe: dict | None = None) -> bool:
    """Whether ``path`` holds complete assets built with ``expected_recipe`` (default: pystdlib's ``recipe()``),
    checked by content (``stale_reason``)."""
    return stale_reason(path, expected_recipe) is None


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
    for name in ("tokenizer.json", "tokenizer_config.json"):
        sha[name] = hashlib.sha256((out / name).read_bytes()).hexdigest()
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


class ForeignFolderError(AssetsError, FileExistsError):
    """The assets directory holds files but no manifest: it may be user data, so nothing is written into it."""


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed; it then holds the owner's pid), logging
    whom we wait for. A lock left by a killed process is free (the kernel drops its flock)."""
    try:
        fh = open(lock_path, "a+")
    except OSError as e:
        raise AssetsError(f"lock file {lock_path}: cannot be opened for writing ({e.strerror}); it must be a "
                          f"writable file (remove it if it is not one)") from None
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "unknown"
            logger.info("Waiting for another process (pid %s, holding %s) to finish building %s",
                        owner, lock_path, lock_path.with_suffix(""))
            t0 = time.perf_counter()
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("Lock %s acquired after %.1f s", lock_path, time.perf_counter() - t0)
        except OSError as e:
            raise AssetsError(f"lock file {lock_path}: cannot be locked ({e.strerror}); its filesystem must "
                              f"support flock") from None
        try:
            fh.truncate(0)  # "a+": the write goes to the (new) end, the start
            fh.write(f"{os.getpid()}\n")
            fh.flush()
        except OSError:  # the pid is only for the waiters' log line
            pass
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(parent: Path, name: str) -> None:
    """Delete temporary directories a crashed build left behind (call only while holding the lock)."""
    for stale in parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in parent.glob(f".{name}.old-*"):  # left by builds before in-place rebuilds
        shutil.rmtree(stale, ignore_errors=True)


def _refuse_unless_ours(target: Path, env_var: str) -> None:
    """Raise unless the builder may write into ``target``: absent, empty, or holding a manifest this module wrote."""
    if not target.exists() or not any(target.iterdir()):
        return
    try:
        manifest = load_manifest(target)
    except ManifestError as e:
        if not (target / MANIFEST).exists():
            # Never write into a directory this module did not make (no manifest): it may be user data.
            raise ForeignFolderError(
                f"{target} exists, is not empty and has no {MANIFEST}; refusing to overwrite it. "
                f"Remove it or point {env_var} elsewhere."
            ) from None
        raise ManifestError(f"{e}: cannot tell whether titan_nvfp4.data built {target}, so nothing in it is "
                            f"replaced; remove the directory or point {env_var} elsewhere") from None
    if not isinstance(manifest.get("recipe"), dict) or "format_version" not in manifest["recipe"]:
        raise ManifestError(f"{target / MANIFEST}: has no recipe.format_version, so titan_nvfp4.data did not write "
                            f"it and nothing in {target} is replaced; remove the directory or point {env_var} "
                            f"elsewhere")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _place(tmp: Path, target: Path) -> None:
    """Move the files built in ``tmp`` into ``target``: the whole directory by one rename when ``target`` is
    absent or empty; else file by file (the derived memorize splits removed first, the manifest last), so that
    the user's files in ``target`` stay and a kill in between leaves the old manifest, whose sha256s then
    disagree with the new files (a rebuild) or agree because the bytes are the same."""
    if not target.exists() or (not target.is_symlink() and not any(target.iterdir())):
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.replace(tmp, target)  # over an empty directory too
        return
    for f in target.iterdir():
        if DERIVED.fullmatch(f.name) and f.is_file():
            f.unlink()
    for name in (*DATA_FILES, MANIFEST):
        os.replace(tmp / name, target / name)
    _fsync_dir(target)


def ensure_built(
    target: Path,
    build: Callable[[Path], dict],
    expected_recipe: dict,
    force: bool = False,
    source: str = "Python stdlib + pydoc topics",
    env_var: str = ENV_VAR,
    from_env: bool = False,
) -> Path:
    """Return the assets directory ``target``, first building it with ``build(tmp_dir)`` unless it holds
    complete assets of ``expected_recipe`` (``stale_reason``); safe for concurrent ranks (one builds under the
    lock, the others wait and reuse).

    ``source`` names the corpus in the log; ``env_var`` is the variable the error messages suggest, and
    ``from_env`` says that it named ``target``. Faults of the directory, its lock or its manifest raise an
    ``AssetsError`` with a one-line message.
    """
    target = Path(os.path.abspath(target))
    named = f"{env_var}={target}" if from_env else str(target)
    if target.exists() and not target.is_dir():
        raise AssetsError(f"{named}: is a file, not an assets directory")
    why = stale_reason(target, expected_recipe)
    if not force and why is None:
        logger.debug("Reusing offline assets in %s", target)
        return target
    parent, name = target.parent, target.name
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetsError(f"{named}: cannot create its parent directory {parent} ({e.strerror})") from None
    with _locked(parent / f"{name}.lock"):
        why = stale_reason(target, expected_recipe)
        if not force and why is None:  # another rank built it while we waited
            logger.info("Reusing offline assets in %s (built by another process)", target)
            return target
        _refuse_unless_ours(target, env_var)
        _remove_leftovers(parent, name)
        if (target / MANIFEST).exists():
            logger.warning("Rebuilding %s: %s", target, why or "forced")
        logger.info("Building offline corpus and tokenizer in %s (%s)", target, source)
        t0 = time.perf_counter()
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
        except OSError as e:
            raise AssetsError(f"{named}: cannot write in {parent} ({e.strerror})") from None
        try:
            manifest = build(tmp)
            try:
                _place(tmp, target)
            except OSError as e:
                raise AssetsError(f"{named}: cannot move the built files in ({e}); the previous files, if any, "
                                  f"are rebuilt next time") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
    from_env = path is None and bool(os.environ.get(ENV_VAR))
    return ensure_built(target, build_assets, recipe(), force=force, from_env=from_env)
