"""The OpenAI front end (disagg.openai) on a real Triton serving the project's repository, driven by the
official `openai` client: completions and chat, unary and streamed, against the engine's greedy output
with exact usage (the engine's token counts are the oracle, and the server's own `/metrics` a second
one), stop strings, refusals by name, an unknown model, errors coded by `llm`, a client leaving
mid-stream freeing both pools at once, and 50 concurrent streams.

The tiny model has no chat template: the front end is given one (`--chat-template`), so the expected
prompt is known here to the character. The model's own template is checked on SmolLM2 in
test_real_model.py and against transformers in tests/unit/openai.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from oracle import stop_string
from serving_support import REPOSITORY, engine_greedy, metric_sum, pool_gauges, set_parameters
from triton_support import (
    LeakProbe,
    TritonFactory,
    free_ports,
    http_json,
    live_group_members,
    stop_checked,
    wait_until,
)

from disagg.engine.tokenizer import Tokenizer
from disagg.openai.launcher import FrontendLaunch, FrontendProcess
from disagg.server import TritonServer

MAX_TOKENS = 12
PROMPTS = ("Hello world", "naïve café — 日本語 🙂")
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Frontend:
    base_url: str
    model: str
    process: FrontendProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)


ENTRY_ORCHESTRATORS = ("llm", "orchestrator", "orchestrator_colocated")


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    # admission off: these tests send up to 50 streams at once and expect every one served, whatever
    # this machine's speed (admission is tested on its own, tests/integration/test_serving_admission.py)
    repository = tmp_path_factory.mktemp("openai_repository") / "repository"
    shutil.copytree(REPOSITORY, repository)
    set_parameters(repository, {m: {"admission.margin": "0"} for m in ENTRY_ORCHESTRATORS})
    server = triton_factory.start(repository, exit_timeout_s=5)
    triton_factory.release(server)  # its exit is checked by stop_checked
    try:
        yield server
    finally:
        stop_checked(server)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


@contextlib.contextmanager
def running_frontend(server: TritonServer, model_dir: Path, template: Path) -> Iterator[Frontend]:
    """The front end as `disagg serve` starts it (its launcher), on a free port, beside `server`;
    stopped on exit, cleanly."""
    port = free_ports(1)[0]
    launch = FrontendLaunch("127.0.0.1", port, server.config.grpc_url, model_dir, 5.0, template)
    process = FrontendProcess(launch).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{base}/health") == 200, 60, "the front end healthy")
        yield Frontend(f"{base}/v1", model_dir.resolve().name, process)
    finally:
        status = process.stop()
    assert status == 0, "the front end stops cleanly on SIGTERM"
    assert not live_group_members(process.pid), "no process of the front end is left"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openai") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def frontend(server: TritonServer, tiny_model_dir: Path, template: Path) -> Iterator[Frontend]:
    with running_frontend(server, tiny_model_dir, template) as running:
        yield running


def _answers(url: str) -> int | None:
    try:
        return http_json(url, timeout_s=5)[0]
    except OSError:
        return None


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def idle(server: TritonServer) -> dict[tuple[str, str], float]:
    """Pool gauges once no sequence is active and no block is in use on any pool."""

    def quiet() -> dict[tuple[str, str], float] | None:
        gauges = pool_gauges(server)
        return None if any(v for k, v in gauges.items() if k[0] != "disagg_kv_blocks_free") else gauges

    return wait_until(quiet, 30, "pools idle")


def chat_prompt(content: str) -> str:
    """What CHAT_TEMPLATE renders for one user message, with the assistant's turn opened."""
    return f"<|user|>{content}\n<|assistant|>"


# ---- text and usage against the engine ---------------------------------------------------------------


def test_completions_equal_the_engine_with_exact_usage(
    server: TritonServer, frontend: Frontend, tokenizer: Tokenizer
) -> None:
    """One request at a time on idle pools (the bf16 oracle runs at batch 1). Unary and streamed
    text equal the engine's greedy text; completion_tokens is the number of tokens it generated (an
    end token included), prompt_tokens the prompt's, finish_reason the engine's."""
    oracle = engine_greedy(PROMPTS, MAX_TOKENS)
    with frontend.client() as client:
        for prompt in PROMPTS:
            greedy = oracle[prompt]
            idle(server)
            reply = client.completions.create(model=frontend.model, prompt=prompt, **GREEDY)
            choice = reply.choices[0]
            assert choice.text == greedy.text and choice.finish_reason == greedy.finish_reason
            assert reply.usage.completion_tokens == len(greedy.token_ids)
            assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt))
            assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
            idle(server)
            chunks = list(
                client.completions.create(model=frontend.model, prompt=prompt, **GREEDY, **STREAMED)
            )
            usage = chunks[-1]
            assert usage.choices == [] and usage.usage == reply.usage
            text_chunks = chunks[:-1]
            assert "".join(c.choices[0].text for c in text_chunks) == greedy.text
            assert len(text_chunks) > 3, "text arrives piece by piece"
            assert [c.choices[0].finish_reason for c in text_chunks][-1] == greedy.finish_reason


def test_min_tokens_makes_every_request_run_to_max_tokens(
    server: TritonServer, frontend: Frontend, tokenizer: Tokenizer
) -> None:
    """vLLM's `min_tokens` extension = TensorRT-LLM's min_length: no end token before it, so exactly
    max_tokens tokens, finish_reason length."""
    prompt = PROMPTS[0]
    greedy = engine_greedy([prompt], MAX_TOKENS, min_length=MAX_TOKENS)[prompt]
    assert len(greedy.token_ids) == MAX_TOKENS and greedy.finish_reason == "length"
    idle(server)
    with frontend.client() as client:
        reply = client.completions.create(
            model=frontend.model, prompt=prompt, **GREEDY, extra_body={"min_tokens": MAX_TOKENS}
        )
    assert reply.choices[0].text == greedy.text and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_chat_renders_the_template_and_equals_the_engine(
    server: TritonServer, frontend: Frontend, tokenizer: Tokenizer
) -> None:
    content = "Tell me about the sea"
    prompt = chat_prompt(content)
    greedy = engine_greedy([prompt], MAX_TOKENS)[prompt]
    messages = [{"role": "user", "content": content}]
    with frontend.client() as client:
        idle(server)
        reply = client.chat.completions.create(
            model=frontend.model, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
        )
        choice = reply.choices[0]
        assert reply.object == "chat.completion" and choice.message.role == "assistant"
        assert choice.message.content == greedy.text and choice.finish_reason == greedy.finish_reason
        assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt)), (
            "the prompt is the rendered template"
        )
        assert reply.usage.completion_tokens == len(greedy.token_ids)
        idle(server)
        chunks = list(
            client.chat.completions.create(model=frontend.model, messages=messages, **GREEDY, **STREAMED)
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == greedy.text
    assert chunks[-2].choices[0].finish_reason == greedy.finish_reason
    assert chunks[-1].usage == reply.usage


def test_stop_strings_end_the_text_before_them(
    server: TritonServer, frontend: Frontend, tokenizer: Tokenizer
) -> None:
    """The output ends before the first stop string, finish_reason stop; completion_tokens counts the
    tokens generated up to the one that completed the stop string."""
    prompt = PROMPTS[0]
    greedy = engine_greedy([prompt], 30, min_length=30)[prompt]
    stop, needed = stop_string(lambda ids: tokenizer.decode(list(ids)), greedy.token_ids)
    expected = greedy.text[: greedy.text.index(stop)]
    with frontend.client() as client:
        for stream in (False, True):
            idle(server)
            reply = client.completions.create(
                model=frontend.model,
                prompt=prompt,
                max_tokens=30,
                temperature=0,
                stop=[stop, "never-seen-stop"],
                stream=stream,
                extra_body={"min_tokens": 30},
                **({"stream_options": {"include_usage": True}} if stream else {}),
            )
            if stream:
                chunks = list(reply)
                text = "".join(c.choices[0].text for c in chunks[:-1])
                reason, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
            else:
                text, reason, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
            assert (text, reason) == (expected, "stop"), stream
            assert usage.completion_tokens == needed


# ---- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"n": 2}, "n"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(
    frontend: Frontend, extra: dict[str, Any], param: str
) -> None:
    with frontend.client() as client, pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=frontend.model, prompt="Hello", max_tokens=4, **extra)
    assert info.value.status_code == 400 and info.value.param == param
    assert param in info.value.message


def test_an_unknown_model_is_404(frontend: Frontend) -> None:
    with frontend.client() as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
        assert [m.id for m in client.models.list()] == [frontend.model]


def test_what_llm_refuses_keeps_its_status(frontend: Frontend) -> None:
    """A prompt longer than the model's context passes the front end's checks and is refused by the
    orchestrator (INVALID_ARG): the client gets 400 with its message, unary or streamed."""
    for stream in (False, True):
        with frontend.client() as client, pytest.raises(openai.BadRequestError) as info:
            reply = client.completions.create(
                model=frontend.model, prompt="word " * 3000, max_tokens=4, stream=stream
            )
            if stream:
                list(reply)
        assert "exceeds the model's context" in info.value.message


# ---- cancellation and concurrency -------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_both_pools_within_a_second(
    triton_factory: TritonFactory, tiny_model_dir: Path, template: Path, leak_probe: LeakProbe
) -> None:
    """On a server of its own, which a cancelled stream makes likely to end as `stop_checked` allows
    (Triton 2.51's verbose log then shows the orchestrator's last responses "skipped as grpc
    transaction was cancelled")."""
    server = triton_factory.start(REPOSITORY, exit_timeout_s=3)
    leak_probe.ignore_shm(server.config.shm_prefix)
    triton_factory.release(server)
    try:
        with running_frontend(server, tiny_model_dir, template) as frontend:
            _leave_mid_stream(server, frontend)
    finally:
        stop_checked(server)


def _leave_mid_stream(server: TritonServer, frontend: Frontend) -> None:
    baseline = idle(server)
    cancelled = metric_sum(server, "disagg_requests_total", model="llm", outcome="cancelled")
    with frontend.client() as client:
        # 1500 tokens take ~20 s to decode here: the pools are free in a second only if decode stopped
        stream = client.completions.create(
            model=frontend.model,
            prompt=PROMPTS[0],
            max_tokens=1500,
            temperature=0,
            stream=True,
            extra_body={"min_tokens": 1500},
        )
        chunks = [next(stream) for _ in range(5)]
        assert all(c.choices[0].finish_reason is None for c in chunks)
        wait_until(
            lambda: pool_gauges(server).get(("disagg_decode_active_sequences", "decode")), 5, "decoding"
        )
        stream.close()  # the HTTP connection goes with it
        left = time.monotonic()
        wait_until(lambda: pool_gauges(server) == baseline, 1.0, "both pools back to their baseline")
    assert time.monotonic() - left < 1.0
    wait_until(
        lambda: (
            metric_sum(server, "disagg_requests_total", model="llm", outcome="cancelled") == cancelled + 1
        ),
        5,
        "the cancel counted by llm",
    )


STREAMS = 50
STREAM_TOKENS = 24


def test_fifty_concurrent_streams_all_complete_with_exact_usage(
    server: TritonServer, frontend: Frontend, tokenizer: Tokenizer
) -> None:
    """50 streams at once, half chat, half completions: every one ends with its usage, exactly
    STREAM_TOKENS tokens (`min_tokens`), and the server's own count of generated tokens agrees; they
    really ran at once (many in flight together, seen from the client)."""
    idle(server)
    before = metric_sum(server, "disagg_output_tokens_sum", model="llm")
    requests_before = metric_sum(server, "disagg_output_tokens_count", model="llm")

    async def one(client: openai.AsyncOpenAI, n: int) -> tuple[str, Any, float, float]:
        common: dict[str, Any] = {
            "model": frontend.model,
            "max_tokens": STREAM_TOKENS,
            "temperature": 0.8,
            "seed": n,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"min_tokens": STREAM_TOKENS},
        }
        if n % 2:
            reply = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Story {n}"}], **common
            )
        else:
            reply = await client.completions.create(prompt=f"Story {n}", **common)
        first = last = 0.0
        usage, reasons = None, []
        async for chunk in reply:
            last = time.monotonic()
            first = first or last
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        assert reasons == ["length"], reasons
        prompt = chat_prompt(f"Story {n}") if n % 2 else f"Story {n}"
        return prompt, usage, first, last

    async def all_at_once() -> list[tuple[str, Any, float, float]]:
        async with frontend.async_client() as client:
            return await asyncio.gather(*(one(client, n) for n in range(STREAMS)))

    results = asyncio.run(all_at_once())
    for prompt, usage, _, _ in results:
        assert usage.completion_tokens == STREAM_TOKENS
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    wait_until(
        lambda: metric_sum(server, "disagg_output_tokens_count", model="llm") == requests_before + STREAMS,
        10,
        "the 50 requests recorded",
    )
    generated = metric_sum(server, "disagg_output_tokens_sum", model="llm") - before
    assert generated == sum(usage.completion_tokens for _, usage, _, _ in results)
    starts = sorted(first for _, _, first, _ in results)
    ends = sorted(last for _, _, _, last in results)
    in_flight = max(sum(1 for s in starts if s <= t) - sum(1 for e in ends if e < t) for t in starts)
    assert in_flight >= 10, f"at most {in_flight} streams were in flight together"
    idle(server)
