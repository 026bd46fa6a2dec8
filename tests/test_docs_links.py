"""The docs' relative links resolve (file and #anchor), and every raw output kept under docs/bench/ is cited by a
page: raw outputs stay only for the results the docs cite."""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import pytest

from docs_pages import PAGES
from docs_pages import REPO as ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose_lines(path: Path) -> list[str]:
    """The lines of a markdown file outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    out = set()
    for line in prose_lines(path):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for line in prose_lines(path) for m in LINK.finditer(line)]


def relative(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in filter(relative, links(page)):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_raw_output_is_cited():
    bench = ROOT / "docs" / "bench"
    files, folders = set(), set()  # a link into a subfolder of bench/ cites that folder's set of outputs
    for page in [*PAGES, *sorted(bench.rglob("*.md"))]:
        for target in filter(relative, links(page)):
            dest = (page.parent / target.partition("#")[0]).resolve()
            files.add(dest)
            if dest.parent != bench:
                folders.add(dest.parent)
    raw = [p for p in bench.rglob("*") if p.is_file()]
    assert raw, "docs/bench/ holds no raw outputs"
    uncited = [str(p.relative_to(ROOT)) for p in raw if p not in files and p.parent not in folders]
    assert not uncited, f"raw outputs no page links to (cite them or delete them): {uncited}"


def test_slug_matches_githubs_rule():
    assert slug("The README's debug model") == "the-readmes-debug-model"
    assert slug("gpt_oss debug (MoE)") == "gpt_oss-debug-moe"
    assert slug("End to end (TorchTitan)") == "end-to-end-torchtitan"
    assert slug("`eager_graphs` and CUDA graphs") == "eager_graphs-and-cuda-graphs"
