"""A benchmark's output files: its figures as JSON and its table as markdown, side by side (stdlib only:
the GPU machine's scripts take it too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out_dir: Path, stem: str, data: Any, markdown: str) -> None:
    """``stem.json`` (``data``) and ``stem.md`` (``markdown``, also printed) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
    print(markdown)
