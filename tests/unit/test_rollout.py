"""`disagg rollout` step by step against a fake server, the routing file, and the version folders'
manifests and probes (the live rollout is tests/integration/test_serving_rollout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.control import ModelControl
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.errors import CheckpointError
from disagg.engine.tokenizer import Tokenizer
from disagg.serving.routing import LATEST, PINNED, Routing, RoutingFile, pinned_version
from disagg.triton.version import Probe, read_manifest, run_probe
from disagg_tools.repository import OWNED_MARKER, write_owned
from disagg_tools.rollout import Rollout, RolloutConfig, RolloutError, pinned_counts

MODELS = ("colocated", "decode", "prefill")


class FakeTriton:
    """The rollout's view of a server: loaded versions, version-policy loads, pinned counts."""

    def __init__(self, loaded: dict[str, list[int]], pinned: list[dict] | None = None) -> None:
        self.config = RolloutConfig(drain_timeout_s=5.0)
        self.loaded = {m: list(v) for m, v in loaded.items()}
        self.calls: list[tuple[str, list[int]]] = []
        self.failing: set[tuple[str, int]] = set()
        self._pinned = pinned or []

    def loaded_versions(self) -> dict[str, list[int]]:
        return {m: list(v) for m, v in self.loaded.items()}

    def set_versions(self, model: str, versions: list[int]) -> None:
        self.calls.append((model, versions))
        if any((model, v) in self.failing for v in versions):
            raise RolloutError("HTTP 400: failed to load 'decode' version 3: checkpoint has no weights")
        self.loaded[model] = versions

    def pinned(self) -> dict[tuple[str, int], float]:
        return self._pinned.pop(0) if len(self._pinned) > 1 else (self._pinned[0] if self._pinned else {})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def _rollout(tmp_path: Path, triton: FakeTriton, clock: Clock | None = None) -> tuple[Rollout, list[str]]:
    said: list[str] = []
    clock = clock or Clock()
    control = ModelControl("127.0.0.1:1", directory=tmp_path / "control")
    rollout = Rollout(triton, RoutingFile(control.routing_path), said.append, clock, clock.wait)
    return rollout, said


def test_a_rollout_loads_beside_switches_drains_then_unloads(tmp_path):
    busy, idle = {("decode", 1): 2.0, ("prefill", 1): 0.0}, {("decode", 1): 0.0}
    triton = FakeTriton({key: [1] for key in MODELS} | {"llm": [1]}, pinned=[busy, busy, idle])
    clock = Clock()
    rollout, said = _rollout(tmp_path, triton, clock)
    rollout.run(2)
    assert triton.calls == [(m, [1, 2]) for m in MODELS] + [(m, [2]) for m in MODELS]
    assert "llm" not in {m for m, _ in triton.calls}, "entry points are never reloaded"
    routing = rollout.routing.current()
    assert dict(routing.versions) == dict.fromkeys(MODELS, 2)
    assert dict(routing.previous) == dict.fromkeys(MODELS, 1)
    assert len(clock.waits) == 2, "it waited while requests pinned to version 1 were in flight"
    assert said[0].startswith("pinned") and "switched: new requests go to version 2" in said
    assert rollout.rollback_target() == 1
    rollout.run(1)
    assert rollout.routing.current().versions["decode"] == 1 and triton.loaded["decode"] == [1]
    rollout.run(1)
    assert said[-1] == "already serving version 1"


def test_a_version_that_fails_to_load_leaves_the_old_one_serving(tmp_path):
    triton = FakeTriton({key: [2] for key in MODELS})
    triton.failing.add(("decode", 3))
    rollout, _ = _rollout(tmp_path, triton)
    with pytest.raises(RolloutError, match=r"version 3 of decode failed to load; still serving version 2 \("):
        rollout.run(3)
    assert triton.loaded == {key: [2] for key in MODELS}, "colocated, loaded first, was put back"
    assert triton.calls == [("colocated", [2, 3]), ("decode", [2, 3]), ("colocated", [2])]
    assert dict(rollout.routing.current().versions) == dict.fromkeys(MODELS, 2), "never switched"


def test_a_drain_that_does_not_end_stops_with_both_versions_loaded(tmp_path):
    triton = FakeTriton({key: [1] for key in MODELS}, pinned=[{("decode", 1): 1.0}])
    rollout, _ = _rollout(tmp_path, triton)
    with pytest.raises(RolloutError, match="still in flight on the old version after 5 s; both versions"):
        rollout.run(2)
    assert triton.loaded == {key: [1, 2] for key in MODELS}
    assert rollout.routing.current().versions["decode"] == 2, "new requests already go to 2"


def test_nothing_to_roll_back_to_and_no_pool_models(tmp_path):
    rollout, _ = _rollout(tmp_path, FakeTriton({key: [1] for key in MODELS}))
    with pytest.raises(RolloutError, match="nothing to roll back to"):
        rollout.rollback_target()
    rollout, _ = _rollout(tmp_path, FakeTriton({"llm": [1]}))
    with pytest.raises(RolloutError, match="none of the pool models"):
        rollout.run(2)


def test_pinned_counts_sum_entry_points_by_pool_and_version():
    text = "\n".join(
        [
            "# TYPE disagg_pinned_requests gauge",
            'disagg_pinned_requests{instance="llm_0",model="llm",pool="decode",version="1"} 2',
            'disagg_pinned_requests{instance="o_0",model="orchestrator",pool="decode",version="1"} 1',
            'disagg_pinned_requests{instance="o_0",model="orchestrator",pool="decode",version="2"} 4',
            "# TYPE disagg_kv_blocks_used gauge",
            'disagg_kv_blocks_used{model="decode"} 9',
        ]
    )
    assert pinned_counts(text + "\n") == {("decode", 1): 3.0, ("decode", 2): 4.0}


def test_routing_file_is_read_when_it_changes_and_pins_follow_the_task(tmp_path):
    routing = RoutingFile(tmp_path / "r.json")
    assert routing.current() == Routing() and pinned_version("decode") == LATEST
    routing.write(Routing({"decode": 1}))
    assert routing.current().versions == {"decode": 1}
    routing.write(routing.current().switched({"decode": 2}))
    assert (dict(routing.current().versions), dict(routing.current().previous)) == (
        {"decode": 2},
        {"decode": 1},
    )
    (tmp_path / "r.json").write_text('{"versions": {"decode": "two"}}')
    assert routing.current().versions == {"decode": 2}, "a malformed file keeps the last good routing"
    routing.clear()
    assert routing.current() == Routing()
    token = PINNED.set({"decode": 2})
    try:
        assert pinned_version("decode") == 2 and pinned_version("prefill") == LATEST
    finally:
        PINNED.reset(token)
    with pytest.raises(ValueError):
        Routing.from_json('{"versions": {"decode": 0}}')


def test_manifest_and_probe(tmp_path, tiny_model_dir):
    (tmp_path / "2").mkdir(parents=True)
    assert read_manifest(tmp_path, 1).checkpoint == ""  # no folder, no manifest: the server's model
    (tmp_path / "2" / "version.json").write_text('{"checkpoint": "/m", "probe": {"prompt": "x"}}')
    with pytest.raises(
        CheckpointError, match=r"version 2: version.json is not valid .*probe.expect: required"
    ):
        read_manifest(tmp_path, 2)
    (tmp_path / "2" / "version.json").write_text('{"checkpoint": "/m", "extra": 1}')
    with pytest.raises(CheckpointError, match="unknown key"):
        read_manifest(tmp_path, 2)

    engine = Engine(EngineConfig(model_dir=tiny_model_dir, dtype="float32", kv_cache_mb=8))
    tokenizer = Tokenizer(tiny_model_dir)
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request
    from disagg.pool.offline import generate

    tokens, _ = generate(engine, Request(tuple(tokenizer.encode("The river")), SamplingParams(max_tokens=4)))
    good = Probe("The river", tokenizer.decode(tokens), 4)
    run_probe(engine, tokenizer, good, 1)
    with pytest.raises(CheckpointError, match="version 7 failed its readiness probe"):
        run_probe(engine, tokenizer, Probe("The river", good.expect + "!", 4), 7)


def test_serve_spec_writes_only_a_folder_it_owns(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("hot_prompts:\n  pool: {cores: [1]}\n")
    out = tmp_path / "state" / "spec-repository"
    write_owned(spec, out)
    assert (out / OWNED_MARKER).is_file() and (out / "decode_hot" / "config.pbtxt").is_file()
    spec.write_text("dtype: float32\n")
    write_owned(spec, out)
    assert not (out / "decode_hot").exists(), "a model of the earlier spec does not stay behind"
    spec.write_text("pools: {decode: {cores: [0]}}\n")
    with pytest.raises(ValueError, match="overlaps"):
        write_owned(spec, out)
    assert (out / "decode" / "config.pbtxt").is_file(), "an invalid spec changes nothing"
    foreign = tmp_path / "mine"
    (foreign / "decode").mkdir(parents=True)
    spec.write_text("{}\n")
    with pytest.raises(ValueError, match="not written by"):
        write_owned(spec, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["decode"]
