"""A folder's files and their text, to compare two written repositories whole."""

from __future__ import annotations

from pathlib import Path


def file_tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (its path relative to it) with its text."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}
