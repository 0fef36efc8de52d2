"""The serving stack on the project's model repository, on one real Triton for the whole module:
greedy text of every entry point against the engine, concurrency, cancellation, bad input
(RELIABILITY.md A1-A6) and, last, SIGTERM with streams in flight. Text equality under concurrency runs
on a second server whose pools compute in float32 (`fp32_server`): bfloat16 steps are not
batch-invariant."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serving_support import (
    NO_ADMISSION,
    cancel_after,
    engine_greedy,
    engine_texts,
    generate,
    generate_stream,
    group_rss,
    grpc_error,
    grpc_stream,
    idle_gauges,
    metric_samples,
    metric_sum,
    pool_gauges,
    read_stream,
    repository_with_parameters,
    stream_with_deadline,
    text_inputs,
)
from triton_support import (
    REPO_ROOT,
    GrpcStream,
    LeakProbe,
    TritonFactory,
    http_json,
    live_group_members,
    shm_entries,
    wait_until,
)

from disagg.engine.params import SamplingParams
from disagg.engine.sequence import SequenceState
from disagg.kv.secret import load_secret
from disagg.protocol.messages import Failed
from disagg.server import TritonServer
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.triton import wire

MAX_TOKENS = 12
PROMPTS = ("Hello world", "naïve café — 日本語 🙂")
TEXT_MODELS = ("ensemble", "llm")


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    # admission off: a hundred streams at once and the cancel storm load the pools past its bound on
    # purpose (tests/integration/test_serving_admission.py tests it)
    repository = repository_with_parameters(tmp_path_factory.mktemp("serving"), NO_ADMISSION)
    return triton_factory.start(repository, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    """The server's Python backend regions grow on demand and stay until it exits; KV regions and
    everything else stay under the leak probe."""
    leak_probe.ignore_shm(server.config.shm_prefix)


@pytest.fixture(scope="module")
def fp32_server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    """The project's repository with float32 pools (`disagg repository --dtype float32`), for text
    equality under concurrency (see `test_sixteen_concurrent_fp32_streams_equal_the_fp32_engine`)."""
    out = tmp_path_factory.mktemp("fp32_repository")
    disagg = Path(sys.executable).parent / "disagg"
    command = [str(disagg), "repository", "--dtype", "float32", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return triton_factory.start(out, exit_timeout_s=10)


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return engine_texts(PROMPTS, MAX_TOKENS)


# ---- 1. greedy text ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["ensemble", "llm", "ensemble_colocated"])
def test_greedy_text_equals_the_engine_on_every_protocol(
    server: TritonServer, expected: dict[str, str], model: str
) -> None:
    """One request at a time on idle pools, so every step runs at batch size 1 as in the bfloat16
    oracle: bit for bit the same computation (a step batched with other sequences is not, see the
    concurrency tests)."""
    for prompt in PROMPTS:
        text = expected[prompt]
        body = {"text_input": prompt, "max_tokens": MAX_TOKENS}
        idle_gauges(server)
        status, reply = generate(server, model, body)
        assert status == 200, reply
        assert reply["text_output"] == prompt + text, "unary text_output is prompt + generated text"
        status, reply = generate(server, model, {**body, "exclude_input_in_output": True})
        assert (status, reply["text_output"]) == (200, text)
        sse = [event["text_output"] for event in generate_stream(server, model, body)]
        assert "".join(sse) == text, sse
        streamed = grpc_stream(server, model, text_inputs(prompt, MAX_TOKENS, stream=True))
        assert streamed.error is None and streamed.final
        assert "".join(streamed.pieces) == text, streamed.pieces
        assert all(prompt not in piece for piece in streamed.pieces), (
            "streamed pieces never repeat the prompt"
        )
        assert "".join(sse) == "".join(streamed.pieces)


# ---- 2. concurrency ---------------------------------------------------------------------------------

STREAMS = 16
OVERLAP_TOKENS = 48
"""Output length of the concurrency tests. The 16 prompts are prefilled one after another, so their
decodes share steps only while one decode outlasts several prefills: with 47 decode steps per stream,
while a prefill takes under ~20 decode steps. Seen under a concurrent test's load: a prefill took ~6
decode steps, and 16 streams of 12 tokens shared too few (113 steps for 176 alone)."""
FP32_BATCH_NOISE = 1e-3
"""Bound on how far a float32 logit moves between batch sizes, with a wide margin: measured here, a
decode step over 16 sequences and the same steps one sequence at a time differ by at most 2e-5 (logits
of magnitude ~3). A greedy choice can flip only where the two best logits are closer than that."""


def concurrent_streams(server: TritonServer, prompts: list[str], **extra: Any) -> list[Any]:
    """Send one `ensemble` request of `OVERLAP_TOKENS` per prompt, each on its own gRPC stream, all
    before reading any; read each to its end. Returns the results in prompt order."""
    streams = [GrpcStream(server.config.grpc_url) for _ in prompts]
    try:
        for stream, prompt in zip(streams, prompts, strict=True):
            stream.send("ensemble", text_inputs(prompt, OVERLAP_TOKENS, stream=True, **extra))
        return [read_stream(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.close()


def output_tokens(server: TritonServer, model: str) -> tuple[float, float]:
    """(requests, output tokens) the entry point `model` has recorded so far."""
    count = metric_sum(server, "disagg_output_tokens_count", model=model)
    return count, metric_sum(server, "disagg_output_tokens_sum", model=model)


def tokens_since(server: TritonServer, model: str, before: tuple[float, float], requests: int) -> float:
    """Output tokens of the next `requests` requests recorded by `model` after `before`."""
    wait_until(
        lambda: output_tokens(server, model)[0] == before[0] + requests,
        10,
        f"the {requests} requests recorded",
    )
    return output_tokens(server, model)[1] - before[1]


def decode_steps(server: TritonServer) -> float:
    return metric_sum(server, "disagg_engine_steps_total", model="decode")


def assert_shared_steps(server: TritonServer, steps_before: float, alone: int) -> None:
    """The decode pool stepped at most half as often as the streams would alone (`alone`: one step per
    token after each stream's first): on average two or more streams shared each step."""
    idle_gauges(server)  # the pools' counters are published with their gauges: read after the last step
    stepped = decode_steps(server) - steps_before
    assert 0 < stepped <= alone / 2, f"{stepped} decode steps: the streams barely shared any ({alone} alone)"


def test_sixteen_concurrent_streams_complete_and_overlap(server: TritonServer) -> None:
    """The bfloat16 pools under 16 concurrent streams: what they promise, not the oracle's text.

    A bfloat16 decode step over a batch is not bit-identical to the same step at another batch size
    (the kernels' blocking, hence the rounding, depend on the batch), and bfloat16 greedy logits tie
    or nearly tie often (8 bits of mantissa): a stream's text may leave the single-stream text at any
    decode step, and whether it does depends on which streams share its steps (seen: 1 of 16 through
    the server; 8 of 16 when the engine steps all 16 together from the first token).
    Guaranteed, and checked: every stream ends with a final response and no error, produces exactly
    `max_tokens` tokens (`min_length` rules out an early end token), and starts with its own prompt's
    first piece (prefill runs each prompt alone, as the oracle does: no cross-talk between streams);
    the streams share decode steps (counted, not timed). Text equality under concurrency is checked on
    float32 pools (next)."""
    oracle = engine_greedy(PROMPTS, OVERLAP_TOKENS, min_length=OVERLAP_TOKENS)
    assert len({greedy.first_piece for greedy in oracle.values()}) == len(PROMPTS), (
        "the prompts' first pieces must differ, or a stream answered with the other prompt goes unseen"
    )
    prompts = [PROMPTS[i % 2] for i in range(STREAMS)]
    min_length = np.array([[OVERLAP_TOKENS]], dtype=np.int32)
    idle_gauges(server)
    before = output_tokens(server, "orchestrator")
    steps = decode_steps(server)
    results = concurrent_streams(server, prompts, min_length=min_length)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final, result
        assert "".join(result.pieces).startswith(oracle[prompt].first_piece), (prompt, result.pieces)
    produced = tokens_since(server, "orchestrator", before, STREAMS)
    assert produced == STREAMS * OVERLAP_TOKENS, "every stream produced exactly max_tokens tokens"
    assert_shared_steps(server, steps, STREAMS * (OVERLAP_TOKENS - 1))


HUNDRED = 100
LONG_TOKENS = 64


def test_a_hundred_concurrent_llm_streams_all_complete(server: TritonServer) -> None:
    """More concurrent streams than the decode batch holds (64): the hand-offs beyond it wait for a
    slot (the decode scheduler's capacity limit) instead of failing. Every stream ends with a final
    response, no error, and exactly `max_tokens` tokens (`min_length` rules out an early end)."""
    idle_gauges(server)
    before = output_tokens(server, "llm")
    min_length = np.array([[LONG_TOKENS]], dtype=np.int32)
    streams = [GrpcStream(server.config.grpc_url) for _ in range(HUNDRED)]
    try:
        for n, stream in enumerate(streams):
            stream.send(
                "llm", text_inputs(f"{PROMPTS[n % 2]} {n}", LONG_TOKENS, stream=True, min_length=min_length)
            )
        results = [read_stream(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    failed = [(n, r.error) for n, r in enumerate(results) if r.error is not None or not r.final]
    assert not failed, f"{len(failed)} of {HUNDRED} streams failed: {failed[:3]}"
    produced = tokens_since(server, "llm", before, HUNDRED)
    assert produced == HUNDRED * LONG_TOKENS, "every stream produced exactly max_tokens tokens"
    idle_gauges(server)  # every block back, no active sequence left on any pool


def test_sixteen_concurrent_fp32_streams_equal_the_fp32_engine(
    fp32_server: TritonServer, leak_probe: LeakProbe
) -> None:
    """Greedy text under concurrency equals the single-stream engine's, on float32 pools.

    float32 is not bit-for-bit batch-invariant either, but its differences between batch sizes are
    some 1e-5 (bounded by `FP32_BATCH_NOISE`): a greedy choice flips only at a near-exact tie. The premise is
    checked on the oracle itself (no step of these prompts is that close), so a change of model or
    prompts that makes it false fails here by name instead of flipping a stream's text now and then.
    The streams share decode steps (counted), or the test would not be testing batching."""
    leak_probe.ignore_shm(fp32_server.config.shm_prefix)
    oracle = engine_greedy(PROMPTS, OVERLAP_TOKENS, dtype="float32")
    for prompt, greedy in oracle.items():
        assert greedy.margin is not None and greedy.margin > FP32_BATCH_NOISE, (
            f"float32 oracle of {prompt!r} has a near-tie (margin {greedy.margin:.1e}): pick other prompts"
        )
    prompts = [PROMPTS[i % 2] for i in range(STREAMS)]
    idle_gauges(fp32_server)
    steps = decode_steps(fp32_server)
    results = concurrent_streams(fp32_server, prompts)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final, result
        assert "".join(result.pieces) == oracle[prompt].text, (prompt, result.pieces)
    assert_shared_steps(fp32_server, steps, sum(len(oracle[prompt].token_ids) - 1 for prompt in prompts))


# ---- 3. cancellation --------------------------------------------------------------------------------


def _long_stream(server: TritonServer, model: str, max_tokens: int) -> GrpcStream:
    stream = GrpcStream(server.config.grpc_url)
    stream.send(model, text_inputs("Hello world", max_tokens, stream=True))
    for _ in range(3):
        event = stream.next(30)
        assert event.error is None and not event.final, event
    return stream


def test_cancelled_llm_stream_stops_decode_and_frees_both_pools(server: TritonServer) -> None:
    baseline = idle_gauges(server)
    cancelled = metric_sum(server, "disagg_requests_total", model="llm", outcome="cancelled")
    # 1500 tokens take ~20 s to decode here: the pools are back far sooner only if decode was stopped
    result = cancel_after(server.config.grpc_url, "llm", 1500, pieces=5)
    cancelled_at = time.monotonic()
    assert result["errors"] == []
    wait_until(lambda: idle_now(server, baseline), 5, "both pools back to their baseline")
    assert time.monotonic() - cancelled_at < 5
    wait_until(
        lambda: (
            metric_sum(server, "disagg_requests_total", model="llm", outcome="cancelled") == cancelled + 1
        ),
        5,
        "cancel counted",
    )
    wait_until(lambda: calls_open(server, "llm") == 0, 5, "no call to a pool left open")


def test_c5_a_client_deadline_cancels_the_work_and_the_next_request_is_served(
    server: TritonServer, expected: dict[str, str]
) -> None:
    """RELIABILITY C5: a stream whose client deadline (2 s) passes mid-generation ends DEADLINE_EXCEEDED
    at the client; the server sees the cancel and stops its work (both pools back to their baseline,
    far sooner than the 1500 tokens would take); the next request is served whole."""
    baseline = idle_gauges(server)
    result = stream_with_deadline(server.config.grpc_url, "llm", 1500, deadline_s=2.0)
    assert result["pieces"] > 0 and "deadline" in result["error"].lower(), result
    wait_until(lambda: idle_now(server, baseline), 10, "both pools back to their baseline")
    wait_until(lambda: calls_open(server, "llm") == 0, 5, "no call to a pool left open")
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": MAX_TOKENS})
    assert status == 200 and reply["text_output"] == "Hello world" + expected["Hello world"], reply


def calls_open(server: TritonServer, model: str) -> float | None:
    """The entry point's `disagg_pool_calls_open` (summed over its instances); None while absent."""
    values = [v for name, labels, v in metric_samples(server) if name == "disagg_pool_calls_open"
              and labels.get("model") == model]  # fmt: skip
    return sum(values) if values else None


def test_a_stream_ended_by_a_stop_word_leaves_no_call_open(
    server: TritonServer, expected: dict[str, str]
) -> None:
    """A stop word ends the output early: the orchestrator stops the decode sequence and drains its
    call to the pool's final response (on Triton 2.51 a pool that ended it with an error response
    would leave the call, and a thread, waiting forever; the stub could then not exit)."""
    words = expected["Hello world"].split()
    assert len(words) >= 3, expected  # the stop word comes from decode, not with the first token
    body = {"text_input": "Hello world", "max_tokens": 300, "stop_words": words[1]}
    status, stopped = generate(server, "llm", body)
    assert status == 200, stopped
    assert stopped["text_output"].startswith("Hello world") and words[1] not in stopped["text_output"]
    assert wait_until(lambda: calls_open(server, "llm") == 0, 5, "no call to a pool left open")


@pytest.mark.parametrize("model", ["ensemble", "llm", "ensemble_colocated"])
def test_an_empty_answer_is_an_answer(server: TritonServer, expected: dict[str, str], model: str) -> None:
    """A stop word that is the answer's first characters leaves nothing to say: unary `generate` still
    gets its one response, with an empty text and finish reason "stop" (a final response with flags
    alone was no response at all, and Triton failed the request). The end token first, on the real
    model: test_real_model.py."""
    first = expected["Hello world"][:3]
    assert first.strip(), expected
    body = {
        "text_input": "Hello world",
        "max_tokens": 16,
        "stop_words": first,
        "exclude_input_in_output": True,
    }
    if model == "llm":  # the ensembles carry the TensorRT-LLM tensors, without finish_reason
        body["return_finish_reason"] = True
    status, reply = generate(server, model, body)
    assert status == 200, reply
    assert reply["text_output"] == "" and reply.get("finish_reason", "stop") == "stop", reply
    events = generate_stream(server, model, body)
    assert "".join(event.get("text_output", "") for event in events) == "", events


def idle_now(server: TritonServer, baseline: dict[tuple[str, str], float]) -> bool:
    gauges = pool_gauges(server)
    return all(gauges.get(key) == value for key, value in baseline.items())


def test_requests_cancelled_at_random_moments_leave_nothing_behind(
    server: TritonServer, tmp_path: Path
) -> None:
    """RELIABILITY C1, C2, C4 and C6 in small: 48 `llm` streams, some with long prompts, each cancelled
    after a random delay (before dispatch, queued, being prefilled, mid-stream). `perf/cancel_storm.py`
    (also the 1,000-request run) checks the pools' queues, sequences, KV blocks and the open pool calls
    come back to where they were and no request is counted twice; a separate process, because
    tritonclient keeps a thread alive after a cancelled stream."""
    # the storm's baseline is the gauges when it starts: the previous test's sequence must be gone
    # from them first (seen: a baseline with one decode sequence still published, never met again)
    idle_gauges(server)
    command = [sys.executable, "-m", "perf.cancel_storm", "--grpc-url", server.config.grpc_url]
    command += ["--metrics-url", server.config.metrics_url, "--requests", "48", "--concurrency", "8"]
    command += ["--max-delay-s", "0.6", "--seed", "7", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, check=False, cwd=REPO_ROOT)
    report = json.loads((tmp_path / "cancel_storm.json").read_text()) if done.returncode in (0, 1) else {}
    assert done.returncode == 0, (report, done.stderr[-3000:])
    reached = report["cancelled_mid_stream"] + report["finished_before_cancel"]
    assert report["clean"] and reached <= report["counted"] <= 48 and report["leftover"] == {}, report
    # the storm did cancel requests both before their first piece and mid-stream
    assert report["cancelled_before_first_piece"] > 0 and report["cancelled_mid_stream"] > 0, report


def test_cancelled_ensemble_stream_costs_at_most_its_max_tokens(server: TritonServer) -> None:
    """On Triton 2.51 an ensemble client's cancel does not reach the running orchestrator step: the
    request runs to its own max_tokens, then nothing is left behind."""
    max_tokens = 120
    baseline = idle_gauges(server)
    produced = metric_sum(server, "disagg_output_tokens_sum", model="orchestrator")
    cancel_after(server.config.grpc_url, "ensemble", max_tokens, pieces=3)
    wait_until(lambda: idle_now(server, baseline), 60, "pools back to baseline after the request's end")
    wait_until(
        lambda: metric_sum(server, "disagg_output_tokens_sum", model="orchestrator") > produced,
        10,
        "request recorded",
    )
    cost = metric_sum(server, "disagg_output_tokens_sum", model="orchestrator") - produced
    assert 0 < cost <= max_tokens


# ---- 4. bad input (RELIABILITY.md A) ----------------------------------------------------------------


def refused(server: TritonServer, model: str, body: Any, *needles: str) -> str:
    """POST `body` to `generate`; assert 400 and an error naming each needle; return the message."""
    status, reply = generate(server, model, body)
    assert status == 400, (status, reply)
    message = reply["error"]
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a1_missing_or_empty_text_input(server: TritonServer, model: str) -> None:
    refused(server, model, {"max_tokens": 4}, "missing required input", "text_input")
    refused(server, model, {"text_input": "", "max_tokens": 4}, "'text_input' is empty")


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a2_wrong_dtype_or_shape(server: TritonServer, model: str) -> None:
    refused(server, model, {"text_input": ["a", "b"], "max_tokens": 4}, "text_input", "batch size")
    values = text_inputs("hi", 4)
    values["max_tokens"] = np.array([[4.0]], dtype=np.float32)
    assert "'max_tokens' data-type is 'FP32'" in grpc_error(server, model, values)
    values = text_inputs("hi", 4)
    values["text_input"] = np.array([[b"a"], [b"b"]], dtype=np.object_)
    values["max_tokens"] = np.array([[4], [4]], dtype=np.int32)
    assert "'text_input' must hold exactly one value" in grpc_error(server, model, values)


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a3_context_and_max_tokens_limits(server: TritonServer, model: str) -> None:
    baseline = idle_gauges(server)
    refused(server, model, {"text_input": "hello " * 3000, "max_tokens": 4}, "context of 2048 tokens")
    refused(server, model, {"text_input": "hi", "max_tokens": 0}, "max_tokens must be in [1, 2048]")
    refused(server, model, {"text_input": "hi", "max_tokens": 5000}, "max_tokens must be in [1, 2048]")
    refused(server, model, {"text_input": "hello " * 1000, "max_tokens": 2000}, "exceeds the model's context")
    assert idle_now(server, baseline), "no KV blocks allocated"


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a4_sampling_ranges_and_unknown_fields(server: TritonServer, model: str) -> None:
    base = {"text_input": "hi", "max_tokens": 4}
    refused(server, model, {**base, "temperature": -0.5}, "temperature must be finite and >= 0")
    refused(server, model, {**base, "top_p": 0.0}, "top_p must be in (0, 1]")
    refused(server, model, {**base, "top_p": 1.5}, "top_p must be in (0, 1]")
    refused(server, model, {**base, "top_k": -1}, "top_k must be in [0, ")
    refused(server, model, {**base, "temprature": 0.5}, "unknown parameter(s) ['temprature']")
    for bad in (math.nan, math.inf):
        values = text_inputs("hi", 4, temperature=np.array([[bad]], dtype=np.float32))
        assert "'temperature' must be finite" in grpc_error(server, model, values)


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_unimplemented_inputs_refused_unless_neutral(server: TritonServer, model: str) -> None:
    base = {"text_input": "hi", "max_tokens": 4}
    refused(server, model, {**base, "beam_width": 2}, "'beam_width' is not supported")
    refused(server, model, {**base, "repetition_penalty": 1.3}, "'repetition_penalty' is not supported")
    status, reply = generate(server, model, {**base, "beam_width": 1, "repetition_penalty": 1.0})
    assert status == 200, reply


def _post_raw(server: TritonServer, model: str, data: bytes) -> tuple[int, str]:
    url = f"http://{server.config.http_url}/v2/models/{model}/generate"
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_a5_invalid_utf8_and_nul(server: TritonServer, model: str) -> None:
    status, text = _post_raw(server, model, b'{"text_input": "ab\xff\xfe", "max_tokens": 4}')
    assert (status, json.loads(text)["error"].endswith("input 'text_input' is not valid UTF-8")) == (
        400,
        True,
    )
    refused(
        server, model, {"text_input": "ab\u0000cd", "max_tokens": 4}, "'text_input' contains a NUL character"
    )
    assert "is not valid UTF-8" in grpc_error(server, model, text_inputs(b"ab\xff\xfe", 4))
    assert "contains a NUL character" in grpc_error(server, model, text_inputs(b"ab\x00cd", 4))


def test_a5_ten_megabyte_prompts_leave_memory_stable(server: TritonServer) -> None:
    """Refused 10 MB prompts do not accumulate. After a warm-up of each kind of request (the Python
    backend's shared-memory regions grow once to hold a request), forty more (400 MB sent):
    - the stubs, where this project's code runs, must not grow by more than a small fraction of that:
      a request kept alive by a reference cycle costs 10 MB each (seen: +640 MiB);
    - tritonserver's own frontends buffer each request in glibc's per-thread arenas, which keep their
      high-water mark, which depends on how many of its threads earlier tests used (seen: +5 to +16
      MiB, all in tritonserver; once +63 MiB in a whole-suite run, then not split by process); a
      request Triton itself kept would cost 10 MB each, so its bound is half of the forty's 400 MB."""
    big = "x" * (10 << 20)

    def send_each_kind() -> None:
        for model in ("llm", "ensemble"):
            refused(server, model, {"text_input": big, "max_tokens": 4}, "larger than 1048576 bytes")
            assert "larger than" in grpc_error(server, model, text_inputs(big, 4))

    for _ in range(2):
        send_each_kind()
    before = group_rss(server.pid)
    for _ in range(10):
        send_each_kind()
    after = group_rss(server.pid)
    grown = {name: after[name] - before.get(name, 0) for name in after}
    report = {name: f"{value / 2**20:+.1f}" for name, value in grown.items()}
    print(f"A5: MiB grown per process over 40 refused 10 MB prompts after warm-up: {report}")
    stubs = sum(value for name, value in grown.items() if name != "tritonserver")
    assert stubs < 32 << 20, f"the stubs grew by {stubs / 2**20:.1f} MiB (MiB per process: {report})"
    assert grown.get("tritonserver", 0) < 200 << 20, f"tritonserver kept the requests: {report}"


POOL_JOB = {"input_ids": [1, 42, 305], "sampling": json.dumps({"max_tokens": 4}), "handle": "h-1"}
FORGED_TOKEN = "9999999999." + "0" * 64


@pytest.mark.parametrize("pool", ["prefill", "decode", "colocated"])
def test_a6_pools_refuse_direct_calls(server: TritonServer, pool: str) -> None:
    baseline = idle_gauges(server)
    internal = "this model is internal: requests must come through the orchestrator"
    refused(server, pool, POOL_JOB, internal)
    refused(server, pool, {**POOL_JOB, "disagg_auth": FORGED_TOKEN}, internal)
    values = {
        name: np.array([value.encode()], dtype=np.object_)
        for name, value in POOL_JOB.items()
        if name != "input_ids"
    }
    values["input_ids"] = np.array(POOL_JOB["input_ids"], dtype=np.int32)
    assert internal in grpc_error(server, pool, values)
    assert idle_now(server, baseline)


def test_a6_forged_descriptor_to_decode_refused_before_work(server: TritonServer) -> None:
    baseline = idle_gauges(server)
    state = {"prompt_token_ids": [1, 42, 305], "output_token_ids": [7], "params": {"max_tokens": 4}}
    body = {"state": json.dumps(state), "descriptor": "eyJ2IjoxfQ.forged", "handle": "h-2"}
    message = refused(server, "decode", {**body, "disagg_auth": FORGED_TOKEN}, "internal")
    assert "shm" not in message and "/dev" not in message
    assert idle_now(server, baseline), "nothing imported, no block taken"


def test_a6_under_a_valid_pool_token_a_forged_descriptor_is_refused_by_its_checks(
    server: TritonServer,
) -> None:
    """A token minted for this very call (the test reads the deployment secret, as a pool host does):
    the call passes the token check and is accepted, so the descriptor checks are what refuse it, with
    a failure event naming the descriptor, before any memory is mapped or block taken."""
    baseline = idle_gauges(server)
    state = wire.encode_state(SequenceState((1, 42, 305), (7,), SamplingParams(max_tokens=4)))
    job = {
        "state": np.array([state.encode()], dtype=np.object_),
        "descriptor": np.array([b"eyJ2IjoxfQ.forged"], dtype=np.object_),
        "handle": np.array([b"h-3"], dtype=np.object_),
    }
    token = TokenSigner(load_secret()).mint(wire.call_subject("h-3", None))
    with GrpcStream(server.config.grpc_url) as stream:
        stream.send("decode", job, parameters={PARAMETER: token})
        events = list(stream.until_final(30))
    assert all(event.error is None for event in events), events  # past the token check: accepted
    answers = [e.result.as_numpy("event") for e in events if e.result.as_numpy("event") is not None]
    (failed,) = [wire.decode_event(raw.reshape(-1)[0], None) for raw in answers]
    assert isinstance(failed, Failed) and "descriptor" in failed.error.message, failed
    message = failed.error.message
    assert "internal" not in message and "shm" not in message and "/dev" not in message, message
    assert idle_now(server, baseline), "nothing imported, no block taken"


def test_a_pool_token_replayed_for_another_job_is_refused_and_counted(server: TritonServer) -> None:
    """A token captured from one pool call (minted for handle h-4) and sent with another job (h-5)
    starts nothing: the pool refuses it and counts it as a mismatch."""
    baseline = idle_gauges(server)
    token = TokenSigner(load_secret()).mint(wire.call_subject("h-4", None))
    before = metric_sum(server, "disagg_pool_auth_refusals_total", reason="mismatch")
    job = {**POOL_JOB, "handle": "h-5", "disagg_auth": token}
    refused(server, "prefill", job, "this model is internal")

    def counted() -> float | None:
        value = metric_sum(server, "disagg_pool_auth_refusals_total", reason="mismatch")
        return value if value > before else None

    assert wait_until(counted, 10, "the refusal counted") == before + 1
    assert idle_now(server, baseline)


# ---- 6. SIGTERM with streams in flight (last: it stops the module's server) -----------------------


def late_request_outcome(server: TritonServer) -> str:
    """What a new `llm` request sent once draining has started gets: "served", "refused" (an error
    response) or "unreachable" (the server no longer accepts connections). Sent once the server says
    it is no longer ready, so that it cannot arrive before the signal was handled."""

    def not_ready() -> bool:
        try:
            status, _ = http_json(f"http://{server.config.http_url}/v2/health/ready", timeout_s=5)
        except OSError:
            return True  # gone already
        return status != 200

    wait_until(not_ready, 10, "the server no longer ready after SIGTERM")
    try:
        with GrpcStream(server.config.grpc_url) as stream:
            stream.send("llm", text_inputs("Hello world", 4, stream=True))
            result = read_stream(stream, timeout_s=30)
    except Exception:  # any failure to reach the server is a refusal here
        return "unreachable"
    return "refused" if result.error is not None or not result.final else "served"


def test_sigterm_with_streams_in_flight_drains_and_exits_cleanly(
    triton_factory: TritonFactory, server: TritonServer, expected: dict[str, str]
) -> None:
    """Three `llm` streams in flight at SIGTERM: each finishes, then the server exits 0 within its
    exit timeout. Each client closes its gRPC stream when its request ends, as a client does when it
    has nothing more to send: on Triton 2.51 a stream left open keeps the server from exiting at all
    (next test)."""
    triton_factory.release(server)  # this test stops the server and checks the outcome itself
    streams = [GrpcStream(server.config.grpc_url) for _ in range(3)]
    results: list[Any] = [None] * len(streams)
    try:
        # `llm` only: on Triton 2.51 an `ensemble` stream in flight at SIGTERM gets no further pieces
        # (the ensemble's later steps refuse new work once shutdown starts) and holds the exit until
        # the exit timeout; docs/serving.md documents it.
        for stream, model in zip(streams, ("llm", "llm", "llm"), strict=True):
            stream.send(model, text_inputs("Hello world", 200, stream=True))
        for stream in streams:
            first = stream.next(30)
            assert first.error is None, first

        def read(i: int) -> None:
            results[i] = read_stream(streams[i], timeout_s=60)
            streams[i].close()

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for reader in readers:
            reader.start()
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)  # to the process group, as `make serve` does on Ctrl-C / SIGTERM
        late = late_request_outcome(server)
        status = server.wait(server.config.exit_timeout_s + 20)
        exited_after = time.monotonic() - signalled
        for reader in readers:
            reader.join(30)
    finally:
        for stream in streams:
            stream.close()
        server.stop(grace_s=5)
    assert status == 0, server.log_tail()
    assert exited_after < server.config.exit_timeout_s, "the exit timeout forced the exit"
    for result in results:
        assert result is not None, "a stream was left hanging"
        # drained: each stream in flight at the signal ends with its final response, not an error
        assert result.final and result.error is None, result
    texts = {"".join(result.pieces) for result in results}
    assert len(texts) == 1 and "" not in texts, texts  # each whole: the same greedy answer, not cut
    assert late != "served", "a request sent after SIGTERM was served"
    wait_until(lambda: not live_group_members(server.pid), 10, "no process of the server left")
    assert not shm_entries(server.config.shm_prefix)
