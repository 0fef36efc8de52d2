"""KV exhaustion on a real Triton (RELIABILITY E2): the decode pool's cache holds one long request,
so a second long one waits for blocks, past its KV lease's TTL. Short requests keep flowing past it
(bounded overtaking), the waiting import's lease is renewed instead of expiring, and every request
ends on the normal path: no expiry, no fallback, no migration, nothing left behind."""

from __future__ import annotations

import numpy as np
import pytest
from serving_support import pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer
from disagg_tools.repository import main as write_repository

# 8 MiB of bf16 KV for the tiny model is 64 blocks of 16 tokens: one long request takes 45 of them,
# so a second cannot join until the first ends (700 decode steps, 2-3 s or more: past the time a 2 s
# lease is renewed at, 1 s before its end), while a short one (1 block) still fits, and the pool
# stays under the 95 % of its blocks that would make the orchestrator call it saturated.
KV_CACHE_MB, LEASE_TTL_S = 8, 2
LONG_TOKENS, SHORT_TOKENS, SHORTS = 700, 4, 6


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    out = tmp_path_factory.mktemp("exhaustion") / "repository"
    command = ["--out", str(out), "--kv-cache-mb", str(KV_CACHE_MB), "--lease-ttl-s", str(LEASE_TTL_S)]
    assert write_repository(command) == 0
    return triton_factory.start(out, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _long(prompt: str) -> dict:
    return text_inputs(prompt, LONG_TOKENS, min_length=np.array([[LONG_TOKENS]], np.int32), stream=True)


def test_a_waiting_import_keeps_its_kv_and_short_requests_pass_it(server: TritonServer) -> None:
    url = server.config.grpc_url
    with GrpcStream(url) as first, GrpcStream(url) as waiting:
        first.send("llm", _long("Hello world"))
        started = first.next(60)
        assert started.error is None, f"the first long request started: {started.error}"
        waiting.send("llm", _long("Good morning"))
        prefilled = waiting.next(60)
        assert prefilled.error is None, f"the second long request was prefilled: {prefilled.error}"

        shorts = []
        for i in range(SHORTS):
            with GrpcStream(url) as short:
                short.send(
                    "llm",
                    text_inputs(
                        f"short {i}",
                        SHORT_TOKENS,
                        min_length=np.array([[SHORT_TOKENS]], np.int32),
                        stream=True,
                    ),
                )
                shorts.append(read_stream(short, 60))
        assert all(r.error is None and r.final for r in shorts), shorts
        assert waiting.events.qsize() == 0, "the shorts ended while the second long one still waited"

        results = [read_stream(first, 180), read_stream(waiting, 180)]
    assert all(r.error is None and r.final for r in results), results

    samples = scrape_metrics(server.config.metrics_url)
    renewals = metric_sum(samples, "disagg_kv_lease_renewals_total", pool="prefill")
    assert renewals >= 1, "the waiting import's lease was renewed"
    assert metric_sum(samples, "disagg_kv_lease_expired_total") == 0, "no lease expired while waiting"
    assert metric_sum(samples, "disagg_migrations_total", model="llm") == 0
    assert metric_sum(samples, "disagg_fallbacks_total", model="llm", to="local") == 0
    completed = metric_sum(samples, "disagg_requests_total", model="llm", outcome="ok")
    assert completed == SHORTS + 2, f"{completed} requests counted as served"

    def idle() -> bool:
        return not any(v for k, v in pool_gauges(server).items() if k[0] != "disagg_kv_blocks_free")

    wait_until(idle, 30, "no KV block in use and no sequence active")
