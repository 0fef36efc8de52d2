"""Admission by capacity on a real Triton (RELIABILITY E1 in small): a burst far above what the
prefill pool can serve within the TTFT target gets its excess refused UNAVAILABLE with a retry hint,
while what was admitted is served to its end, and nothing is left behind. The run that measures
refusal latency and goodput under a 60 s overload is `perf/overload.py`."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from serving_support import REPOSITORY, pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer

BURST = 24
PROMPT_WORDS = 300  # about 300 tokens each: the burst is several seconds of prefill for a 0.3 s target


def _with_admission(tmp_path: Path) -> Path:
    """The project's repository with admission by capacity on for `llm` (margin 1, 0.3 s TTFT)."""
    copy = tmp_path / "repository"
    shutil.copytree(REPOSITORY, copy)
    config = copy / "llm" / "config.pbtxt"
    entries = "".join(
        f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n'
        for key, value in (("admission_margin", "1"), ("slo_ttft_s", "0.3"))
    )
    text = re.sub(r'  \{ key: "slo_ttft_s"[^\n]*\n', "", config.read_text())
    config.write_text(text.replace("parameters [\n", "parameters [\n" + entries, 1))
    return copy


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    return triton_factory.start(_with_admission(tmp_path_factory.mktemp("admission")), exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def test_a_burst_beyond_capacity_is_refused_fast_and_the_admitted_are_served(server: TritonServer) -> None:
    with GrpcStream(server.config.grpc_url) as first:  # starts the watcher: its probes feed admission
        first.send("llm", text_inputs("Hello world", 4, stream=True))
        assert read_stream(first, 60).final
    streams = [GrpcStream(server.config.grpc_url) for _ in range(BURST)]
    try:
        for i, stream in enumerate(streams):
            prompt = " ".join(f"w{i}x{j}" for j in range(PROMPT_WORDS))
            stream.send("llm", text_inputs(prompt, 4, stream=True))
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
