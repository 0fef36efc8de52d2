"""vLLM's own P/D deployment: its instances' command lines, and the proxy's two legs against stand-ins
for the kv_producer and kv_consumer (the real pair ran here by hand; see perf/RESULTS.md)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from perf.benchlib import pd_proxy
from perf.benchlib.deploy import VllmConfig


def model(tmp_path: Path) -> Path:
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_a_disaggregated_instance_names_its_connector_role_and_side_channel(tmp_path: Path) -> None:
    config = VllmConfig(model(tmp_path), cpus="1", omp_bind="1", kv_role="consumer", side_channel_port=5701)
    command = config.command()
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    assert config.environment()["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5701"
    plain = VllmConfig(model(tmp_path))
    assert "--kv-transfer-config" not in plain.command()
    assert plain.environment().get("VLLM_NIXL_SIDE_CHANNEL_PORT") == os.environ.get(
        "VLLM_NIXL_SIDE_CHANNEL_PORT"
    )
    with pytest.raises(ValueError, match="side-channel"):
        VllmConfig(model(tmp_path), kv_role="producer")
    with pytest.raises(ValueError, match="kv_role"):
        VllmConfig(model(tmp_path), kv_role="both", side_channel_port=1)


def test_the_proxy_prefills_one_token_then_streams_the_decode_with_the_prefills_kv_parameters() -> None:
    seen: dict[str, list[dict]] = {"prefill": [], "decode": []}
    where = {"remote_engine_id": "e1", "remote_block_ids": [[1, 2]], "remote_host": "localhost"}

    async def prefill(request: web.Request) -> web.Response:
        seen["prefill"].append(await request.json())
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": where})

    async def decode(request: web.Request) -> web.StreamResponse:
        seen["decode"].append(await request.json())
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in ("a", "b"):
            await out.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def instance(handler) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_get("/health", health)
        return app

    async def main() -> tuple[int, str, int]:
        async with TestServer(instance(prefill)) as p, TestServer(instance(decode)) as d:
            proxy = pd_proxy.make_app(str(p.make_url("")).rstrip("/"), str(d.make_url("")).rstrip("/"))
            async with TestClient(TestServer(proxy)) as client:
                health_status = (await client.get("/health")).status
                body = {"model": "m", "prompt": "p", "max_tokens": 8, "min_tokens": 8, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                reply = await client.post("/v1/completions", json=body)
                return reply.status, await reply.text(), health_status

    status, text, health_status = asyncio.run(main())
    assert health_status == 200 and status == 200
    assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")
    (first,) = seen["prefill"]
    assert first["max_tokens"] == 1 and first["stream"] is False and "min_tokens" not in first
    assert first["kv_transfer_params"]["do_remote_decode"] is True and "stream_options" not in first
    (second,) = seen["decode"]
    assert second["kv_transfer_params"] == where and second["max_tokens"] == 8 and second["stream"] is True


def test_a_prefill_reply_without_kv_parameters_is_an_error_not_a_silent_colocated_run() -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        pd_proxy.decode_body({"prompt": "p"}, {"choices": []})
