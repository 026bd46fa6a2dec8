"""Helpers the export_hf tests of both TorchTitan generations share (no TorchTitan import): the tiny word-level
tokenizer the runs are given, and the check of export_hf's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def tokenizer(folder: Path) -> Path:
    """A 256-entry word-level tokenizer with Llama 3's BOS and EOS, as TorchTitan's HuggingFaceTokenizer reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "unk_token": "<unk>"}))
    return folder


def fails(capsys, argv: list[str], out: Path | None = None) -> str:
    """export_hf's one-line error (exit status 2); ``out`` and any temporary folder beside it absent."""
    from titan_nvfp4.tools.export_hf import main as export_main

    with pytest.raises(SystemExit) as e:
        export_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("python -m titan_nvfp4.tools.export_hf: error: "), err
    if out is not None:
        assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), "a half-written folder"
    return err


def job_head(tmp: Path, assets: Path, model: str, flavor: str, converters: list[str]) -> str:
    """The [job] and [model] tables of an export test's TorchTitan 0.2 job file (dump folder ``tmp``, tokenizer
    ``assets``); each test appends the tables of its run."""
    return (f'[job]\ndump_folder = "{tmp}"\ncustom_config_module = "titan_nvfp4.integration.job_config"\n'
            f'[model]\nname = "{model}"\nflavor = "{flavor}"\nhf_assets_path = "{assets}"\n'
            f"converters = {converters!r}\n".replace("'", '"'))
