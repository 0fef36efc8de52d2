"""The front end as ``disagg serve`` runs it (disagg.openai.launcher), with no Triton behind it: a busy
port fails before anything starts, the child answers 503 while Triton is away, holds no secret, and
stops cleanly (no process left)."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from disagg.openai.launcher import FrontendError, FrontendLaunch, FrontendProcess
from disagg.procfs import read_stat

SECRET_VAR = "DISAGG_TEST_SECRET"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def answering(url: str, deadline_s: float = 30.0) -> tuple[int, Any]:
    """Poll until the front end answers `url` (it is importing its libraries first)."""
    import time

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call(url)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def launch(tiny_model_dir: Path, port: int) -> FrontendLaunch:
    # port+0 of a closed socket: no Triton listens there
    return FrontendLaunch("127.0.0.1", port, f"127.0.0.1:{free_port()}", tiny_model_dir, drain_s=1.0)


def test_a_busy_port_fails_before_anything_starts(tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        process = FrontendProcess(launch(tiny_model_dir, busy.getsockname()[1]))
        with pytest.raises(FrontendError, match="--openai-port or OPENAI_PORT"):
            process.start()
    assert process.pid is None


def test_without_triton_it_answers_503_and_stops_cleanly(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_VAR, "s3cr3t-value")
    port = free_port()
    process = FrontendProcess(launch(tiny_model_dir, port), env_drop=(SECRET_VAR,)).start()
    try:
        base = f"http://127.0.0.1:{port}"
        status, body = answering(f"{base}/health")
        assert status == 503 and body["error"]["code"] == "service_unavailable"
        status, body = call(f"{base}/v1/models")
        assert status == 200 and body["data"][0]["id"] == tiny_model_dir.resolve().name
        status, body = call(f"{base}/v1/completions", {"model": tiny_model_dir.name, "prompt": "x"})
        assert status == 503 and "Triton is not available" in body["error"]["message"]
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert b"s3cr3t-value" not in environ and SECRET_VAR.encode() not in environ
    finally:
        status = process.stop()
    assert status == 0, "SIGTERM is a clean stop"
    stat = read_stat(process.pid)
    assert stat is None or stat.exited
    assert process.stop() == 0, "stop is idempotent"
    assert not any(
        (s := read_stat(p.name)) is not None and s.pgrp == process.pid and not s.exited
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
    ), "no process of its group is left"
    assert os.environ[SECRET_VAR] == "s3cr3t-value"
