"""Triton's model statistics around a load: the difference per model, per request."""

from __future__ import annotations

from perf.benchlib import modelstats


def _raw(success: int, fail: int, queue_ns: int, infer_ns: int, fail_ns: int = 0) -> dict:
    return {
        "model_stats": [
            {
                "name": "preprocessing",
                "version": "1",
                "inference_stats": {
                    "success": {"count": success, "ns": 0},
                    "fail": {"count": fail, "ns": fail_ns},
                    "queue": {"count": success + fail, "ns": queue_ns},
                    "compute_input": {"count": success, "ns": 0},
                    "compute_infer": {"count": success, "ns": infer_ns},
                    "compute_output": {"count": success, "ns": 0},
                },
            },
            {"name": "idle", "version": "1", "inference_stats": {"success": {"count": 3, "ns": 9}}},
        ]
    }


def test_the_difference_is_per_request_and_idle_models_are_left_out():
    before = modelstats.parse(_raw(10, 0, 10_000_000, 20_000_000))
    after = modelstats.parse(_raw(40, 10, 510_000_000, 320_000_000, fail_ns=50_000_000))
    got = modelstats.delta(before, after)
    assert list(got) == ["preprocessing/1"]  # `idle` executed nothing in between
    expected = {"requests": 40, "failed": 10, "queue_ms": 12.5, "compute_ms": 7.5, "failed_ms": 5.0}
    assert got["preprocessing/1"] == expected
    rows = modelstats.table(got)
    assert rows[-1] == "| `preprocessing/1` | 40 (10) | 12.50 | 7.50 | 5.0 |"


def test_a_model_loaded_during_the_load_counts_from_zero():
    got = modelstats.delta({}, modelstats.parse(_raw(4, 0, 4_000_000, 8_000_000)))
    assert got["preprocessing/1"]["queue_ms"] == 1.0 and got["preprocessing/1"]["compute_ms"] == 2.0
    assert got["preprocessing/1"]["failed_ms"] is None, "no failure: no figure"
