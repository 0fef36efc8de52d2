"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.paths import ensure_model, resolve_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded default model ($MODEL_DIR or .models/tiny), built on first use."""
    return ensure_model(resolve_model_dir())
