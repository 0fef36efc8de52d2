"""Reproductions of the Triton 2.51 defects the project works around (docs/triton-2.51.md), each run as
``python -m disagg_tools.repro.NAME`` (``make repro-*``) and writing its figures under perf/results/:

- ``metric_race``: several threads on one custom metric crash the server; ``SerialMetric`` prevents it;
- ``stub_kill_stress``: how often ``kill -9`` of a pool's stub takes tritonserver down with it;
- ``bls_release_stress``: freeing a decoupled BLS call's responses races the stub's own thread; the
  orchestrator's graveyard avoids it (a shorter run is in the test suite).
"""

from __future__ import annotations

from disagg.paths import REPO_ROOT
from disagg_tools.runrecord import log, machine, write_json

__all__ = ["RESULTS", "log", "machine", "write_json"]

RESULTS = REPO_ROOT / "perf" / "results"
