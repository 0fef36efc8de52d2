"""The OpenAI front end's application (disagg.openai.app) over a scripted stand-in for ``llm``: response
shapes, usage summed from the pieces, finish reasons, errors before and after a stream starts, and a
client disconnect cancelling the generation. The real ``llm`` behind it is tested in
tests/integration/test_openai_frontend.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer

from disagg.openai.app import create_app
from disagg.openai.client import Piece
from disagg.openai.config import FrontendConfig
from disagg.openai.errors import ApiError, from_llm
from disagg.openai.protocol import Generation

MODEL = "tiny-model"


class ScriptedLlm:
    """Stands in for LlmClient: yields `pieces` (an ApiError in the list is raised there), records each
    request, and whether its generation was closed before its end (a cancel)."""

    def __init__(self, pieces: list[Piece | ApiError], ready: bool = True, hold: bool = False) -> None:
        self.pieces = pieces
        self.is_ready = ready
        self.hold = hold  # after the pieces, wait forever (a long generation)
        self.requests: list[tuple[Generation, str]] = []
        self.cancelled = asyncio.Event()
        self.closed = False

    async def ready(self) -> bool:
        return self.is_ready

    async def generate(self, gen: Generation, prompt: str) -> AsyncIterator[Piece]:
        self.requests.append((gen, prompt))
        finished = False
        try:
            for piece in self.pieces:
                if isinstance(piece, ApiError):
                    raise piece
                yield piece
            if self.hold:
                await asyncio.Event().wait()
            finished = True
        finally:
            if not finished:
                self.cancelled.set()

    async def close(self) -> None:
        self.closed = True


def pieces(*texts: str, reason: str = "length", prompt_tokens: int = 5) -> list[Piece]:
    """Pieces of 2 tokens each, then the final empty piece carrying 1 more token and the reason."""
    out = [Piece(t, 2, prompt_tokens, None, False) for t in texts]
    return [*out, Piece("", 1, prompt_tokens, reason, True)]


def run(llm: ScriptedLlm, test: Callable[[TestClient], Awaitable[Any]], tmp_path: Path) -> Any:
    folder = tmp_path / MODEL
    folder.mkdir(exist_ok=True)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    config = FrontendConfig(triton_url="127.0.0.1:1", model_id=MODEL, model_dir=folder)

    async def main() -> Any:
        app = create_app(config, client=llm)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            return await test(client)

    return asyncio.run(main())


def events(raw: str) -> list[Any]:
    """The `data:` payloads of a server-sent event stream."""
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_unary_completion_sums_usage_and_keeps_the_finish_reason(tmp_path: Path) -> None:
    llm = ScriptedLlm(pieces("Hel", "lo", reason="stop"))

    async def test(client: TestClient) -> None:
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say", "max_tokens": 9})
        assert reply.status == 200
        body = await reply.json()
        assert (
            body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
        )
        assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}

    run(llm, test, tmp_path)
    gen, prompt = llm.requests[0]
    assert prompt == "Say" and gen.max_tokens == 9 and not gen.stream


def test_chat_stream_with_usage(tmp_path: Path) -> None:
    llm = ScriptedLlm(pieces("A", "B", reason="length", prompt_tokens=7))

    async def test(client: TestClient) -> list[Any]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        return events(await reply.text())

    chunks = run(llm, test, tmp_path)
    assert llm.requests[0][1] == "<user>Hi<assistant>", "the prompt is the model's template, rendered"
    assert chunks[-1] == "[DONE]"
    usage, chunks = chunks[-2], chunks[:-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
    }
    assert {c["id"] for c in chunks} == {usage["id"]} and all(c["usage"] is None for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "A"}, {"content": "B"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_completion_stream_without_usage(tmp_path: Path) -> None:
    llm = ScriptedLlm(pieces("x", "y"))

    async def test(client: TestClient) -> list[Any]:
        body = {"model": MODEL, "prompt": "p", "stream": True}
        return events(await (await client.post("/v1/completions", json=body)).text())

    chunks = run(llm, test, tmp_path)
    assert chunks[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["x", "y", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks[:-1])


def test_a_refusal_before_the_first_piece_keeps_its_status(tmp_path: Path) -> None:
    llm = ScriptedLlm([ApiError(400, "prompt too long for the model's context")])

    async def test(client: TestClient) -> None:
        for stream in (False, True):
            reply = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "p", "stream": stream}
            )
            assert reply.status == 400
            error = (await reply.json())["error"]
            assert error["message"] == "prompt too long for the model's context"
            assert set(error) == {"message", "type", "param", "code"}

    run(llm, test, tmp_path)


def test_a_shed_request_gets_retry_after(tmp_path: Path) -> None:
    """llm's shedding error carries its retry hint; the front end turns it into Retry-After."""
    shed = from_llm("UNAVAILABLE: server is degraded (decode gone); retry after 2.5 s")
    llm = ScriptedLlm([shed])

    async def test(client: TestClient) -> None:
        for stream in (False, True):
            reply = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "p", "stream": stream}
            )
            assert reply.status == 503 and reply.headers["Retry-After"] == "3"
            assert reply.headers["retry-after-ms"] == "2500"
            assert "retry after 2.5 s" in (await reply.json())["error"]["message"]
        busy = ApiError(503, "Triton or its 'llm' model is not ready")
        assert busy.retry_after_s is None and from_llm("INVALID_ARG: retry after 2 s").retry_after_s is None

    run(llm, test, tmp_path)


def test_a_failure_mid_stream_is_the_last_event(tmp_path: Path) -> None:
    llm = ScriptedLlm([Piece("a", 1, 3, None, False), ApiError(503, "pool gone", "server_error")])

    async def test(client: TestClient) -> list[Any]:
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True})
        assert reply.status == 200
        return events(await reply.text())

    chunks = run(llm, test, tmp_path)
    assert chunks[0]["choices"][0]["text"] == "a"
    assert chunks[1] == {
        "error": {"message": "pool gone", "type": "server_error", "param": None, "code": None}
    }
    assert chunks[2] == "[DONE]"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": []}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias_typo": 1}, 400, "logit_bias_typo"),
        ("/v1/completions", {"prompt": "x"}, 400, "model"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3},
            400,
            "n",
        ),
    ],
)
def test_bad_requests_never_reach_the_model(
    tmp_path: Path, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    llm = ScriptedLlm(pieces("never"))

    async def test(client: TestClient) -> dict[str, Any]:
        reply = await client.post(path, json=body)
        assert reply.status == status
        return (await reply.json())["error"]

    error = run(llm, test, tmp_path)
    assert error["param"] == param and not llm.requests
    if status == 404:
        assert error["code"] == "model_not_found" and "gpt-4" in error["message"]


def test_not_json_unknown_routes_and_methods(tmp_path: Path) -> None:
    async def test(client: TestClient) -> None:
        reply = await client.post("/v1/completions", data=b"{nope")
        assert reply.status == 400 and "not valid JSON" in (await reply.json())["error"]["message"]
        reply = await client.get("/v1/embeddings")
        assert reply.status == 404 and (await reply.json())["error"]["type"] == "invalid_request_error"
        reply = await client.get("/v1/completions")
        assert reply.status == 405 and "error" in await reply.json()
        reply = await client.post("/v1/completions", data=b"x" * (5 << 20))
        assert reply.status == 413 and "error" in await reply.json()

    run(ScriptedLlm([]), test, tmp_path)


def test_models_and_health(tmp_path: Path) -> None:
    llm = ScriptedLlm([], ready=False)

    async def test(client: TestClient) -> None:
        listing = await (await client.get("/v1/models")).json()
        assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [MODEL]
        assert (await client.get(f"/v1/models/{MODEL}")).status == 200
        assert (await client.get("/v1/models/other")).status == 404
        reply = await client.get("/health")
        assert reply.status == 503 and (await reply.json())["error"]["code"] == "service_unavailable"
        llm.is_ready = True
        assert (await client.get("/health")).status == 200

    run(llm, test, tmp_path)
    assert llm.closed, "the application closes its client"


def test_a_client_leaving_mid_stream_cancels_the_generation(tmp_path: Path) -> None:
    """A raw client reads the first chunk and drops the connection: the generation, still running
    (`hold`), is closed by the server at once."""
    llm = ScriptedLlm([Piece("first", 1, 3, None, False)], hold=True)

    async def test(client: TestClient) -> None:
        url = client.make_url("/v1/completions")
        async with ClientSession() as session:
            reply = await session.post(url, json={"model": MODEL, "prompt": "p", "stream": True})
            assert b"first" in await reply.content.readuntil(b"\n\n")
            reply.close()  # the connection goes with it
        await asyncio.wait_for(llm.cancelled.wait(), timeout=5)

    run(llm, test, tmp_path)
