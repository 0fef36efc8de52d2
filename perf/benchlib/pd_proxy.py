"""The front of vLLM's own prefill/decode disaggregation: one OpenAI endpoint over two vLLM servers.

vLLM's NIXL connector splits a request in two. The prefill instance (``kv_producer``) runs the prompt
for one token with ``kv_transfer_params: {"do_remote_decode": true}``, keeps the KV and answers where
to fetch it (its engine id, block ids, host and side-channel port, in the reply's
``kv_transfer_params``). The decode instance (``kv_consumer``) gets the same request with those
parameters, pulls the KV over NIXL and generates the tokens. vLLM documents this flow and ships a toy
proxy for it in its examples; this is the benchmark's own, written for this harness:

- ``POST /v1/completions``: the prefill leg (``max_tokens`` 1, not streamed), then the decode leg with
  the prefill's ``kv_transfer_params``, its answer relayed as it comes (SSE when ``stream``). An error
  of either leg is relayed with its status. A client that goes away cancels the leg in flight.
- ``GET /health``: 200 when both instances answer theirs.

    python perf/benchlib/pd_proxy.py --port 8300 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

SESSION = web.AppKey("session", ClientSession)
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a completion request: one token, not streamed, its KV kept for a decode."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    return {**leg, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS)}


def decode_body(body: dict[str, Any], prefill_reply: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's request, with where the prefill left the KV."""
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError("the prefill instance answered without kv_transfer_params (is it a kv_producer?)")
    return {**body, "kv_transfer_params": params}


def make_app(prefill: str, decode: str) -> web.Application:
    async def session_context(app: web.Application):
        app[SESSION] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10))
        yield
        await app[SESSION].close()

    async def completions(request: web.Request) -> web.StreamResponse:
        session = request.app[SESSION]
        body = await request.json()
        async with session.post(f"{prefill}/v1/completions", json=prefill_body(body)) as reply:
            if reply.status != 200:
                return web.Response(
                    status=reply.status, body=await reply.read(), content_type="application/json"
                )
            first = await reply.json()
        try:
            leg = decode_body(body, first)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "proxy_error"}}, status=502)
        async with session.post(f"{decode}/v1/completions", json=leg) as answer:
            if answer.status != 200 or not body.get("stream"):
                return web.Response(
                    status=answer.status, body=await answer.read(), content_type="application/json"
                )
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            try:
                async for chunk in answer.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client left (at [DONE], or mid-stream): nothing to send
                pass
            return out

    async def health(request: web.Request) -> web.Response:
        session = request.app[SESSION]
        for url in (prefill, decode):
            try:
                async with session.get(f"{url}/health", timeout=ClientTimeout(total=2)) as reply:
                    if reply.status != 200:
                        return web.Response(status=503, text=f"{url}: {reply.status}")
            except (OSError, asyncio.TimeoutError) as exc:
                return web.Response(status=503, text=f"{url}: {type(exc).__name__}")
        return web.Response(text=json.dumps({"status": "ok"}), content_type="application/json")

    app = web.Application()
    app.cleanup_ctx.append(session_context)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="URL of the kv_producer instance")
    parser.add_argument("--decode", required=True, help="URL of the kv_consumer instance")
    args = parser.parse_args(argv)
    web.run_app(make_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
