"""Model versions on a real Triton (RELIABILITY D6, B7): `disagg rollout` moves a server from
checkpoint A (version 1) to checkpoint B (version 2) and back, under a steady load of
streaming `llm` and `ensemble` requests, without one failed request and with every text exactly A's or
B's greedy text (fp32 pools, so that greedy text under concurrency is exact). A broken version 3
(missing weights) stops its rollout with Triton's reason while version 1 keeps serving. A request
pinned to a prefill of one version and a decode of the other has its KV refused by decode with the
named, counted error, and is served on the fallback ladder's local rung instead."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from serving_support import engine_texts, metric_sum, read_stream, text_inputs
from triton_support import (
    ClientThreads,
    GrpcStream,
    LeakProbe,
    TritonFactory,
    live_group_members,
    shm_entries,
    wait_until,
)

from disagg.control import ModelControl
from disagg.serving.routing import Routing, RoutingFile
from disagg_tools.repository import write_spec
from disagg_tools.rollout import Rollout, RolloutConfig, RolloutError, TritonControl
from disagg_tools.tiny_model import build as build_tiny

PROMPTS = ["The river", "Once upon a time", "A small robot"]
MAX_TOKENS = 6
KV_REGION = "disagg-"  # the pools' KV regions (disagg-<pid>-<hex>); not the backend's disagg_<id>_


@dataclass
class Checkpoints:
    a: Path
    b: Path
    broken: Path


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    b = build_tiny(tmp_path_factory.mktemp("b") / "tiny-b", seed=1)
    broken = tmp_path_factory.mktemp("broken") / "no-weights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (b / name).is_file():
            shutil.copy(b / name, broken / name)
    return Checkpoints(tiny_model_dir, b, broken)


@pytest.fixture(scope="module")
def expected(checkpoints: Checkpoints) -> dict[str, dict[str, str]]:
    a = engine_texts(PROMPTS, MAX_TOKENS, dtype="float32", model_dir=checkpoints.a)
    b = engine_texts(PROMPTS, MAX_TOKENS, dtype="float32", model_dir=checkpoints.b)
    assert all(a[p] != b[p] for p in PROMPTS), "the two checkpoints must be told apart by their text"
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, checkpoints: Checkpoints, tmp_path_factory) -> object:
    folder = tmp_path_factory.mktemp("spec")
    spec = {
        "model": {
            "versions": [
                {"version": 1, "checkpoint": str(checkpoints.a)},
                {"version": 2, "checkpoint": str(checkpoints.b)},
                {"version": 3, "checkpoint": str(checkpoints.broken)},
            ],
            "serving": 1,
        },
        "dtype": "float32",
        "kv": {"cache_mb": 64},
    }
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert write_spec(folder / "spec.yaml", folder / "repository") == 0
    return triton_factory.start(folder / "repository", exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server) -> Iterator[None]:
    leak_probe.ignore_shm(server.config.shm_prefix)
    yield
    # the KV regions of the pool instances a rollout started live as long as those instances (the
    # factory checks that none is left once the server exits); those of instances gone must be gone
    for pid in live_group_members(server.pid):
        leak_probe.ignore_shm(f"{KV_REGION}{pid}-")


def _rollout(server, said: list[str]) -> Rollout:
    config = RolloutConfig(f"http://{server.config.http_url}", server.config.metrics_url, 120.0, 120.0)
    control = ModelControl(server.config.http_url)
    triton = TritonControl(config)  # through the server's broker: the launcher holds the key
    return Rollout(triton, RoutingFile(control.routing_path), say=said.append)


class Load(ClientThreads):
    """Clients streaming `llm` and `ensemble` requests back to back until stopped; every outcome kept."""

    def __init__(self, server, clients: int = 3) -> None:
        super().__init__(clients)
        self.url = server.config.grpc_url
        self.results: list[tuple[float, str, str, str | None, bool]] = []  # start, prompt, text, error, final

    def _run(self, index: int) -> None:
        model = "ensemble" if index == 0 else "llm"
        for n in itertools.count():
            if self._stop.is_set():
                return
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            started = time.monotonic()
            with GrpcStream(self.url) as stream:
                stream.send(model, text_inputs(prompt, MAX_TOKENS, stream=True))
                result = read_stream(stream, 120)
            with self._lock:
                self.results.append((started, prompt, "".join(result.pieces), result.error, result.final))

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def since(self, at: float) -> list[tuple[float, str, str, str | None, bool]]:
        with self._lock:
            return [r for r in self.results if r[0] >= at]


def _regions() -> frozenset[str]:
    return frozenset(name for name in shm_entries() if name.startswith(KV_REGION))


def test_rollout_rollback_and_a_broken_version_under_load(server, triton_factory, expected) -> None:
    said: list[str] = []
    rollout = _rollout(server, said)
    kv_refused = metric_sum(server, "disagg_kv_incompatible_total")
    with Load(server) as load:
        wait_until(lambda: load.count() >= 3, 120, "the load's first requests")
        windows = []  # (version, from the end of its rollout, to the start of the next one)
        for target in (2, 1):  # roll out B, then roll back to A
            before = _regions()
            if windows:
                windows[-1][2] = time.monotonic()
            rollout.run(rollout.rollback_target() if target == 1 else target)
            windows.append([target, time.monotonic(), 0.0])
            wait_until(lambda b=before: not (b & _regions()), 30, "the old version's KV regions to go")
            assert _regions(), "the new version's pools hold their own regions"
            started = load.count()
            wait_until(lambda n=started: load.count() >= n + 3, 120, "requests served on the new version")
            assert rollout.triton.loaded_versions()["decode"] == [target]

        with pytest.raises(
            RolloutError, match=r"version 3 of \w+ failed to load; still serving version 1"
        ) as broken:
            rollout.run(3)
        print(f"\nthe broken version's rollout: {broken.value}")
        assert "safetensors" in str(broken.value), "Triton's reason, from the pool's own error, is kept"
        assert rollout.triton.loaded_versions()["decode"] == [1], "the old version kept serving"
        windows[-1][2] = time.monotonic() + 3600  # after the failed rollout: still version 1
        started = load.count()
        wait_until(lambda: load.count() >= started + 3, 120, "requests after the failed rollout")

    outcomes = load.results
    assert len(outcomes) >= 9, len(outcomes)
    failed = [r for r in outcomes if r[3] is not None or not r[4]]
    assert failed == [], failed
    a, b = expected["a"], expected["b"]
    assert all(text in (a[prompt], b[prompt]) for _, prompt, text, _, _ in outcomes), outcomes
    # a request that started between two rollouts got the version then serving, whole
    for version, begin, end in windows:
        texts = b if version == 2 else a
        inside = [r for r in outcomes if begin <= r[0] < end]
        assert inside and all(text == texts[prompt] for _, prompt, text, _, _ in inside), (version, inside)
    assert metric_sum(server, "disagg_kv_incompatible_total") == kv_refused, "pins kept every pair matched"
    assert any("switched" in line for line in said) and any("drained" in line for line in said)


def test_kv_of_another_version_is_refused_counted_and_served_on_another_rung(
    server, triton_factory, expected
) -> None:
    said: list[str] = []
    rollout = _rollout(server, said)
    serving = rollout.triton.loaded_versions()["decode"][0]
    other = 1 if serving == 2 else 2
    texts = expected["b"] if serving == 2 else expected["a"]
    for model in ("prefill", "decode", "colocated"):
        rollout.triton.set_versions(model, sorted({serving, other}))
    refused = metric_sum(server, "disagg_kv_incompatible_total", model="decode", version=str(other))
    try:
        # a mismatched pair, as no rollout writes it: prefill of the serving version, decode of the other
        rollout.routing.write(Routing({"prefill": serving, "decode": other, "colocated": serving}))
        with GrpcStream(server.config.grpc_url) as stream:
            stream.send("llm", text_inputs(PROMPTS[0], MAX_TOKENS, stream=True))
            result = read_stream(stream, 120)
        assert result.error is None and result.final, result
        assert "".join(result.pieces) == texts[PROMPTS[0]], "served whole by the prefill pool's version"
        wait_until(
            lambda: (
                metric_sum(server, "disagg_kv_incompatible_total", model="decode", version=str(other))
                == refused + 1
            ),
            10,
            "the refusal on /metrics",
        )
    finally:
        rollout.routing.write(Routing(dict.fromkeys(("prefill", "decode", "colocated"), serving)))
        for model in ("prefill", "decode", "colocated"):
            rollout.triton.set_versions(model, [serving])
        rollout.routing.clear()
