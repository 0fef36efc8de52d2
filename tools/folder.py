"""Output folders the project's builders own: written whole, atomically, and only where they may.

A builder (the tiny-model maker, the GGUF converter) writes a complete folder into a temporary
sibling and renames it into place, so a reader sees either no folder or a whole one. The folder's
*stamp* file, written last, says which builder made it. A builder replaces an existing folder only if
that folder carries its own stamp: anything else at the target (a user's checkpoint, an empty folder
someone made, a file) is refused, never overwritten, "repaired" or moved (RELIABILITY G6).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The files of a checkpoint folder as this project's builders write it (Hugging Face layout), besides
# each builder's own stamp.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class FolderError(ValueError):
    """The target exists and was not made by this builder, or cannot be written."""


def read_stamp(folder: Path, stamp_name: str) -> dict[str, Any] | None:
    """The stamp a builder left in ``folder``, or None when there is none (or it is unreadable)."""
    try:
        stamp = json.loads((Path(folder) / stamp_name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def check_replaceable(out_dir: Path, stamp_name: str) -> None:
    """Refuse a target that exists without this builder's stamp (a folder it did not create)."""
    out_dir = Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink() or not out_dir.is_dir() or read_stamp(out_dir, stamp_name) is None:
        raise FolderError(
            f"{out_dir} exists and was not written by this command (no {stamp_name}); "
            "refusing to write into it: choose a new folder"
        )


def write_json(path: Path, obj: Any) -> None:
    """JSON as every builder writes it: sorted keys, two-space indent, UTF-8, newline-terminated."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def staging(out_dir: Path, stamp_name: str) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` to write into; on clean exit it replaces ``out_dir``.

    The caller writes every file, the stamp last. The target is checked before anything is written
    and again just before the swap. On error the temporary folder is removed and the target is left
    as it was.
    """
    out_dir = Path(out_dir)
    check_replaceable(out_dir, stamp_name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if read_stamp(tmp, stamp_name) is None:
            raise FolderError(f"builder wrote no {stamp_name}")
        _install(tmp, out_dir, stamp_name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out_dir: Path, stamp_name: str) -> None:
    # mkdtemp makes the folder 0700 and safetensors writes 0600; a model folder holds nothing
    # secret and must be readable by the serving user like any other.
    os.chmod(tmp, 0o755)
    for path in tmp.iterdir():
        os.chmod(path, 0o644)
    check_replaceable(out_dir, stamp_name)
    if out_dir.exists():
        # rename() cannot replace a non-empty directory: move our old one aside first.
        # Readers briefly see no folder, never a partial one.
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        try:
            os.replace(out_dir, trash / "old")
        except FileNotFoundError:
            pass  # someone else removed or replaced it meanwhile
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another builder won the race; keep theirs if it carries our stamp.
        if read_stamp(out_dir, stamp_name) is None:
            raise
