"""Every relative link in README and docs/ resolves: to a file of the tree and, with an anchor, to a
heading of that page (GitHub's anchors: lower case, punctuation dropped, spaces to dashes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from disagg.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are code
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]  # not http:, mailto: ...


def test_there_are_pages_and_links():
    assert len(PAGES) > 10 and sum(len(links(p)) for p in PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert broken == [], broken
