"""The relay's floor (``perf.relay_floor``, also the GPU served check's), with the measurements faked:
TPOT through each entry point beside the decode pool's own step inside the server over the same tokens,
what lies between, the floor from a null server's, and the repository whose pools compute nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf import gpu_serve_check, orchestration_cost, relay_floor
from perf.benchlib.deploy import DeployError, pool_parameter


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
    assert gpu_serve_check.served_tpot is relay_floor.served_tpot  # one measurement for both
    out = relay_floor.served_tpot("g:1", "http://m/metrics", reps=3, tokens=17)
    assert calls == [("ensemble", 17)] * 4 + [("llm", 17)] * 4  # one warm-up round each, dropped
    assert out["ensemble"]["tpot_ms"] == pytest.approx(4.0)
    assert out["ensemble"]["decode_step_ms"] == pytest.approx(3.0)
    assert out["ensemble"]["between_steps_ms"] == pytest.approx(1.0)
    assert out["llm"]["between_steps_ms"] == pytest.approx(0.5)
    assert len(out["llm"]["samples"]["tpot_ms"]) == 3


def _served(tpot_ms: float, step_ms: float) -> dict:
    return {"tpot_ms": tpot_ms, "decode_step_ms": step_ms, "between_steps_ms": tpot_ms - step_ms}


def test_the_floor_is_the_null_servers_time_beyond_its_step_and_the_target_adds_half_a_ms() -> None:
    real = {"ensemble": _served(9.0, 8.0), "llm": _served(9.2, 8.0)}
    null = {"ensemble": _served(0.7, 0.2), "llm": _served(0.6, 0.2)}
    out = relay_floor.floor(real, null)
    ensemble, llm = out["ensemble"], out["llm"]
    assert ensemble["floor_ms"] == pytest.approx(0.5)
    assert not ensemble["overlapped"] and not llm["overlapped"]  # floors below the time between steps
    assert ensemble["bound_ms"] == pytest.approx(9.0) and ensemble["met"]  # 8.0 + 0.5 + 0.5
    assert llm["bound_ms"] == pytest.approx(8.9) and not llm["met"]  # 9.2 > 8.0 + 0.4 + 0.5
    assert "missed (9.20 vs 8.90)" in relay_floor.markdown(
        {"floor": out, "command": "c", "tokens": 64, "reps": 5, "machine": "m"}
    )
    # a relay that costs more than the time between steps ran beside the steps
    beside = relay_floor.floor({**real, "ensemble": _served(8.3, 8.0)}, null)["ensemble"]
    assert beside["overlapped"] and beside["met"]


def test_the_null_repository_switches_every_pool_and_nothing_else(tmp_path: Path) -> None:
    repository = Path(relay_floor.REPO_ROOT) / "model_repository"
    null = relay_floor.null_repository(repository, tmp_path)
    pools = {"prefill", "decode", "colocated"}
    for config in sorted(null.glob("*/config.pbtxt")):
        name = config.parent.name
        assert pool_parameter(null, name, "null_compute") == ("true" if name in pools else ""), name
    assert {c.parent.name for c in null.glob("*/config.pbtxt")} >= pools
    assert not pool_parameter(repository, "decode", "null_compute")  # the original is untouched


def test_a_repository_without_pools_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src" / "ensemble").mkdir(parents=True)
    (tmp_path / "src" / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\nparameters [\n]\n')
    with pytest.raises(DeployError, match="no pool model"):
        relay_floor.null_repository(tmp_path / "src", tmp_path / "out")
