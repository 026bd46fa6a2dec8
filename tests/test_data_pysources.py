"""The pysources corpus (titan_nvfp4.data.pysources), built from a small fake site-packages tree.

The tree holds packages named like real ones of ``PACKAGES`` (torch, numpy, jinja2, typing_extensions)
whose files are copies of a few standard-library modules (enough text for a 2048-token BPE), plus the
cases the builder must handle: a duplicate, an empty, a non-UTF-8, a NUL-byte and an oversized file, a
``tests`` directory, a ``__pycache__`` directory and a file of another type.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from titan_nvfp4.data import pysources as ps
from titan_nvfp4.data import registry
from titan_nvfp4.data.corpus import read_jsonl, stdlib_root
from titan_nvfp4.data.tokenizer import VOCAB_SIZE
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets import text_datasets
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset, build_text_dataloader

VALIDATION_EVERY = 4  # the fake tree has ~30 files; the real default (100) would hold out none
MIN_TOKENS = 1000


def _copy_modules(src: Path, dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in src.glob("*.py"))
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


def make_site(root: Path) -> Path:
    """A fake site-packages directory; returns it."""
    site = root / "site-packages"
    std = stdlib_root()
    # torch: dist-info with top_level.txt; email's modules as sources, docs, a stub, and the skip cases.
    info = site / "torch-2.99.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n")
    (info / "top_level.txt").write_text("torch\n")
    _copy_modules(std / "email", site / "torch" / "nn")
    (site / "torch" / "__init__.py").write_text("")  # empty: dropped
    (site / "torch" / "README.md").write_text("# Fake torch\n\nTensors and *autograd*, for the tests.\n")
    (site / "torch" / "_C.pyi").write_text("def fake_op(x: int, y: int = ...) -> int: ...\n")
    (site / "torch" / "lib.so").write_bytes(b"\x7fELF not text")  # other file type: not read
    (site / "torch" / "__pycache__").mkdir()
    (site / "torch" / "__pycache__" / "cached.py").write_text("CACHED_MARKER = 1\n")  # skipped directory
    (site / "torch" / "big.py").write_text("BIG_MARKER = 0\n" + "x = 1\n" * 100_000)  # 600 kB > 512 KiB cap
    # numpy: no top_level.txt (the version comes from RECORD); a duplicate file and a tests directory.
    info = site / "numpy-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 1.0\n")
    (info / "RECORD").write_text("numpy/__init__.py,,\nnumpy/core/decoder.py,,\nnumpy-1.0.dist-info/METADATA,,\n")
    _copy_modules(std / "json", site / "numpy" / "core")
    (site / "numpy" / "__init__.py").write_text("from .core import loads, dumps  # a fake numpy\n")
    shutil.copyfile(std / "email" / "charset.py", site / "numpy" / "dup.py")  # same text as torch/nn/charset.py
    (site / "numpy" / "tests").mkdir()
    (site / "numpy" / "tests" / "test_core.py").write_text(
        "import numpy\n\n\ndef test_loads():\n    assert numpy.loads('[1, 2]') == [1, 2]  # TESTS_MARKER\n"
    )
    # jinja2: no distribution metadata (version "unknown"); a latin-1 file and a NUL-byte file.
    _copy_modules(std / "concurrent" / "futures", site / "jinja2")
    (site / "jinja2" / "latin.py").write_bytes("# caf\u00e9 LATIN_MARKER\n".encode("latin-1"))
    (site / "jinja2" / "blob.txt").write_bytes(b"BINARY_MARKER\x00\x01\x02")
    # typing_extensions: a single-module package.
    info = site / "typing_extensions-4.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: typing_extensions\nVersion: 4.0\n")
    (info / "RECORD").write_text("typing_extensions.py,,\n")
    (site / "typing_extensions.py").write_text('"""Fake typing_extensions."""\nTYPING_MARKER = "te"\n')
    return site


def expected_documents(site: Path) -> set[str]:
    """The texts the builder must keep, found independently of it."""
    texts = set()
    for p in site.rglob("*"):
        if (not p.is_file() or p.suffix not in ps.EXTENSIONS or p.name == "big.py"
                or any(part == "__pycache__" or part.endswith(".dist-info") for part in p.parts)):
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip() and "\x00" not in text:
            texts.add(text)
    return texts


def build(site: Path, out: Path, **kw) -> Path:
    kw.setdefault("min_tokens", MIN_TOKENS)
    return ps.ensure_pysources(out, site_dirs=[site], validation_every=VALIDATION_EVERY, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pysources")
    site = make_site(root)
    path = build(site, root / "assets" / "pysources")
    manifest = json.loads((path / "manifest.json").read_text())
    return SimpleNamespace(root=root, site=site, path=path, manifest=manifest,
                           train=read_jsonl(path / "train.jsonl"), validation=read_jsonl(path / "validation.jsonl"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_records_packages_counts_seed_and_tokens(built):
    m = built.manifest
    assert sorted(p.name for p in built.path.iterdir()) == sorted(
        ["manifest.json", "train.jsonl", "validation.jsonl", "tokenizer.json", "tokenizer_config.json"])
    r = m["recipe"]
    assert r["corpus"] == "pysources" and r["packages"] == list(ps.PACKAGES)
    assert r["package_versions"] == {"torch": "2.99.0", "numpy": "1.0", "jinja2": "unknown", "typing_extensions": "4.0"}
    assert r["shuffle_seed"] == ps.SEED and r["validation_every"] == VALIDATION_EVERY and r["vocab_size"] == VOCAB_SIZE
    assert r["max_file_bytes"] == ps.MAX_FILE_BYTES and r["test_dirs"] == "included"
    src = m["source"]
    assert src["site_dirs"] == [str(built.site)]
    assert sorted(src["packages"]) == ["jinja2", "numpy", "torch", "typing_extensions"]
    assert src["missing_packages"] == [p for p in ps.PACKAGES if p not in src["packages"]]
    torch_ = src["packages"]["torch"]
    assert torch_["version"] == "2.99.0" and torch_["distribution"] == "torch"
    assert torch_["path"] == str(built.site / "torch")
    n_email = len(list((stdlib_root() / "email").glob("*.py")))
    assert torch_["files"] == n_email + 3  # nn/*.py, __init__.py, README.md, _C.pyi (not big.py, lib.so, __pycache__)
    assert torch_["documents"] == n_email + 2 and torch_["oversized"] == 1
    assert src["packages"]["numpy"]["test_files"] == 1 and src["test_files_read"] == 1
    assert src["packages"]["numpy"]["documents"] == src["packages"]["numpy"]["files"] - 1  # dup.py
    assert src["packages"]["typing_extensions"]["files"] == 1
    assert src["skipped"] == {"oversized": 1, "undecodable": 1, "binary": 1, "unreadable": 0,
                              "duplicates": 1, "empty": 1}
    assert src["files_read"] == sum(p["files"] for p in src["packages"].values())
    assert src["bytes_read"] == sum(p["bytes"] for p in src["packages"].values())
    # Tokens, bytes, documents, tokenizer sample, hashes.
    assert m["min_tokens"] == MIN_TOKENS
    assert m["tokens_estimate"]["total"] == m["tokens_estimate"]["train"] + m["tokens_estimate"]["validation"]
    assert MIN_TOKENS < m["tokens_estimate"]["total"] < m["text_bytes"]["total"] / 2
    assert m["documents"] == {"train": len(built.train), "validation": len(built.validation),
                              "total": len(built.train) + len(built.validation)}
    assert "shuffled train split" in m["tokenizer_training"]["sample"]
    assert m["tokenizer_training"]["bytes"] == m["text_bytes"]["train"]  # the tiny corpus fits the sample
    assert m["tokenizer"]["vocab_size"] == VOCAB_SIZE
    for name in ("train.jsonl", "validation.jsonl", "tokenizer.json"):
        assert m["sha256"][name] == _sha(built.path / name), name


def test_dedup_skips_and_split_by_file(built):
    docs = built.train + built.validation
    assert len(docs) == len(set(docs))  # the duplicated charset.py is in once
    assert set(docs) == expected_documents(built.site)
    joined = "".join(docs)
    assert "TESTS_MARKER" in joined and "TYPING_MARKER" in joined and "Fake torch" in joined
    for marker in ("BIG_MARKER", "CACHED_MARKER", "LATIN_MARKER", "BINARY_MARKER", "ELF"):
        assert marker not in joined, marker
    # Each document is one whole file, in exactly one split; every VALIDATION_EVERY-th is held out.
    assert built.validation and not set(built.train) & set(built.validation)
    assert len(built.validation) == len(docs) // VALIDATION_EVERY


def test_two_builds_are_identical_and_reused(built, tmp_path):
    other = build(built.site, tmp_path / "again")
    m = json.loads((other / "manifest.json").read_text())
    for key in ("corpus", "train.jsonl", "validation.jsonl", "tokenizer.json"):
        assert m["sha256"][key] == built.manifest["sha256"][key], key
    assert m["recipe"] == built.manifest["recipe"]
    before = (built.path / "manifest.json").read_bytes()
    assert build(built.site, built.path) == built.path  # matching recipe: reused, not rebuilt
    assert (built.path / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in built.path.parent.iterdir()) == ["pysources", "pysources.lock"]
    # A new package version changes the recipe, so the directory would be rebuilt.
    assert ps.recipe(site_dirs=[built.site], validation_every=VALIDATION_EVERY) == built.manifest["recipe"]
    (built.site / "torch-2.99.0.dist-info" / "METADATA").write_text("Name: torch\nVersion: 3.0\n")
    try:
        assert not ps.manifest_matches(built.path, ps.recipe(site_dirs=[built.site], validation_every=VALIDATION_EVERY))
    finally:
        (built.site / "torch-2.99.0.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.99.0\n")


def test_shortfall_fails_with_a_clear_message(built, tmp_path):
    total_bytes = built.manifest["text_bytes"]["total"]
    # Fewer bytes than the minimum: refused before training the tokenizer.
    with pytest.raises(ps.CorpusTooSmall, match=r"at most [\d,]+ tokens .* short of the minimum 1,000,000,000") as e:
        build(built.site, tmp_path / "small", min_tokens=10**9)
    assert "transformers" in str(e.value) and ps.MIN_TOKENS_ENV_VAR in str(e.value)
    # Enough bytes but too few tokens: refused after counting; nothing is left behind either way.
    tokens = built.manifest["tokens_estimate"]["total"]
    short = total_bytes - 1 - tokens
    with pytest.raises(ps.CorpusTooSmall, match=f"about {tokens:,} tokens .* {short:,} tokens short"):
        build(built.site, tmp_path / "small", min_tokens=total_bytes - 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.lock"]


def test_cli_builds_pysources_and_reports_shortfall(built, tmp_path, capsys, monkeypatch):
    from titan_nvfp4.data import prepare

    monkeypatch.setenv(ps.MIN_TOKENS_ENV_VAR, str(10**9))
    assert prepare.main(["--corpus", "pysources", "--out", str(tmp_path / "p"), "--site-dir", str(built.site)]) == 1
    assert "short of the minimum 1,000,000,000" in capsys.readouterr().err
    # --min-tokens overrides the variable; the default split (every 100th file) holds none of ~30 files out.
    assert prepare.main(["--corpus", "pysources", "--out", str(tmp_path / "p"), "--site-dir", str(built.site),
                         "--min-tokens", "1000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(tmp_path / "p") and out["min_tokens"] == 1000
    assert out["recipe"]["validation_every"] == ps.VALIDATION_EVERY == 100
    assert out["documents"]["total"] == built.manifest["documents"]["total"] and out["documents"]["validation"] == 0
    assert out["sha256"]["tokenizer.json"] == _sha(tmp_path / "p" / "tokenizer.json")
    with pytest.raises(SystemExit):
        prepare.main(["--min-tokens", "5"])  # pystdlib has no minimum to set


def test_registered_as_torchtitan_datasets(built, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(built.root / "hf_cache"))
    monkeypatch.setenv(ps.ENV_VAR, str(built.path))
    assert ps.default_data_dir() == built.path
    try:
        ps.register_pysources()
        for name in ("pysources", "pysources_validation"):
            assert text_datasets.DATASETS[name].path == str(built.path)
            assert text_datasets.DATASETS[name].loader.keywords["ensure"] is ps.ensure_pysources
        assert text_datasets.DATASETS["pystdlib"].path != str(built.path)  # pystdlib's entry untouched
        tok = HuggingFaceTokenizer(str(built.path))
        assert tok.get_vocab_size() == VOCAB_SIZE
        jc = JobConfig()
        jc.training.dataset, jc.training.local_batch_size, jc.training.seq_len = "pysources", 2, 64
        inputs, labels = next(iter(build_text_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tok, job_config=jc)))
        assert inputs["input"].shape == labels.shape == (2, 64)
        assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
        stream = tok.encode(built.train[0], add_bos=True, add_eos=True)
        assert inputs["input"][0].tolist() == stream[:64]  # the train split, first document first
        vds = HuggingFaceTextDataset("pysources_validation", None, tok, seq_len=64)
        assert [r["text"] for r in vds._data] == built.validation
    finally:
        monkeypatch.undo()
        ps.register_pysources()  # back to the default directory
    # A missing directory is built on first load by the hook the entry names.
    calls = []
    missing = built.root / "not_built"
    with pytest.raises(FileNotFoundError, match="not a pysources assets directory"):
        registry.split_file(missing, "train.jsonl", ensure=calls.append, corpus_name="pysources")
    assert calls == [missing]


def test_the_carried_wheels_leave_the_gpu_machines_corpus_as_the_386m_study_built_it():
    """On the GPU machine pysources reads the image's packages and the wheels scripts/device_requirements.txt carries.
    The export wheels of 2026-12-05 brought pydantic, which was on the list, and the corpus under the 386M study
    changed (15,084 documents became 15,187, with another tokenizer): a carried wheel that the list names changes every
    loss on it. The ones carried when the study's corpus was built (2026-11-27), and [if-missing] fallbacks of
    packages the image has, are the only ones allowed."""
    study = {"torchao", "torchdata", "torchtitan", "datasets", "dill", "multiprocess",  # carried since 2026-11-23
             "pytest", "pluggy", "packaging"}  # [if-missing]: the image has its own, which the corpus reads
    # distribution -> import name, where the two differ
    imports = {"pillow": "pil", "pyyaml": "yaml", "scikit_learn": "sklearn", "python_dateutil": "dateutil"}

    def norm(name: str) -> str:
        name = name.strip().lower().replace("-", "_").replace(".", "_")
        return imports.get(name, name)

    carried = set()
    for line in (Path(__file__).resolve().parents[1] / "scripts/device_requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            carried.add(norm(line.split("==", 1)[0]))
    listed = {p.lower().lstrip("_") for p in ps.PACKAGES}  # "_pytest" is the pytest wheel's
    assert carried & listed <= study, (f"carried wheels {sorted(carried & listed - study)} are on pysources.PACKAGES: "
                                       "on the GPU machine they would change the corpus of every pysources run")
