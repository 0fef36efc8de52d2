"""A tiny in-process OpenAI-compatible streaming server for the load-generator tests.

`POST /v1/completions` with `"stream": true` answers Server-Sent Events: `max_tokens` chunks of one
token each, one every `token_delay_s` after `first_delay_s`, then a usage chunk and `[DONE]`. It stamps
when each request arrived (`time.perf_counter()`, the clock the load generator uses) so that tests can
check arrivals from the server's side. `hang=True` never finishes a stream (for timeout tests).
"""

from __future__ import annotations

import asyncio
import json
import time


class FakeOpenAIServer:
    def __init__(self, first_delay_s: float = 0.0, token_delay_s: float = 0.01, hang: bool = False) -> None:
        self.first_delay_s = first_delay_s
        self.token_delay_s = token_delay_s
        self.hang = hang
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeOpenAIServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.arrivals.append(time.perf_counter())
            length = 0
            for line in head.decode().split("\r\n"):
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(self.first_delay_s)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.token_delay_s)
                chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
                writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await writer.drain()
            if self.hang:
                await asyncio.Event().wait()
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            writer.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
