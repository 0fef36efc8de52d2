"""Checks that need a CUDA device: skipped where none is present (CI has none).

They run on a lent GPU machine through ``perf/gpu_check.sh``; docs/gpu.md gives their last result.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
