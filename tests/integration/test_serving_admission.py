"""Admission by capacity on a real Triton (RELIABILITY E1 in small): a burst far above what the
prefill pool can serve within the TTFT target gets its excess refused UNAVAILABLE with a retry hint,
while what was admitted is served to its end, and nothing is left behind. The run that measures
refusal latency and goodput under a 60 s overload is `perf/overload.py`."""

from __future__ import annotations

import re

import pytest
from serving_support import pool_gauges, prompt_burst, read_stream, repository_with_llm_parameters
from triton_support import LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer

BURST = 24
PROMPT_WORDS = 300  # about 300 tokens each: the burst is several seconds of prefill for a 0.3 s target


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    # admission by capacity on for `llm`: margin 1, 0.3 s TTFT
    parameters = {"admission.margin": "1", "slo.ttft_s": "0.3"}
    repository = repository_with_llm_parameters(tmp_path_factory.mktemp("admission"), parameters)
    return triton_factory.start(repository, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def test_a_burst_beyond_capacity_is_refused_fast_and_the_admitted_are_served(server: TritonServer) -> None:
    streams = prompt_burst(server, BURST, PROMPT_WORDS)  # the watcher's probes feed admission
    try:
        results = [read_stream(stream, 120) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    served = [r for r in results if r.error is None]
    refused = [r for r in results if r.error is not None]
    assert all(r.final and r.pieces for r in served), "every admitted request ran to its end"
    assert served, "an empty pool always takes a request"
    assert refused, "a burst of several seconds of prefill for a 0.3 s target was admitted whole"
    for result in refused:
        assert re.search("over capacity|warming up", result.error) and "retry after" in result.error
        assert not result.pieces, "a refusal comes before any token"
    samples = scrape_metrics(server.config.metrics_url)
    # the code (the stream's error carries only the message): counted UNAVAILABLE, each of them
    counted = metric_sum(samples, "disagg_requests_total", model="llm", outcome="unavailable")
    assert counted == len(refused), f"{counted} refusals counted UNAVAILABLE for {len(refused)}"

    def idle() -> bool:
        gauges = pool_gauges(server)
        return not any(v for k, v in gauges.items() if k[0] != "disagg_kv_blocks_free")

    wait_until(idle, 30, "no KV block in use and no sequence active once the burst is over")
