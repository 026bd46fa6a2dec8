"""Offline default training data: a corpus of CPython stdlib sources + pydoc topics and its own tokenizer.

Importing this package registers TorchTitan datasets ``pystdlib`` and ``pystdlib_validation``
(pointing at ``$TITAN_NVFP4_DATA_DIR`` or ``./assets/pystdlib``) and ``pysources`` /
``pysources_validation`` (the larger corpus of the installed packages' sources, at
``$TITAN_NVFP4_PYSOURCES_DIR`` or ``./assets/pysources``). Import ``titan_nvfp4.data.prepare``
(TorchTitan's ``[experimental] custom_import``) to also build the pystdlib assets, or
``titan_nvfp4.data.prepare_pysources`` for pysources; modules: ``corpus`` (text), ``tokenizer`` (BPE),
``assets`` (build/lock/manifest), ``registry`` (TorchTitan datasets), ``prepare`` (import hook and CLI),
``pysources`` (the package-sources corpus), ``manifest`` (the check of a folder against its manifest).
"""

from .assets import ENV_VAR, default_data_dir, ensure_assets, read_manifest
from .corpus import Corpus, build_corpus, corpus_sha256
from .manifest import AssetsError
from .pysources import ensure_pysources, register_pysources
from .registry import TRAIN_NAME, VALIDATION_NAME, register_datasets
from .tokenizer import BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE, train_tokenizer

try:
    register_datasets()
    register_pysources()
except ImportError as _e:  # torchtitan (or datasets) missing: building the assets still works
    if "torchtitan" not in str(_e) and "datasets" not in str(_e):
        raise

__all__ = [
    "AssetsError",
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
    "ensure_pysources",
    "read_manifest",
    "register_datasets",
    "register_pysources",
    "train_tokenizer",
]
