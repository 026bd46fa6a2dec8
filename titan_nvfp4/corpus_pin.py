"""The corpus pin: the environment variable a job reads the corpus id it must train on from, and that id's form.
A leaf (no torch, no TorchTitan), so that reading a comparison spec's pin costs no framework import."""

from __future__ import annotations

import re

#: a corpus id (data.manifest.corpus_id) a job must train on; a job whose corpus has another id fails before training
CORPUS_ENV_VAR = "TITAN_NVFP4_CORPUS"
CORPUS_ID = re.compile(r"[0-9a-f]{12}")  # what data.manifest.corpus_id returns: 12 lowercase hex digits
