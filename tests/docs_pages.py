"""The repository and its markdown pages (the README and docs/*.md), which the docs tests read."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
