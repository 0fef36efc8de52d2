"""A backlog in a pool is not a dead pool, on a real Triton.

Triton 2.51's Python backend runs each BLS call on a thread of its caller's instance (a pool of
``thread-pool-size``, 32 by default) until the call's first response arrives. Were a pool to answer
a job only with its first event, every prefill waiting its turn would hold one of the orchestrator's
threads; with as many waiting as there are threads, the orchestrator's pings and its responses to
clients would queue behind them, and the watcher would find a live, busy pool gone, migrate its
streams and restart it. The pools therefore accept every job at once with an empty response.

Here the thread pool is 4 and the watcher gives up on a ping after 1 s. A burst of prompts must put
more than 4 prefills in the pool's queue at once (held threads would let no more than 4 calls
through), and every request must be served on its normal path, with no migration, fallback or
restart, while the queue lasts several seconds.
"""

from __future__ import annotations

import pytest
from serving_support import pool_gauges, prompt_burst, read_stream, repository_with_llm_parameters
from triton_support import LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer

BURST = 16
PROMPT_WORDS = 200  # several hundred tokens each: the burst is several seconds of prefill
THREADS = 4  # the Python backend's threads per instance for BLS calls and decoupled responses


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    return triton_factory.start(
        # `llm`'s watcher gives up on a ping after 1 s
        # and admits every prompt: the backlog is what this test builds (admission: test_serving_admission)
        repository_with_llm_parameters(
            tmp_path_factory.mktemp("backlog"), {"health.probe_timeout_s": "1", "admission.margin": "0"}
        ),
        exit_timeout_s=10,
        extra_args=(f"--backend-config=python,thread-pool-size={THREADS}",),
    )


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def test_a_long_prefill_queue_keeps_its_pool_healthy_and_every_request_on_its_path(
    server: TritonServer,
) -> None:
    streams = prompt_burst(server, BURST, PROMPT_WORDS)
    try:
        # a waiting call holds none of the orchestrator's threads: more prefills wait than it has
        backlog = wait_until(
            lambda: (
                metric_sum(scrape_metrics(server.config.metrics_url), "disagg_prefill_queue_requests")
                >= 2 * THREADS
            ),
            60,
            f"{2 * THREADS} prefills waiting at once ({THREADS} threads)",
        )
        results = [read_stream(stream, 120) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    assert backlog
    errors = [r.error for r in results if r.error is not None]
    assert not errors, errors
    assert all(r.final and r.pieces for r in results), "every request ran to its end"
    samples = scrape_metrics(server.config.metrics_url)
    for name in ("disagg_migrations_total", "disagg_fallbacks_total", "disagg_pool_restarts_total"):
        assert metric_sum(samples, name) == 0, f"{name}: a busy pool was taken for a dead one"
    served = metric_sum(samples, "disagg_requests_total", model="llm", outcome="ok")
    assert served == BURST + 1, served

    def idle() -> bool:
        gauges = pool_gauges(server)
        return not any(v for k, v in gauges.items() if k[0] != "disagg_kv_blocks_free")

    wait_until(idle, 30, "no KV block in use and no sequence active once the burst is over")
