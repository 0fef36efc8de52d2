"""The aiohttp application of the OpenAI front end.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (200 when ``llm`` is ready, else 503), ``GET /metrics`` (the
front end's own counters). With an API key configured, every ``/v1/*`` route needs it (``auth``).
Every error is an OpenAI error body (``errors``). A stream's first piece is awaited before its 200 is
sent, so that a request ``llm`` refuses gets its own status; later failures arrive as an ``error``
event. The application runs with aiohttp's handler cancellation on: a client that disconnects cancels
its handler, which cancels its gRPC stream (``client``), which stops the request on both pools.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from disagg.openai import auth
from disagg.openai.chat import ChatTemplate
from disagg.openai.client import LlmClient, Piece
from disagg.openai.config import FrontendConfig
from disagg.openai.errors import INVALID_REQUEST, SERVER_ERROR, ApiError, bad_request, model_not_found
from disagg.openai.protocol import parse_chat, parse_completion, requested_model
from disagg.openai.response import Reply, Usage, sse

MAX_BODY_BYTES = 4 << 20  # the prompt limit of text_api (1 MiB of UTF-8) with room for JSON escapes
OWNER = "triton-disagg"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}

CONFIG = web.AppKey("config", FrontendConfig)
CLIENT = web.AppKey("client", LlmClient)
TEMPLATE: web.AppKey[ChatTemplate | None] = web.AppKey("template")
STARTED = web.AppKey("started", int)
REGISTRY = web.AppKey("registry", CollectorRegistry)
REFUSALS = web.AppKey("refusals", auth.Refusals)

_json = partial(json.dumps, ensure_ascii=False)


def create_app(config: FrontendConfig, client: LlmClient | None = None) -> web.Application:
    """The application for ``config``; ``client`` defaults to one on ``config.triton_url`` (closed with
    the application). Raises ValueError when the model's chat template cannot be read."""
    registry = CollectorRegistry()
    refusals = auth.Refusals(registry)
    middlewares = [_errors] + ([auth.middleware(config.api_key, refusals)] if config.api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[REGISTRY], app[REFUSALS] = registry, refusals
    app[CONFIG] = config
    app[CLIENT] = client or LlmClient(config.triton_url)
    app[TEMPLATE] = ChatTemplate.find(config.model_dir, config.chat_template)
    app[STARTED] = int(time.time())
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.on_cleanup.append(_close_client)
    return app


async def _close_client(app: web.Application) -> None:
    await app[CLIENT].close()


def _error(exc: ApiError) -> web.Response:
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(exc.retry_after_s), "retry-after-ms": str(exc.retry_after_ms)}
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(exc.body(), status=exc.status, dumps=_json, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = INVALID_REQUEST if exc.status < 500 else SERVER_ERROR
        return _error(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", kind))


def _model_card(app: web.Application) -> dict[str, Any]:
    return {"id": app[CONFIG].model_id, "object": "model", "created": app[STARTED], "owned_by": OWNER}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app)]}, dumps=_json)


async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != request.app[CONFIG].model_id:
        raise model_not_found(name)
    return web.json_response(_model_card(request.app), dumps=_json)


async def health(request: web.Request) -> web.Response:
    if await request.app[CLIENT].ready():
        return web.json_response({"status": "ok"})
    raise ApiError(503, "Triton or its 'llm' model is not ready", SERVER_ERROR, None, "service_unavailable")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG]
    body = await _body(request)
    name = requested_model(body)
    if name != config.model_id:
        raise model_not_found(name)
    if kind == "chat":
        gen = parse_chat(body, config.default_max_tokens)
        template = app[TEMPLATE]
        if template is None:
            raise bad_request(
                f"model '{config.model_id}' has no chat template; use /v1/completions", "messages"
            )
        prompt = template.render(gen.messages)
    else:
        gen = parse_completion(body, config.default_max_tokens)
        prompt = gen.prompt
    reply = Reply(gen, config.model_id)
    async with contextlib.aclosing(app[CLIENT].generate(gen, prompt)) as pieces:
        if gen.stream:
            return await _stream(request, reply, pieces)
        return await _unary(reply, pieces)


async def _unary(reply: Reply, pieces: AsyncIterator[Piece]) -> web.Response:
    texts, tokens, prompt_tokens, reason = [], 0, 0, None
    async for piece in pieces:
        texts.append(piece.text)
        tokens += piece.tokens
        prompt_tokens = piece.prompt_tokens or prompt_tokens
        reason = piece.finish_reason  # set on the final piece (LlmClient.generate checks it)
    body = reply.unary("".join(texts), str(reason), Usage(prompt_tokens, tokens))
    return web.json_response(body, dumps=_json)


async def _stream(request: web.Request, reply: Reply, pieces: AsyncIterator[Piece]) -> web.StreamResponse:
    piece = await anext(pieces)  # a refusal before any output keeps its own HTTP status
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await response.prepare(request)
    tokens, prompt_tokens = 0, 0
    try:
        if reply.chat:
            await response.write(sse(reply.chunk("", first=True)))
        while True:
            tokens += piece.tokens
            prompt_tokens = piece.prompt_tokens or prompt_tokens
            if piece.final:
                await response.write(sse(reply.chunk(piece.text, piece.finish_reason)))
                break
            if piece.text:
                await response.write(sse(reply.chunk(piece.text)))
            piece = await anext(pieces)
        if reply.generation.include_usage:
            await response.write(sse(reply.usage_chunk(Usage(prompt_tokens, tokens))))
        await response.write(sse("[DONE]"))
    except ApiError as exc:  # after the 200: the error is the stream's last event
        await response.write(sse(exc.body()))
        await response.write(sse("[DONE]"))
    except ConnectionResetError:  # the client left: leaving here cancels its request (aclosing)
        return response
    await response.write_eof()
    return response
