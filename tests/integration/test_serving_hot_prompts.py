"""Hot prompts on a real Triton, with the prefix cache on: a burst of prompts sharing a long prefix
becomes a hot group, its requests decode on the hot pool (`disagg repository --hot-decode-cores`)
through BLS, the prefill pool computes the shared prefix once, every text equals the engine's without
a cache, and /metrics shows the cache, the group and the routes. The side-by-side measurement is
`perf/hot_prompts.py`."""

from __future__ import annotations

import re

import pytest
from serving_support import engine_texts, metric_sum, pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, wait_until

from disagg.server import TritonServer
from disagg_tools.repository import main as write_repository

SHARED = "You are a shop assistant. Today every coat is half price, and delivery is free. " * 3
PROMPTS = [SHARED + f"Customer {i} asks about size {i + 2}." for i in range(6)]
MAX_TOKENS = 8
THRESHOLD = 3  # the third request of the burst finds its group hot


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    out = tmp_path_factory.mktemp("hot") / "repository"
    # float32: texts compared with the engine's token for token on any CPU
    command = ["--out", str(out), "--dtype", "float32", "--prefix-cache", "--hot-decode-cores", "1"]
    assert write_repository(command) == 0
    config = out / "llm" / "config.pbtxt"
    entries = "".join(
        f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n'
        for key, value in (
            ("hot_prompts.threshold", THRESHOLD),
            ("hot_prompts.min_prefix_tokens", 32),
            ("hot_prompts.surge", 0),
        )
    )
    config.write_text(re.sub(r"parameters \[\n", "parameters [\n" + entries, config.read_text(), count=1))
    return triton_factory.start(out, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def test_a_burst_sharing_a_prefix_is_cached_and_decoded_on_the_hot_pool(server: TritonServer) -> None:
    expected = engine_texts(PROMPTS, MAX_TOKENS, dtype="float32")
    hits_before = metric_sum(server, "disagg_prefix_cache_hits_total", pool="prefill")
    texts = []
    for prompt in PROMPTS:  # one after another: the group heats up request by request
        with GrpcStream(server.config.grpc_url) as stream:
            stream.send("llm", text_inputs(prompt, MAX_TOKENS, stream=True))
            result = read_stream(stream, 60)
        assert result.error is None and result.final, result
        texts.append("".join(result.pieces))
    assert texts == [expected[p] for p in PROMPTS], "the cache and the hot pool change no token"

    routes = {
        r: metric_sum(server, "disagg_hot_routes_total", model="llm", route=r) for r in ("cold", "hot_pool")
    }
    assert routes == {"cold": THRESHOLD - 1, "hot_pool": len(PROMPTS) - THRESHOLD + 1}, routes
    # the pools publish their counters a little after the steps (every 0.25 s): wait for them; a
    # request's first token comes from prefill, and these decode to MAX_TOKENS without an end token
    hot_steps = (len(PROMPTS) - THRESHOLD + 1) * (MAX_TOKENS - 1)
    wait_until(
        lambda: metric_sum(server, "disagg_engine_steps_total", model="decode_hot") >= hot_steps,
        10,
        "the hot pool's decode steps on /metrics",
    )
    hits = metric_sum(server, "disagg_prefix_cache_hits_total", pool="prefill") - hits_before
    assert hits >= len(PROMPTS) - 1, "every prompt after the first found the shared blocks"
    wait_until(lambda: metric_sum(server, "disagg_hot_groups", model="llm") == 1, 10, "the group on /metrics")
    rate = metric_sum(server, "disagg_hot_group_requests_per_second", model="llm", rank="1")
    assert rate > 0

    # a burst in flight at once: several hand-offs of the cached prefix live together (each lease
    # holds private copies of the shared blocks), every text still the engine's
    burst = [SHARED + f"Customer {i} asks about delivery." for i in range(10, 14)]
    expected_burst = engine_texts(burst, MAX_TOKENS, dtype="float32")
    streams = [GrpcStream(server.config.grpc_url) for _ in burst]
    try:
        for stream, prompt in zip(streams, burst, strict=True):
            stream.send("llm", text_inputs(prompt, MAX_TOKENS, stream=True))
        results = [read_stream(stream, 60) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    assert [r.error for r in results] == [None] * len(burst)
    assert ["".join(r.pieces) for r in results] == [expected_burst[p] for p in burst]

    def idle() -> bool:
        used = {k: v for k, v in pool_gauges(server).items() if k[0] != "disagg_kv_blocks_free"}
        return not any(used.values())

    wait_until(idle, 30, "no KV block in use and no sequence active")
