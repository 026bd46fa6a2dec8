"""Which Linears a converter keeps in BF16 (filter_fqns, bf16_first_blocks / bf16_last_blocks): shared by the
TorchTitan 0.2 and 0.3 integrations (imports no TorchTitan)."""

from __future__ import annotations

import re

from .nvfp4_recipe import NVFP4Recipe

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def skip_reason(fqn: str, filter_fqns: list[str], recipe: NVFP4Recipe, n_blocks: int) -> str | None:
    """Why the Linear at ``fqn`` stays BF16, or None to convert it."""
    hits = [f for f in filter_fqns if f in fqn]
    if hits:
        return f"filter_fqns {hits}"
    m = _BLOCK_RE.search(fqn)
    if m and n_blocks:
        i = int(m.group(1))
        if i < recipe.bf16_first_blocks:
            return f"block {i} < bf16_first_blocks={recipe.bf16_first_blocks}"
        if i >= n_blocks - recipe.bf16_last_blocks:
            return f"block {i} in the last bf16_last_blocks={recipe.bf16_last_blocks}"
    return None


def check_block_counts(recipe: NVFP4Recipe, n_blocks: int, section: str) -> None:
    """Refuse bf16_first_blocks + bf16_last_blocks that keep every transformer block of the model in BF16."""
    first, last = recipe.bf16_first_blocks, recipe.bf16_last_blocks
    if n_blocks and first + last >= n_blocks:
        raise ValueError(f"[{section}] bf16_first_blocks = {first} and bf16_last_blocks = {last} keep all {n_blocks} "
                         "transformer blocks of the model in BF16, so nothing would train in NVFP4; lower them "
                         "(nvidia_paper_selective is sized for a 62-block model)")
