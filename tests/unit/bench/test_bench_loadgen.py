"""The load generator against a fake streaming server: open-loop sends, recorded times, timeouts,
calibration by rule; plus the report and plots rendered from a results dict."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from bench_fake_openai import FakeOpenAIServer

from perf.benchlib.clients import ClientConfig, OpenAIClient, StreamOutcome, triton_inputs
from perf.benchlib.loadgen import LoadConfig, retry_hint, run_clients, run_trace
from perf.benchlib.metrics import Slo, summarize
from perf.benchlib.slo import TPOT_FACTOR, TTFT_FACTOR, calibrate
from perf.benchlib.workload import WORKLOADS, PromptFactory, RequestSpec, build_trace


@pytest.fixture(scope="module")
def factory(tiny_model_dir) -> PromptFactory:
    return PromptFactory.from_model_dir(tiny_model_dir)


def specs(arrivals: list[float], tokens: int) -> list[RequestSpec]:
    return [RequestSpec(i, a, f"p{i}: hello", 5, tokens) for i, a in enumerate(arrivals)]


async def replay(server: FakeOpenAIServer, trace, load: LoadConfig | None = None):
    client = OpenAIClient(ClientConfig("openai", server.url, "fake"))
    await client.open()
    try:
        return await run_trace(client, trace, load or LoadConfig(drain_timeout_s=10), lambda text: 0)
    finally:
        await client.close()


def test_sends_follow_the_schedule_even_when_the_server_is_slow():
    # Each request takes ~1.4 s to serve; they are due every 25 ms. A closed-loop sender would need
    # 20 x 1.4 s; an open-loop one sends all 20 within the first half second. The bounds sit between
    # the two by a wide margin, so a loaded machine's scheduling jitter does not decide the outcome.
    arrivals = [i * 0.025 for i in range(20)]

    async def main():
        async with FakeOpenAIServer(first_delay_s=1.0, token_delay_s=0.04) as server:
            started = time.perf_counter()
            records = await replay(server, specs(arrivals, 10))
            return records, server.arrivals, time.perf_counter() - started

    records, received, elapsed = asyncio.run(main())
    assert elapsed < 10.0  # closed loop: >= 28 s
    assert all(r.ok for r in records)
    assert max(r.send_lag for r in records) < 0.5  # closed loop: the last one >= 26 s late
    # Seen from the server: requests came in at the scheduled spacing, not one per service time.
    received = sorted(received)
    offsets = [t - received[0] for t in received]
    assert offsets == pytest.approx(arrivals, abs=0.3)
    for r in records:
        assert r.n_pieces == r.n_tokens == 10  # usage-reported count
        assert r.ttft >= 1.0
        assert 0.03 <= r.tpot <= 0.3  # tokens 40 ms apart on the server


def test_records_feed_the_summary():
    async def main():
        async with FakeOpenAIServer(first_delay_s=0.05, token_delay_s=0.01) as server:
            return await replay(server, specs([0.0, 0.05, 0.1], 4))

    records = asyncio.run(main())
    summary = summarize(records, Slo(ttft_s=1.0, tpot_s=1.0))
    assert summary.n_ok == summary.n_meeting == 3
    assert summary.attainment == 1.0
    assert summary.token_throughput > 0


def test_unfinished_streams_time_out_and_late_requests_are_not_sent():
    async def main():
        async with FakeOpenAIServer(token_delay_s=0.0, hang=True) as server:
            load = LoadConfig(max_duration_s=1.0, drain_timeout_s=0.3)
            return await replay(server, specs([0.0, 0.01, 5.0], 2), load)

    records = asyncio.run(main())
    assert [r.error for r in records] == ["timeout", "timeout", "not sent"]
    assert summarize(records, Slo(1.0, 1.0)).attainment == 0.0


def test_server_error_is_a_failed_request_not_a_crash():
    async def main():
        client = OpenAIClient(ClientConfig("openai", "http://127.0.0.1:9", "fake"))  # nothing listens
        await client.open()
        try:
            return await run_trace(client, specs([0.0], 2), LoadConfig(drain_timeout_s=5), len)
        finally:
            await client.close()

    (record,) = asyncio.run(main())
    assert not record.ok and record.error


def test_calibration_applies_the_rule(factory):
    async def main():
        async with FakeOpenAIServer(first_delay_s=0.05, token_delay_s=0.02) as server:
            client = OpenAIClient(ClientConfig("openai", server.url, "fake"))
            await client.open()
            try:
                cal = await calibrate(client, WORKLOADS["codegen"], factory, "fake", reps=2, warmup=0)
            finally:
                await client.close()
            return cal, server.bodies

    cal, bodies = asyncio.run(main())
    assert cal.prompt_tokens == 300
    assert all(factory.count(b["prompt"]) == 300 for b in bodies)
    assert all(b["ignore_eos"] and b["min_tokens"] == b["max_tokens"] for b in bodies)
    assert cal.idle_ttft_s >= 0.05
    assert cal.idle_tpot_s == pytest.approx(0.02, abs=0.015)
    assert cal.slo.ttft_s == pytest.approx(TTFT_FACTOR * cal.idle_ttft_s)
    assert cal.slo.tpot_s == pytest.approx(TPOT_FACTOR * cal.idle_tpot_s)


def test_client_config_refuses_non_loopback_targets():
    with pytest.raises(ValueError):
        ClientConfig("openai", "http://10.0.0.1:8000", "m")
    with pytest.raises(ValueError):
        ClientConfig("triton", "example.com:8001", "ensemble")
    ClientConfig("triton", "127.0.0.1:8001", "ensemble")


def test_triton_inputs_follow_the_ensemble_contract(factory):
    (spec,) = build_trace(WORKLOADS["codegen"], factory, 1.0, 1, seed=0, salt="ta")
    tensors = {t.name(): t for t in triton_inputs(spec)}
    assert {n: t.datatype() for n, t in tensors.items()} == {
        "text_input": "BYTES", "max_tokens": "INT32", "min_length": "INT32", "stream": "BOOL",
        "temperature": "FP32", "top_k": "INT32", "top_p": "FP32", "random_seed": "UINT64",
        "exclude_input_in_output": "BOOL",
    }  # fmt: skip
    assert all(t.shape() == [1, 1] for t in tensors.values())
    for name in ("max_tokens", "min_length"):  # exact output length: min = max
        assert np.frombuffer(tensors[name]._get_content(), dtype=np.int32).tolist() == [spec.output_tokens]


def test_token_count_modes():
    from perf.benchlib.clients import StreamOutcome, output_tokens

    done = StreamOutcome(0.0, 0.1, 0.5, 4, "abcdef", 5, None)
    failed = StreamOutcome(0.0, 0.1, 0.5, 4, "abcdef", None, "boom")
    assert output_tokens(done, "reported", len, 7) == 5
    assert output_tokens(done, "requested", len, 7) == 7  # min = max output tokens forces the count
    assert output_tokens(failed, "requested", len, 7) == 4  # a broken stream: what was seen
    assert output_tokens(done, "pieces", len, 7) == 4
    assert output_tokens(done, "retokenize", len, 7) == 6
    assert ClientConfig("triton", "127.0.0.1:1", "m").count_mode == "requested"
    assert ClientConfig("openai", "http://127.0.0.1:1", "m").count_mode == "reported"


def test_search_stops_probing_past_its_deadline(factory):
    from perf.benchlib.experiment import RunPlan, search_goodput
    from perf.benchlib.search import SearchConfig

    async def main():
        async with FakeOpenAIServer(token_delay_s=0.0) as server:
            client = OpenAIClient(ClientConfig("openai", server.url, "fake"))
            await client.open()
            try:
                plan = RunPlan(duration_s=0.2, min_requests=2, max_requests=4, drain_timeout_s=5)
                search = SearchConfig(start=10.0, max_probes=8)
                # A deadline already passed: no probe starts, and the search reports nothing passed.
                deadline = time.monotonic()
                return await search_goodput(
                    client, WORKLOADS["decode"], factory, Slo(5.0, 5.0), search, plan, 2, None, deadline
                )
            finally:
                await client.close()

    result = asyncio.run(main())
    assert result.runs == []
    assert result.best_rate == 0.0


class ClosedLoopServer:
    """A StreamClient whose requests each take `service_s`; a request whose prompt says "refuse" is
    refused at once with a retry hint. Records how many run at once."""

    def __init__(self, service_s: float, hint: str = "retry after 0.2 s") -> None:
        self.config = ClientConfig("triton", "127.0.0.1:1", "ensemble")
        self.service_s, self.hint = service_s, hint
        self.running = self.most = 0
        self.sent: list[tuple[str, float]] = []

    async def stream(self, spec: RequestSpec) -> StreamOutcome:
        sent = time.perf_counter()
        self.sent.append((spec.prompt, sent))
        if "refuse" in spec.prompt:
            return StreamOutcome(
                sent, None, None, 0, "", None, f"UNAVAILABLE: over capacity; {self.hint}", sent
            )
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(self.service_s)
        self.running -= 1
        now = time.perf_counter()
        return StreamOutcome(sent, now, now, 1, "x", 1, None, now)


def test_closed_loop_clients_send_back_to_back_and_stop_at_the_end():
    server = ClosedLoopServer(service_s=0.05)
    prompts = iter(RequestSpec(0, 0.0, f"p{i}", 5, 1) for i in range(10_000))
    load = LoadConfig(max_duration_s=0.6, drain_timeout_s=5, start_delay_s=0)
    records = asyncio.run(run_clients(server, prompts, 3, load, len))
    assert server.most == 3  # never more in flight than clients
    assert 3 * 6 <= len(records) <= 3 * 13  # each client ~12 back to back in 0.6 s; none after the end
    assert [r.arrival for r in records] == sorted(r.arrival for r in records)
    assert sorted(r.index for r in records) == list(range(len(records)))
    assert all(r.ok for r in records) and max(r.arrival for r in records) < 0.6


def test_a_refused_client_waits_its_retry_hint_unless_told_not_to():
    def refusals(honour: bool) -> list[float]:
        server = ClosedLoopServer(service_s=0.0)
        prompts = iter(RequestSpec(0, 0.0, "refuse me", 5, 1) for _ in range(100_000))
        load = LoadConfig(max_duration_s=0.5, drain_timeout_s=5, start_delay_s=0)
        records = asyncio.run(run_clients(server, prompts, 1, load, len, honour_retry=honour))
        assert all(r.error and r.first_token is None for r in records)
        return [b - a for (_, a), (_, b) in zip(server.sent, server.sent[1:], strict=False)]

    honoured = refusals(True)
    assert 2 <= len(honoured) + 1 <= 3 and min(honoured) >= 0.2  # one every 0.2 s
    assert len(refusals(False)) > 20  # straight back


def test_retry_hints_are_read_from_the_refusal_and_capped():
    assert retry_hint("server is over capacity: predicted 3.1 s exceeds 2 x 1 s; retry after 1.5 s") == 1.5
    assert retry_hint("retry after 90 s") == 60.0
    assert retry_hint("KV cache is full, retry later") == 0.0 and retry_hint(None) == 0.0
