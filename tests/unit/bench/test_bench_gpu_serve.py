"""The GPU served check's TPOT split, with the measurements faked: TPOT through each entry point beside
the decode pool's own step inside the server over the same tokens, and what lies between."""

from __future__ import annotations

import pytest

from perf import gpu_serve_check, orchestration_cost


def test_the_served_tpot_is_split_into_the_decode_step_and_what_lies_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counters = {"steps": 0, "busy": 0.0}
    calls: list[tuple[str, int]] = []
    per_model = {"ensemble": (0.004, 0.003), "llm": (0.0035, 0.003)}  # TPOT, step (s)

    async def tpot(url, model, prompt, prompt_tokens, tokens, index):  # one stream, served at once
        calls.append((model, tokens))
        seconds, step = per_model[model]
        counters["steps"] += tokens - 1
        counters["busy"] += (tokens - 1) * step
        return seconds

    def read(metrics_url: str, pool: str) -> tuple[int, float]:
        assert (metrics_url, pool) == ("http://m/metrics", "decode")
        return counters["steps"], counters["busy"]

    monkeypatch.setattr(orchestration_cost, "triton_tpot", tpot)
    monkeypatch.setattr(orchestration_cost, "server_decode_counters", read)
    out = gpu_serve_check.served_tpot("g:1", "http://m/metrics", reps=3, tokens=17)
    assert calls == [("ensemble", 17)] * 4 + [("llm", 17)] * 4  # one warm-up round each, dropped
    assert out["ensemble"]["tpot_ms"] == pytest.approx(4.0)
    assert out["ensemble"]["decode_step_ms"] == pytest.approx(3.0)
    assert out["ensemble"]["between_steps_ms"] == pytest.approx(1.0)
    assert out["llm"]["between_steps_ms"] == pytest.approx(0.5)
    assert len(out["llm"]["samples"]["tpot_ms"]) == 3
