"""The OpenAI front end's API key: with a key set, every /v1/* route answers 401 with an OpenAI error
body unless the request bears it, /health and /metrics stay open, and each refusal is counted by reason;
without a key nothing is asked. The key comes from $DISAGG_API_KEY or a file, never a flag."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg.openai import auth
from disagg.openai.app import create_app
from disagg.openai.client import Piece
from disagg.openai.config import FrontendConfig

MODEL = "tiny-model"
KEY = "sk-test-0123456789"


class Llm:
    """A stand-in for LlmClient answering every request with one piece."""

    async def ready(self) -> bool:
        return True

    async def generate(self, gen: Any, prompt: str) -> Any:
        yield Piece("hi", 1, 3, "stop", True)

    async def close(self) -> None:
        pass


def run(key: str | None, test: Callable[[TestClient], Awaitable[Any]], tmp_path: Path) -> Any:
    folder = tmp_path / MODEL
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    config = FrontendConfig(triton_url="127.0.0.1:1", model_id=MODEL, model_dir=folder, api_key=key)

    async def main() -> Any:
        async with TestClient(TestServer(create_app(config, client=Llm()))) as client:  # type: ignore[arg-type]
            return await test(client)

    return asyncio.run(main())


async def refusals(client: TestClient) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for line in text.splitlines():
        if line.startswith("disagg_auth_refusals_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="')[1].split('"')[0]] = float(value)
    return out


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


def test_every_v1_route_needs_the_key_and_refusals_are_counted(tmp_path: Path) -> None:
    async def test(client: TestClient) -> None:
        assert await refusals(client) == {"missing": 0, "malformed": 0, "wrong": 0}
        cases = [
            ({}, "missing"),
            ({"Authorization": KEY}, "malformed"),
            ({"Authorization": "Basic " + KEY}, "malformed"),
            ({"Authorization": "Bearer sk-test-wrong"}, "wrong"),
            ({"Authorization": "Bearer " + KEY + "x"}, "wrong"),
        ]
        for headers, _ in cases:
            for method, path, body in (
                ("POST", "/v1/completions", COMPLETION),
                (
                    "POST",
                    "/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                ),
                ("GET", "/v1/models", None),
                ("GET", f"/v1/models/{MODEL}", None),
            ):
                response = await client.request(method, path, json=body, headers=headers)
                assert response.status == 401, (path, headers)
                assert response.headers["WWW-Authenticate"] == "Bearer"
                error = (await response.json())["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
                assert KEY not in json.dumps(error)
        counted = await refusals(client)
        assert counted == {"missing": 4.0, "malformed": 8.0, "wrong": 8.0}
        good = await client.post(
            "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert good.status == 200 and (await good.json())["choices"][0]["text"] == "hi"
        lower = await client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert lower.status == 200  # the scheme is case-insensitive
        assert (await client.get("/health")).status == 200  # open: no key asked
        assert await refusals(client) == counted

    run(KEY, test, tmp_path)


def test_without_a_key_nothing_is_asked(tmp_path: Path) -> None:
    async def test(client: TestClient) -> None:
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer anything"})).status == 200
        assert await refusals(client) == {"missing": 0, "malformed": 0, "wrong": 0}

    run(None, test, tmp_path)


def test_the_key_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert auth.load_key({}, None) is None
    assert auth.load_key({auth.ENV_API_KEY: f" {KEY}\n"}, None) == KEY
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}-file\n")
    assert auth.load_key({auth.ENV_API_KEY: KEY}, key_file) == f"{KEY}-file"  # the file wins
    key_file.write_text("  \n")
    with pytest.raises(ValueError, match="empty") as empty:
        auth.load_key({}, key_file)
    assert str(key_file) in str(empty.value)
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_key({}, tmp_path / "absent")
    with pytest.raises(ValueError, match="without spaces") as spaced:
        auth.load_key({auth.ENV_API_KEY: "two words"}, None)
    assert "two words" not in str(spaced.value)  # an error never repeats the key


def test_the_refusal_rule() -> None:
    assert auth.refusal({}, KEY) == "missing"
    assert auth.refusal({"Authorization": "Bearer "}, KEY) == "malformed"
    assert auth.refusal({"Authorization": f"Token {KEY}"}, KEY) == "malformed"
    assert auth.refusal({"Authorization": f"Bearer {KEY[:-1]}"}, KEY) == "wrong"
    assert auth.refusal({"Authorization": f"Bearer  {KEY} "}, KEY) is None
