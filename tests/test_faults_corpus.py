"""Fault injection on the offline corpus builders (issue 66, D3, S5, S6 and the corpus O cases).

Each test builds a tiny pysources corpus (two copied standard-library packages posing as torch and numpy,
0.3 s) and breaks it the way a user would: a same-size edit, a truncated copy given as dataset_path, a file
of one's own in the folder before a rebuild, a builder killed with SIGKILL, a broken lock, manifest or
environment variable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from titan_nvfp4.data import assets, registry
from titan_nvfp4.data import pysources as ps
from titan_nvfp4.data.corpus import read_jsonl, stdlib_root
from titan_nvfp4.data.manifest import AssetsError, ContentMismatch, ManifestError

MIN_TOKENS = 1000
VALIDATION_EVERY = 4


def make_site(root: Path, torch_version: str = "2.99.0") -> Path:
    """A fake site-packages holding 'torch' (a copy of email) and 'numpy' (a copy of json)."""
    site = root / "site-packages"
    for name, version, src in (("torch", torch_version, "email"), ("numpy", "1.0", "json")):
        shutil.copytree(stdlib_root() / src, site / name, ignore=shutil.ignore_patterns("__pycache__"))
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{name}\n")
    return site


def upgrade_torch(site: Path) -> None:
    """What `pip install -U torch` does to the recipe: another version in the distribution metadata."""
    (site / "torch-2.99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 3.0\n")


def build(site: Path, out: Path, **kw) -> Path:
    return ps.ensure_pysources(out, site_dirs=[site], validation_every=VALIDATION_EVERY, min_tokens=MIN_TOKENS, **kw)


def recipe(site: Path) -> dict:
    return ps.recipe(site_dirs=[site], validation_every=VALIDATION_EVERY)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_size_edit(path: Path) -> None:
    """Change one byte in the middle of ``path`` (a letter to another letter) and set its mtime back."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    while not chr(data[i]).isalpha():
        i += 1
    data[i] = ord("x") if data[i] != ord("x") else ord("y")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def corpus(tmp_path):
    site = make_site(tmp_path)
    return site, build(site, tmp_path / "assets" / "pysources")


def test_rebuild_after_upgrade_keeps_the_users_files(corpus, caplog):
    """D3: a package upgrade rebuilds the folder in place; the user's files and folders in it stay, the
    memorize split derived from the old train split goes, nothing is left beside it."""
    site, path = corpus
    (path / "notes.txt").write_text("my notes")
    (path / "runs").mkdir()
    (path / "runs" / "loss.csv").write_text("step,loss\n1,9.0\n")
    (path / "memorize_100.jsonl").write_text('{"text": "old"}\n')
    old = json.loads((path / "manifest.json").read_text())
    upgrade_torch(site)
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        assert build(site, path) == path
    assert "Rebuilding" in caplog.text and "package_versions" in caplog.text
    new = json.loads((path / "manifest.json").read_text())
    assert new["recipe"]["package_versions"]["torch"] == "3.0" != old["recipe"]["package_versions"]["torch"]
    assert (path / "notes.txt").read_text() == "my notes"
    assert (path / "runs" / "loss.csv").read_text() == "step,loss\n1,9.0\n"
    assert not (path / "memorize_100.jsonl").exists()
    assert sorted(p.name for p in path.parent.iterdir()) == ["pysources", "pysources.lock"]
    assert assets.stale_reason(path, recipe(site)) is None
    # --force rebuilds the same way.
    assert build(site, path, force=True) == path and (path / "notes.txt").read_text() == "my notes"


def test_each_split_read_logs_its_corpus_and_another_package_changes_it(corpus, tmp_path, caplog):
    """The 386M study's corpus changed under it on 2026-12-06 (a package the GPU machine gained): every split a job
    reads from an assets folder now logs that folder's corpus id, the same for both splits and on every read, another
    when a package is added; a split of a .jsonl file outside any assets folder logs none."""
    from titan_nvfp4.data.manifest import corpus_id, load_manifest

    site, path = corpus
    first = corpus_id(load_manifest(path))
    assert re.fullmatch(r"[0-9a-f]{12}", first)
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        registry.load_split(str(path), "train.jsonl")
        registry.load_split(str(path), "validation.jsonl")
    for split in ("train.jsonl", "validation.jsonl"):
        assert f"Reading {split} of {path}: corpus {first} (" in caplog.text
    grown = tmp_path / "grown"
    shutil.copytree(site, grown)
    shutil.copytree(stdlib_root() / "html", grown / "pydantic")  # a package the list names, now installed
    other = ps.ensure_pysources(tmp_path / "other", site_dirs=[grown], packages=("torch", "numpy", "pydantic"),
                                validation_every=VALIDATION_EVERY, min_tokens=MIN_TOKENS)
    second = corpus_id(load_manifest(other))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        registry.load_split(str(other), "train.jsonl")
    assert second != first and f"Reading train.jsonl of {other}: corpus {second} (" in caplog.text
    loose = tmp_path / "loose.jsonl"
    shutil.copy(path / "train.jsonl", loose)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=registry.__name__):
        registry.load_split(str(loose), "train.jsonl")
    assert "corpus" not in caplog.text
    assert "pydantic" not in ps.PACKAGES  # the study's corpus was built without it


def test_a_pinned_corpus_stops_a_job_on_other_data(corpus, monkeypatch):
    """$TITAN_NVFP4_CORPUS (a comparison spec's corpus): the job reads that corpus or fails before training, naming
    both ids; a malformed pin names the variable."""
    from titan_nvfp4.data.manifest import CORPUS_ENV_VAR, corpus_id, load_manifest

    _, path = corpus
    ident = corpus_id(load_manifest(path))
    monkeypatch.setenv(CORPUS_ENV_VAR, ident)
    assert len(registry.load_split(str(path), "train.jsonl")) > 0
    monkeypatch.setenv(CORPUS_ENV_VAR, "0" * 12)
    with pytest.raises(AssetsError, match=f"corpus {ident} .*but {CORPUS_ENV_VAR} asks for corpus 000000000000"):
        registry.load_split(str(path), "validation.jsonl")
    monkeypatch.setenv(CORPUS_ENV_VAR, "3F9A")
    with pytest.raises(AssetsError, match=f"{CORPUS_ENV_VAR}='3F9A': not a corpus id"):
        registry.load_split(str(path), "train.jsonl")


@pytest.mark.parametrize("name", ["tokenizer.json", "train.jsonl", "tokenizer_config.json"])
def test_same_size_edit_is_caught_and_rebuilt(corpus, name, caplog):
    """S5: reuse checks the manifest's sha256s; a same-size edit with its mtime set back, made after this very
    process checked the folder, is caught, and the next ensure rebuilds the file."""
    site, path = corpus
    good = sha(path / name)
    assert assets.stale_reason(path, recipe(site)) is None  # checked (and the hashes remembered) first
    same_size_edit(path / name)
    why = assets.stale_reason(path, recipe(site))
    assert why is not None and name in why and "sha256" in why and "same size" in why
    assert not ps.manifest_matches(path, recipe(site))
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        build(site, path)
    assert f"Rebuilding {path}" in caplog.text and name in caplog.text
    assert sha(path / name) == good
    assert assets.stale_reason(path, recipe(site)) is None


def test_truncated_or_edited_copy_as_dataset_path_is_refused(corpus, tmp_path, monkeypatch):
    """S6: a dataset_path folder is read only when its files match its manifest's sha256s; a folder without a
    manifest is refused with what to do; a .jsonl named directly is read as it is unless a manifest lists it."""
    import datasets
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    site, path = corpus
    ps.register_pysources(path)
    try:
        docs = read_jsonl(path / "train.jsonl")
        whole = HuggingFaceTextDataset("pysources", str(path), None, seq_len=64)
        assert [r["text"] for r in whole._data] == docs
        copy = tmp_path / "copy"
        shutil.copytree(path, copy)
        with open(copy / "train.jsonl", "r+b") as fh:
            fh.truncate((copy / "train.jsonl").stat().st_size // 2)
        with pytest.raises(ContentMismatch, match=rf"dataset path {copy}: {copy / 'train.jsonl'}: [\d,]+ bytes, "
                                                  r"manifest.json records [\d,]+ \(truncated or edited\)"):
            HuggingFaceTextDataset("pysources", str(copy), None, seq_len=64)
        with pytest.raises(ContentMismatch, match="truncated"):  # the file named directly: checked too
            registry.split_file(copy / "train.jsonl", "train.jsonl")
        shutil.copy(path / "train.jsonl", copy / "train.jsonl")
        same_size_edit(copy / "validation.jsonl")
        with pytest.raises(ContentMismatch, match=r"validation.jsonl: sha256 \w+ is not the \w+ manifest.json"):
            HuggingFaceTextDataset("pysources_validation", str(copy), None, seq_len=64)
        (copy / "manifest.json").unlink()
        with pytest.raises(ManifestError, match=rf"dataset path {copy}: {copy} has no manifest.json, so its files "
                                                r"cannot be checked; .* name a .jsonl file"):
            registry.split_file(copy, "train.jsonl")
        loose = tmp_path / "mine.jsonl"  # a .jsonl outside any assets folder: read as it is
        shutil.copy(copy / "validation.jsonl", loose)
        assert registry.split_file(loose, "train.jsonl") == loose
    finally:
        ps.register_pysources()


def _pause_then_wait(ready: Path) -> None:
    ready.write_text(str(os.getpid()))
    time.sleep(120)


def _build_until(site: Path, out: Path, ready: Path, point: str) -> None:
    """Child of test_sigkill_*: build, and stop for the kill at ``point``."""
    if point == "writing":  # train.jsonl written in the temporary folder, the tokenizer not yet trained
        real = assets.write_file

        def write_file(path, data):
            digest = real(path, data)
            if path.name == "train.jsonl":
                _pause_then_wait(ready)
            return digest

        assets.write_file = write_file
    else:  # "placing": the new train.jsonl moved into the folder, the rest (manifest last) not yet
        real_replace = os.replace

        def replace(src, dst):
            real_replace(src, dst)
            if Path(dst).name == "train.jsonl" and ".tmp-" not in str(Path(dst).parent):
                _pause_then_wait(ready)

        os.replace = replace
    build(site, out)
    os._exit(0)


def _kill_at(site: Path, out: Path, point: str, tmp_path: Path) -> None:
    ready = tmp_path / f"ready_{point}"
    child = multiprocessing.get_context("fork").Process(target=_build_until, args=(site, out, ready, point))
    child.start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.is_alive() and time.monotonic() < deadline, f"the builder never reached {point}"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL


def test_sigkill_mid_build_and_mid_rebuild_leaves_nothing_mixed(tmp_path, caplog):
    """A builder SIGKILLed while writing (first build) leaves no folder and a free lock; one killed between
    moving the new files in (rebuild) leaves a folder no reader accepts, which the next build completes, the
    user's file kept."""
    site = make_site(tmp_path)
    out = tmp_path / "assets" / "pysources"
    _kill_at(site, out, "writing", tmp_path)
    assert not out.exists() and any(p.name.startswith(".pysources.tmp-") for p in out.parent.iterdir())
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger=assets.__name__):
        build(site, out)  # the killed builder's lock is free: no wait; its temporary folder is removed
    assert "Waiting" not in caplog.text and time.perf_counter() - t0 < 30
    assert sorted(p.name for p in out.parent.iterdir()) == ["pysources", "pysources.lock"]
    assert assets.stale_reason(out, recipe(site)) is None
    (out / "notes.txt").write_text("my notes")
    upgrade_torch(site)
    old_tokenizer = sha(out / "tokenizer.json")
    (site / "numpy" / "extra.py").write_text("EXTRA_MARKER = 'new text in the upgrade'\n" * 50)  # new train.jsonl
    _kill_at(site, out, "placing", tmp_path)
    assert sha(out / "tokenizer.json") == old_tokenizer  # the kill came before the rest was moved in
    with pytest.raises(ContentMismatch, match=r"train.jsonl: .* manifest.json records"):
        registry.split_file(out, "train.jsonl")
    assert assets.stale_reason(out, recipe(site)) is not None
    build(site, out)
    assert assets.stale_reason(out, recipe(site)) is None and (out / "notes.txt").read_text() == "my notes"
    assert any("EXTRA_MARKER" in d for d in read_jsonl(out / "train.jsonl") + read_jsonl(out / "validation.jsonl"))
    assert sorted(p.name for p in out.parent.iterdir()) == ["pysources", "pysources.lock"]


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """``python -m titan_nvfp4.data.prepare ARGV`` in this process (runpy: no import-time pystdlib build)."""
    old = sys.argv
    sys.argv = ["prepare", *argv]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_module("titan_nvfp4.data.prepare", run_name="__main__")
    finally:
        sys.argv = old
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, err[-1] if err else ""


def test_lock_faults_get_a_message(tmp_path, capsys):
    """O: a lock path that is a folder or a dangling link, or an unwritable lock file: one line naming it."""
    site = make_site(tmp_path)
    out = tmp_path / "a" / "pysources"
    out.parent.mkdir()
    lock = out.parent / "pysources.lock"
    args = ["--corpus", "pysources", "--out", str(out), "--site-dir", str(site), "--min-tokens", str(MIN_TOKENS)]
    lock.mkdir()
    rc, err = _cli(args, capsys)
    assert rc == 1 and err == f"error: lock file {lock}: cannot be opened for writing (Is a directory); it must " \
                              f"be a writable file (remove it if it is not one)"
    lock.rmdir()
    lock.symlink_to(tmp_path / "gone" / "x.lock")
    with pytest.raises(AssetsError, match=rf"lock file {lock}: cannot be opened .*No such file"):
        build(site, out)
    lock.unlink()
    if os.geteuid() != 0:  # root writes anyway
        lock.write_text("")
        lock.chmod(0o444)
        with pytest.raises(AssetsError, match=rf"lock file {lock}: cannot be opened .*Permission denied"):
            build(site, out)
        lock.chmod(0o644)
    assert not out.exists()


def test_manifest_faults_get_a_message_or_a_rebuild(corpus, tmp_path, capsys, caplog):
    """O: a manifest that is not JSON, not an object or not ours leaves the folder alone with a message; one of
    ours that lacks an entry or has a wrong type is rebuilt (as a dataset_path it is refused by name)."""
    site, path = corpus
    good = (path / "manifest.json").read_text()
    args = ["--corpus", "pysources", "--out", str(path), "--site-dir", str(site), "--min-tokens", str(MIN_TOKENS)]
    for text, why in (("{not json", r"not valid JSON \(Expecting property name"),
                      ("[1, 2]", "holds a JSON list, not an object"),
                      ('{"recipe": 5}', "has no recipe.format_version, so titan_nvfp4.data did not write it")):
        (path / "manifest.json").write_text(text)
        rc, err = _cli(args, capsys)
        assert rc == 1 and err.startswith(f"error: {path / 'manifest.json'}: ") and len(err.splitlines()) == 1, err
        assert re.search(why, err) and "remove the directory or point TITAN_NVFP4_PYSOURCES_DIR" in err
        assert (path / "train.jsonl").is_file()  # left alone
    m = json.loads(good)
    for key, value, why in (("sha256", None, "'sha256' is missing"), ("file_bytes", [1], "'file_bytes' is a list"),
                            ("sha256", {**m["sha256"], "train.jsonl": 7}, "'sha256' has no str entry for train.jsonl")):
        broken = {**m, key: value} if value is not None else {k: v for k, v in m.items() if k != key}
        (path / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(ManifestError, match=rf"dataset path {path}: {path / 'manifest.json'}: {why}"):
            registry.split_file(path, "train.jsonl")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=assets.__name__):
            build(site, path)
        assert why in caplog.text, caplog.text
        assert assets.stale_reason(path, recipe(site)) is None


def test_environment_variable_faults_get_a_message(tmp_path, capsys, monkeypatch):
    """O: bad values of the data-folder and minimum-token variables: one line naming the variable."""
    site = make_site(tmp_path)
    out = ["--out", str(tmp_path / "p"), "--site-dir", str(site)]
    for value in ("abc", "-5", "1e6"):
        monkeypatch.setenv(ps.MIN_TOKENS_ENV_VAR, value)
        rc, err = _cli(["--corpus", "pysources", *out], capsys)
        assert (rc, err) == (1, f"error: {ps.MIN_TOKENS_ENV_VAR}={value!r}: not a whole number of tokens >= 0")
    monkeypatch.setenv(ps.MIN_TOKENS_ENV_VAR, f" {MIN_TOKENS} ")
    assert ps.default_min_tokens() == MIN_TOKENS
    monkeypatch.delenv(ps.MIN_TOKENS_ENV_VAR)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for var, argv in ((assets.ENV_VAR, []), (ps.ENV_VAR, ["--corpus", "pysources", "--site-dir", str(site)])):
        monkeypatch.setenv(var, str(a_file))
        assert _cli(argv, capsys) == (1, f"error: {var}={a_file}: is a file, not an assets directory")
        monkeypatch.setenv(var, str(a_file / "sub"))
        assert _cli(argv, capsys) == (1, f"error: {var}={a_file / 'sub'}: cannot create its parent directory "
                                         f"{a_file} (File exists)")
        monkeypatch.delenv(var)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "site-packages"]


def test_variants_refuse_their_input_as_output_and_write_whole(corpus, tmp_path, capsys):
    """A derived copy never replaces its source, and is written atomically (no partial DST)."""
    from titan_nvfp4.data import variants

    _, path = corpus
    src = tmp_path / "train.jsonl"
    shutil.copy(path / "train.jsonl", src)
    before = src.read_bytes()
    for kind in ("replicate", "rotate", "head"):
        with pytest.raises(SystemExit) as e:
            variants.main([kind, str(src), str(src), "--tokenizer", str(path)])
        assert e.value.code == 2 and f"DST {src} would overwrite the input {src}" in capsys.readouterr().err
    assert src.read_bytes() == before
    variants.main(["rotate", str(src), str(tmp_path / "rot.jsonl")])
    assert sorted(read_jsonl(tmp_path / "rot.jsonl")) == sorted(read_jsonl(src))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
