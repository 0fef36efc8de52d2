"""Fixtures shared by every test folder.

The suite runs on the embedded tiny model (``.models/tiny``) unless ``MODEL_DIR`` names another
checkpoint: it is set here, before any test or server it starts reads it. Tests of the real default
model (SmolLM2) ask for it by its own fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg import paths
from disagg_tools.checkpoints import ensure_model


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("MODEL_DIR", str(paths.tiny_model_dir()))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The model the suite runs on ($MODEL_DIR, else .models/tiny), built on first use."""
    return ensure_model(paths.resolve_model_dir())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its GGUF (``disagg fetch-model smollm2``), on first use."""
    return ensure_model(paths.default_model_dir())
