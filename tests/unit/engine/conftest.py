from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint, write_legacy_checkpoint
from coded import coded_copy

from disagg.engine.engine import Engine, EngineConfig


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """kind -> folder of a random checkpoint of that kind, written once per session."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(kind)
            made[kind] = (
                write_legacy_checkpoint(out) if kind == "legacy-rope" else write_checkpoint(out, kind)
            )
        return made[kind]

    return get


@pytest.fixture
def make_engine(checkpoint: Callable[[str], Path]) -> Callable[..., Engine]:
    def make(kind: str = "llama-gqa", kv_memory: torch.Tensor | None = None, **settings: object) -> Engine:
        settings.setdefault("num_blocks", 256)
        settings.setdefault("block_size", 4)
        return Engine(EngineConfig(model_dir=checkpoint(kind), **settings), kv_memory=kv_memory)

    return make


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("plain"), "llama-gqa")


@pytest.fixture(scope="session")
def coded_model(plain_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``plain_model`` with its projections made Q4_1 codes (the head Q8_0), stored in fp32."""
    return coded_copy(plain_model, tmp_path_factory.mktemp("coded") / "model")
