"""Pick the adapter of a model instance from its ``role`` parameter."""

from __future__ import annotations

import logging
import sys
from typing import Any

from disagg.role import Role
from disagg.triton import glue
from disagg.triton.watchdog import ParentWatch


def create_adapter(args: dict[str, Any], pb_utils: Any) -> Any:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    adapter = _adapter(args, pb_utils)
    # one model instance per stub process: its watch ends the process if the server dies
    ParentWatch(getattr(adapter, "abandon", _nothing)).start()
    return adapter


def _nothing() -> None:
    pass


def _adapter(args: dict[str, Any], pb_utils: Any) -> Any:
    role = glue.model_parameters(args).get("role", "")
    if role in {r.value for r in Role}:
        from disagg.triton.pool_model import PoolModel

        return PoolModel(args, pb_utils)
    if role in ("orchestrator", "llm"):
        from disagg.triton.orchestrator_model import OrchestratorModel

        return OrchestratorModel(args, pb_utils, direct=role == "llm")
    if role == "preprocessing":
        from disagg.triton.text_model import PreprocessingModel

        return PreprocessingModel(args, pb_utils)
    if role == "postprocessing":
        from disagg.triton.text_model import PostprocessingModel

        return PostprocessingModel(args, pb_utils)
    raise ValueError(f"model parameter 'role' must name a role, got {role!r}")
