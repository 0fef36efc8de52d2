"""Where things live by default: the models under ``.models/``, runtime state.

Two model folders belong to the project and are (re)built here when missing: the default model,
SmolLM2-135M-Instruct converted from its GGUF (``.models/smollm2-135m-instruct``), and the random tiny
model the tests and quick benchmarks use (``.models/tiny``). Any other folder (``MODEL_DIR``,
``--model``) is the user's: it is read, checked, and never written to.
"""

from __future__ import annotations

import os
from pathlib import Path

from disagg.engine.errors import CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_ROOT = REPO_ROOT / ".models"


def default_model_dir() -> Path:
    """The default model's folder: SmolLM2-135M-Instruct, ``<repo>/.models/smollm2-135m-instruct``."""
    return MODELS_ROOT / "smollm2-135m-instruct"


def tiny_model_dir() -> Path:
    """The embedded random tiny model's folder, ``<repo>/.models/tiny`` (tests, quick benchmarks)."""
    return MODELS_ROOT / "tiny"


def resolve_model_dir(cli_value: str | os.PathLike[str] | None = None) -> Path:
    """``--model`` beats ``MODEL_DIR``, which beats the default folder."""
    if cli_value:
        return Path(cli_value)
    env = os.environ.get("MODEL_DIR")
    return Path(env) if env else default_model_dir()


def same_folder(a: Path, b: Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def check_checkpoint(model_dir: Path) -> None:
    """Refuse a folder that is not a complete checkpoint, naming what is missing."""
    from disagg.engine.checkpoint import load_config

    model_dir = Path(model_dir)
    hint = "point MODEL_DIR or --model at a checkpoint folder (config.json, *.safetensors, tokenizer.json)"
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist; {hint}")
    if not (model_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"model folder {model_dir} has no tokenizer.json; {hint}")
    if not any(model_dir.glob("*.safetensors")):
        raise CheckpointError(f"model folder {model_dir} has no *.safetensors file; {hint}")
    try:
        load_config(model_dir)
    except CheckpointError as exc:
        raise CheckpointError(f"model folder {model_dir}: {exc}") from None
