"""Conditional disaggregation on a real Triton: with the rule on (`disagg repository
--conditional-prefill-tokens`), a short prompt is served whole by the decode pool through BLS, counted
as the route disaggregated -> conditional, with the engine's text, and nothing is left behind. The
side-by-side measurement is `perf/conditional.py`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from serving_support import engine_texts, pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer
from disagg_tools.repository import main as write_repository

PROMPT, MAX_TOKENS = "Hello world", 8


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    """The rule on for prompts of up to 64 tokens, whenever the prefill pool's predicted TTFT is above
    0 s: every short request once the watcher has the prefill pool's speed."""
    out = tmp_path_factory.mktemp("conditional") / "repository"
    # float32: the text is compared with the engine's token for token, on any CPU (bf16 may differ in
    # the last bits between a chunked prefill and the reference's whole one on some machines)
    command = ["--out", str(out), "--dtype", "float32", "--conditional-prefill-tokens", "64"]
    assert write_repository(command) == 0
    config = out / "llm" / "config.pbtxt"
    entry = '  { key: "conditional.backlog_s", value: { string_value: "0" } },\n'
    config.write_text(re.sub(r"parameters \[\n", "parameters [\n" + entry, config.read_text(), count=1))
    return triton_factory.start(out, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _routed(server: TritonServer) -> float:
    samples = scrape_metrics(server.config.metrics_url)
    return metric_sum(samples, "disagg_fallbacks_total", model="llm", to="conditional")


def test_a_short_prompt_is_served_whole_by_the_decode_pool(server: TritonServer, tmp_path: Path) -> None:
    expected = engine_texts([PROMPT], MAX_TOKENS, dtype="float32")[PROMPT]
    texts: list[str] = []

    def served_on_decode() -> bool:  # the first requests go the normal way until a probe has answered
        before = _routed(server)
        with GrpcStream(server.config.grpc_url) as stream:
            stream.send("llm", text_inputs(PROMPT, MAX_TOKENS, stream=True))
            result = read_stream(stream, 60)
        assert result.error is None and result.final, result
        texts.append("".join(result.pieces))
        return _routed(server) == before + 1

    wait_until(served_on_decode, 30, "a request routed to the decode pool")
    assert texts[-1] == expected, "the decode pool's prefill gives the engine's text"
    assert all(text == texts[-1] for text in texts), "the same text on either path"

    def idle() -> bool:
        return not any(v for k, v in pool_gauges(server).items() if k[0] != "disagg_kv_blocks_free")

    wait_until(idle, 30, "no KV block in use and no sequence active")
