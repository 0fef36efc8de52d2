"""The project's own checkpoints, made on first use: the default model fetched and converted, the
tiny test model written. Any other folder is only checked (``disagg.paths.check_checkpoint``).

Here, in the tools, and not in ``disagg``: the serving package never makes a model, and never imports
the tools.
"""

from __future__ import annotations

from pathlib import Path

from disagg.paths import check_checkpoint, default_model_dir, same_folder, tiny_model_dir


def ensure_model(model_dir: Path) -> Path:
    """Return ``model_dir`` once it holds a complete checkpoint.

    The project's own folders are built when missing or stale (the default model is fetched and
    converted, the tiny model written). Any other folder is only checked: if it is not a complete
    checkpoint, ``CheckpointError`` says what is missing; nothing is created, replaced or repaired.
    """
    model_dir = Path(model_dir)
    if same_folder(model_dir, tiny_model_dir()):
        from disagg_tools.tiny_model import build, is_complete  # torch: only when it is built

        if not is_complete(model_dir):
            build(model_dir)
    elif same_folder(model_dir, default_model_dir()):
        from disagg_tools.catalog import SMOLLM2, fetch

        fetch(SMOLLM2, model_dir)
    check_checkpoint(model_dir)
    return model_dir
