"""A small byte-level BPE tokenizer trained on the offline corpus with Hugging Face ``tokenizers``.

The vocabulary is exactly ``VOCAB_SIZE`` = 2048 entries so that every id fits the TorchTitan llama3
``debugmodel`` embedding. The files written are the ones TorchTitan's ``HuggingFaceTokenizer`` reads:
``tokenizer.json`` (model) and ``tokenizer_config.json`` (which strings are BOS/EOS).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # trained first, so BOS id 0 and EOS id 1
# Bound on the text the BPE trainer sees: keeps the build a few seconds on two cores while the
# merges are still learnt from millions of bytes.
TRAIN_MAX_BYTES = 8_000_000


def training_sample(texts: Sequence[str], max_bytes: int = TRAIN_MAX_BYTES) -> list[str]:
    """Leading documents of ``texts`` up to ``max_bytes`` of UTF-8: the bounded, deterministic training set."""
    sample, total = [], 0
    for text in texts:
        if total >= max_bytes:
            break
        sample.append(text)
        total += len(text.encode("utf-8"))
    return sample


def train_tokenizer(
    texts: Sequence[str], vocab_size: int = VOCAB_SIZE, max_bytes: int = TRAIN_MAX_BYTES
) -> Tokenizer:
    """Train a byte-level BPE with BOS/EOS specials on a bounded sample of ``texts`` (deterministic)."""
    tok = Tokenizer(models.BPE())
    # No normalizer: byte-level BPE then round-trips any string exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = training_sample(texts, max_bytes)
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training produced {tok.get_vocab_size()} tokens, expected {vocab_size}: "
            f"the training sample ({len(sample)} documents) is too small"
        )
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """Contents of ``tokenizer_config.json``: names BOS/EOS so HuggingFaceTokenizer can add them."""
    added = {}
    for token in SPECIAL_TOKENS:
        added[str(tok.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        # tokenizer.json has no post-processor, so BOS/EOS are added by the caller (TorchTitan's
        # encode(add_bos=..., add_eos=...)); these are the defaults when the caller does not say.
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as fh:
        json.dump(tokenizer_config(tok), fh, indent=2)
        fh.write("\n")


def estimate_tokens(tok: Tokenizer, texts: Sequence[str], every: int = 16) -> tuple[int, int, int]:
    """Tokens in every ``every``-th document, scaled to all of ``texts`` by UTF-8 bytes.

    Returns ``(estimate, sample_tokens, sample_bytes)``; BOS/EOS are not counted. A sample keeps the
    build fast (encoding the whole corpus takes tens of seconds on two cores).
    """
    sample = list(texts[::every])
    sample_bytes = sum(len(t.encode("utf-8")) for t in sample)
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: tokenizers>=0.20
    sample_tokens = sum(len(e.ids) for e in encode_batch(sample))
    estimate = round(sample_tokens * total_bytes / sample_bytes) if sample_bytes else 0
    return estimate, sample_tokens, sample_bytes
