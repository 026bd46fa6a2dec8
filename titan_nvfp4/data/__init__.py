"""Offline default training data: a corpus of CPython stdlib sources + pydoc topics and its own tokenizer.

Importing this package registers TorchTitan datasets ``pystdlib`` and ``pystdlib_validation``
(pointing at ``$TITAN_NVFP4_DATA_DIR`` or ``./assets/pystdlib``). Import
``titan_nvfp4.data.prepare`` (TorchTitan's ``[experimental] custom_import``) to also build the
assets; modules: ``corpus`` (text), ``tokenizer`` (BPE), ``assets`` (build/lock/manifest),
``registry`` (TorchTitan datasets), ``prepare`` (import hook and CLI).
"""

from .assets import ENV_VAR, default_data_dir, ensure_assets, read_manifest
from .corpus import Corpus, build_corpus, corpus_sha256
from .registry import TRAIN_NAME, VALIDATION_NAME, register_datasets
from .tokenizer import BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE, train_tokenizer

try:
    register_datasets()
except ImportError as _e:  # torchtitan (or datasets) missing: building the assets still works
    if "torchtitan" not in str(_e) and "datasets" not in str(_e):
        raise

__all__ = [
    "BOS_TOKEN",
    "Corpus",
    "ENV_VAR",
    "EOS_TOKEN",
    "TRAIN_NAME",
    "VALIDATION_NAME",
    "VOCAB_SIZE",
    "build_corpus",
    "corpus_sha256",
    "default_data_dir",
    "ensure_assets",
    "read_manifest",
    "register_datasets",
    "train_tokenizer",
]
