"""ServerReadiness against a small HTTP server standing in for Triton's readiness endpoints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.serverconfig import ENV_SERVER_HTTP
from disagg.triton.readiness import ServerReadiness

READY = {"/v2/models/decode/ready", "/v2/health/live"}  # what the stand-in answers with 200


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path in READY else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_a_model_is_ready_only_when_the_server_says_so(server: str) -> None:
    readiness = ServerReadiness(server)
    assert readiness.model_ready("decode")
    assert not readiness.model_ready("prefill")  # 400: not ready (unloading, or never loaded)


def test_a_server_that_does_not_answer_reads_not_ready() -> None:
    closed = ServerReadiness("127.0.0.1:1", timeout_s=1.0)  # nothing listens on port 1
    assert not closed.model_ready("decode")
    assert closed.server_exiting(), "an endpoint gone reads as a server gone"


def test_a_server_is_exiting_once_its_liveness_fails(server: str) -> None:
    readiness = ServerReadiness(server)
    assert not readiness.server_exiting()
    READY.discard("/v2/health/live")  # Triton answers liveness with an error once it is exiting
    try:
        assert readiness.server_exiting()
    finally:
        READY.add("/v2/health/live")


def test_the_endpoint_comes_from_the_environment_or_there_is_none() -> None:
    assert ServerReadiness.from_environment({}) is None
    found = ServerReadiness.from_environment({ENV_SERVER_HTTP: "127.0.0.1:8000"})
    assert found is not None and found.base == "http://127.0.0.1:8000"
