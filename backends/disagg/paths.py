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
    """Build the embedded default model if ``model_dir`` is its folder and it is missing."""
    if model_dir.resolve() == default_model_dir().resolve() and not (model_dir / "config.json").exists():
        from disagg_tools.tiny_model import build

        build(model_dir)
    return model_dir
