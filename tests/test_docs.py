"""The README is a front page and the docs hold together: every relative link and anchor in README.md
and docs/ leads somewhere, and the README's map has one line for each docs page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").rglob("*.md"))

_FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a `](x)` in code is not a link)."""
    return _FENCED.sub("", path.read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings: lower case, punctuation dropped, spaces to
    hyphens, and -1, -2... on repeats."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_prose(path)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_anchors_follow_githubs_rules():
    page = REPO / "docs" / "running.md"
    assert "process-groups-process-name" in anchors(page)  # from "Process groups: `process: NAME`"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_leads_somewhere(path: Path):
    broken = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no such heading")
    assert broken == [], f"{path.relative_to(REPO)}: {broken}"


def test_the_readme_is_a_front_page_with_one_line_per_docs_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    listed = re.findall(r"^- \[docs/([\w./-]+\.md)\]\(docs/\1\): ", text, re.MULTILINE)
    pages = sorted(str(p.relative_to(REPO / "docs")) for p in PAGES if p.parent == REPO / "docs")
    assert sorted(listed) == pages, "the README's 'Where to go next' lists each docs/*.md page once"
