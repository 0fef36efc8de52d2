"""Where things live by default: the embedded model, runtime state."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_model_dir() -> Path:
    """The embedded tiny model's folder: ``<repo>/.models/tiny``."""
    return REPO_ROOT / ".models" / "tiny"


def resolve_model_dir(cli_value: str | os.PathLike[str] | None = None) -> Path:
    """``--model`` beats ``MODEL_DIR``, which beats the default folder."""
    if cli_value:
        return Path(cli_value)
    env = os.environ.get("MODEL_DIR")
    return Path(env) if env else default_model_dir()


def ensure_model(model_dir: Path) -> Path:
    """Build the embedded default model into ``model_dir`` when it is missing.

    The default folder is (re)built when incomplete or from an older builder. Any other folder is
    built only if it does not exist or is empty: a user's own checkpoint is never overwritten.
    """
    from disagg_tools.tiny_model import build, is_complete

    model_dir = Path(model_dir)
    if model_dir.resolve() == default_model_dir().resolve():
        if not is_complete(model_dir):
            build(model_dir)
    elif not model_dir.exists() or not any(model_dir.iterdir()):
        build(model_dir)
    return model_dir
