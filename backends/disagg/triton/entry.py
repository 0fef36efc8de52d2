"""Pick the adapter of a model instance from its ``role`` parameter."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
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


def finalize_adapter(adapter: Any) -> None:
    """Finalize the instance; then let its stub process exit without tearing its interpreter down.

    Once ``finalize`` has returned, the stub answers Triton and its process ends: everything the
    instance held (engine threads, KV regions, loan segments) was released explicitly by then, and the
    operating system takes back the rest. Tearing down an interpreter that imported torch takes about
    a second of the unload, which is on the critical path of every unload, rollout and server exit
    (Triton checks for live models once a second). An instance whose resources only their destructors
    release (its ``teardown_at_exit``, from its KV transport: a NIXL agent's UCX context) keeps the full
    teardown."""
    adapter.finalize()
    if not getattr(adapter, "teardown_at_exit", False):
        atexit.register(_exit_now)


def _exit_now() -> None:
    """The last exit handler to be registered runs first: flush what the logs hold, and end here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to flush
            stream.flush()
    os._exit(0)


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
