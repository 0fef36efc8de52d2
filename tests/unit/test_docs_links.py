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


def test_every_committed_result_names_what_makes_it():
    """Each entry of perf/results/ is in docs/benchmarks.md's table of results, and every `make`
    target that page names is one of the Makefile's."""
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    unnamed = [
        entry.name
        for entry in sorted((REPO_ROOT / "perf" / "results").iterdir())
        if f"perf/results/{entry.name}" not in page
    ]
    assert unnamed == [], f"perf/results entries no row of docs/benchmarks.md names: {unnamed}"
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][\w-]*)", page)) | set(
        re.findall(r"`make [a-z][\w-]* ([a-z][\w-]*)", page)
    )
    assert named and named <= targets, sorted(named - targets)
