"""The Python backend's BLS iterator-release defect on Triton 2.51, and the graveyard that avoids it.

Runs `perf/bls_release_stress.py`'s stress models (a decoupled BLS relay like the orchestrator, over a
streaming source) for a short while per release policy: letting finished iterators go at once kills
the relay's stub (its responses are freed without the GIL on the stub's own thread); keeping them in
`disagg.triton.graveyard.Graveyard` frees every response array with the GIL and nothing dies. The
first half shows the second can fail: if Triton's Python backend no longer has the defect, it fails
and says so."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[2] / "perf"
if str(PERF) not in sys.path:
    sys.path.insert(0, str(PERF))

import bls_release_stress  # noqa: E402 - needs perf/ on the path

# the drop policy's stub dies within a second (perf/results/bls_release_stress.md: 0.6 s, every run);
# 6 s of the graveyard make over a thousand calls here
ARGS = argparse.Namespace(seconds=6.0, streams=32, responses=8, width=64)


def test_dropping_finished_iterators_kills_the_relay_stub(tmp_path: Path) -> None:
    run = bls_release_stress.one_run(tmp_path, "drop", ARGS)
    assert run["crashed"], (
        "no process died in 15 s of dropping finished BLS iterators: the Python backend may have been "
        "fixed (python_backend r24.12 takes the GIL); update docs/degradation.md and graveyard.py. "
        f"Run: {run}"
    )


def test_graveyard_frees_every_response_with_the_gil(tmp_path: Path) -> None:
    run = bls_release_stress.one_run(tmp_path, "graveyard", ARGS)
    assert not run["crashed"], run
    assert run["client_errors"] == [], run
    assert run["calls"] > 100, run
    assert run["arrays_freed_without_gil"] == 0, run
    assert run["arrays_freed_with_gil"] >= run["calls"] * ARGS.responses, run
