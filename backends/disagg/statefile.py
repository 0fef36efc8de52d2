"""Small private files in this project's state folder, replaced whole so that a reader never sees a
part: the model-control journal, the rollout routing, the checkpoint-hash cache."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, mode 0600, its folder created 0700 if missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(text)
    temporary.chmod(0o600)
    temporary.replace(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when there is none, or it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
