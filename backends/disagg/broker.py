"""The model-control broker: the one holder of a server's admin key, which the others ask.

Rollouts (``disagg rollout``) and the autoscaler's ``triton`` actuator load and unload models; so do
the pool watchers inside the server, through BLS, which needs no key. Rather than each out-of-server
caller holding the admin key, the process that launched the server (``disagg.server.TritonServer``:
``disagg serve``, the tests, the benchmarks) runs a broker beside it: a Unix socket in this user's
model-control folder (mode 0700, the socket 0600, and the peer's uid checked), one JSON request per
connection. The broker makes the model-repository call with the key, under the server's model-control
lock (``disagg.control``), so its calls are serialised with the watchers' restarts, and answers with
the result or Triton's error. The key never leaves the launching process.

Requests: ``{"op": "index"}``, ``{"op": "config", "model": M}``, ``{"op": "load", "model": M,
"config": {...}}`` (config optional: the repository's files), ``{"op": "unload", "model": M}``,
``{"op": "update", "model": M, "config": {key: value}}``: the model's live config with those top-level
keys replaced, loaded, read and loaded under one hold of the lock (an instance count, a version policy:
Triton changes both in place), and ``{"op": "restart", "model": M, "found_dead_at": T}``: a pool
watcher's restart of a dead pool (``ModelControl.restart_once``: unless restarted since ``T``, wall
clock, a model still ready is unloaded and loaded with its live config; the result says whether it was).

Why the watchers inside the server ask the broker to restart: on Triton 2.51 ``pb_utils.load_model``
waits for the load holding the stub's GIL (the binding releases nothing while it waits for the
server's answer), so an entry point that loaded a pool itself stopped every stream it was serving for
the whole load (4 s for the tiny model). Over the broker the wait is on a socket. Without a broker (a
server started by hand) they load through BLS, and stall so.
Answers: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import socketserver
import struct
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from disagg.control import ModelControl, loadable_config
from disagg.serverconfig import ADMIN_HEADER

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
OPS = ("index", "config", "load", "unload", "update", "restart")


class BrokerError(RuntimeError):
    """A model-control call failed: the broker could not be reached, or it (or Triton, called
    directly through ``TritonRepository``) refused it; the message says why, never the key."""


def socket_path(control: ModelControl) -> Path:
    """Where the broker of ``control``'s server listens."""
    return control.lock_path.with_suffix(".sock")


class TritonRepository:
    """The model-repository HTTP calls, with the admin key on the restricted ones."""

    def __init__(
        self, http_url: str, admin_key: str, timeout_s: float = 300.0, admin_header: str = ADMIN_HEADER
    ) -> None:
        self.base = http_url if "://" in http_url else f"http://{http_url}"
        self._key = admin_key
        self._header = admin_header
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if admin:  # only the restricted calls carry the key
            headers[self._header] = self._key
        request = urllib.request.Request(self.base.rstrip("/") + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            raise BrokerError(f"{method} {path}: HTTP {exc.code}: {_triton_error(exc)}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise BrokerError(f"server unreachable at {self.base} ({type(exc).__name__})") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise BrokerError(f"{method} {path}: the server sent non-JSON") from None

    def call(self, op: str, model: str = "", config: dict[str, Any] | None = None) -> Any:
        quoted = urllib.parse.quote(model)
        if op == "index":
            return self._call("POST", "/v2/repository/index", {}, admin=True)
        if op == "config":
            return self._call("GET", f"/v2/models/{quoted}/config")
        if op == "load":
            body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
            return self._call("POST", f"/v2/repository/models/{quoted}/load", body, admin=True)
        if op == "unload":
            return self._call("POST", f"/v2/repository/models/{quoted}/unload", {}, admin=True)
        if op == "update":
            live = self.call("config", model)
            if not isinstance(live, dict):
                raise BrokerError(f"{model}: the server sent no config")
            return self.call("load", model, {**loadable_config(live), **(config or {})})
        raise BrokerError(f"unknown operation {op!r}")

    def ready(self, model: str) -> bool:
        """The server reports ``model`` ready (any error reads not ready)."""
        try:
            self._call("GET", f"/v2/models/{urllib.parse.quote(model)}/ready")
        except BrokerError:
            return False
        return True

    def restart(self, model: str) -> bool:
        """Unload ``model`` and load it again with its live config (so an instance count set at run
        time survives); False when it is not ready (being unloaded: left alone). On Triton 2.51 a load
        of a loaded model whose files did not change does nothing, even when its stub is dead, hence
        the unload, which returns at once (the dead instance is dropped in the background)."""
        if not self.ready(model):
            return False
        live = self.call("config", model)
        self.call("unload", model)
        self.call("load", model, loadable_config(live) if isinstance(live, dict) else None)
        return True


def _triton_error(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", "")) or str(exc.reason)
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def _parse(raw: bytes) -> tuple[str, str, dict[str, Any] | None, float]:
    """(op, model, config, found_dead_at) of one request line."""
    request = json.loads(raw)
    if (
        not isinstance(request, dict)
        or request.get("op") not in OPS
        or set(request) - {"op", "model", "config", "found_dead_at"}
    ):
        raise ValueError("a request is {op, model, config, found_dead_at} with op one of " + ", ".join(OPS))
    model, config = request.get("model", ""), request.get("config")
    if not isinstance(model, str) or (request["op"] != "index" and not model):
        raise ValueError("model must name a model")
    if config is not None and not isinstance(config, dict):
        raise ValueError("config must be an object")
    found = request.get("found_dead_at", 0.0)
    if not isinstance(found, int | float) or isinstance(found, bool) or not math.isfinite(found):
        raise ValueError("found_dead_at must be a time in seconds")
    return request["op"], model, config, float(found)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            uid = struct.unpack("3i", self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                raise PermissionError("another user")
            op, model, config, found_dead_at = _parse(self.rfile.readline(MAX_REQUEST_BYTES))
            triton = self.server.triton
            if op == "restart":
                result = self.server.control.restart_once(model, found_dead_at, lambda: triton.restart(model))
            elif op in ("load", "unload", "update"):
                with self.server.control.owner():
                    result = triton.call(op, model, config)
            else:
                result = triton.call(op, model, config)
            answer: dict[str, Any] = {"ok": True, "result": result}
        except (BrokerError, ValueError, PermissionError, TimeoutError) as exc:
            answer = {"ok": False, "error": str(exc)}
        self.wfile.write(json.dumps(answer).encode() + b"\n")


class _Server(socketserver.UnixStreamServer):
    control: ModelControl
    triton: TritonRepository


class Broker:
    """The broker of one server; ``start`` listens, ``stop`` removes the socket. One call at a time."""

    def __init__(self, http_url: str, admin_key: str, control: ModelControl | None = None) -> None:
        self.control = control if control is not None else ModelControl(http_url)
        self.path = socket_path(self.control)
        self._triton = TritonRepository(http_url, admin_key)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Broker:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # an earlier launcher's, on this address: it is gone
        umask = os.umask(0o177)
        try:
            server = _Server(str(self.path), _Handler)
        finally:
            os.umask(umask)
        server.control, server.triton = self.control, self._triton
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="model-control-broker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


class BrokerClient:
    """Asks the broker of the server at ``http_url`` (host:port as the server's processes name it)."""

    def __init__(self, http_url: str, timeout_s: float = 300.0, control: ModelControl | None = None) -> None:
        bare = urllib.parse.urlsplit(http_url).netloc if "://" in http_url else http_url
        self.path = socket_path(control if control is not None else ModelControl(bare))
        self.timeout_s = timeout_s

    def available(self) -> bool:
        return self.path.exists()

    def call(
        self,
        op: str,
        model: str = "",
        config: dict[str, Any] | None = None,
        found_dead_at: float | None = None,
    ) -> Any:
        body: dict[str, Any] = {"op": op, "model": model}
        if config is not None:
            body["config"] = config
        if found_dead_at is not None:
            body["found_dead_at"] = found_dead_at
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(str(self.path))
                sock.sendall(json.dumps(body).encode() + b"\n")
                with sock.makefile("rb") as reply:
                    answer = json.loads(reply.readline(MAX_REQUEST_BYTES * 16) or b"{}")
        except (OSError, ValueError) as exc:
            raise BrokerError(
                f"no model-control broker at {self.path} ({type(exc).__name__}): is the server's "
                "launcher (disagg serve) running, as this user?"
            ) from None
        if not answer.get("ok"):
            raise BrokerError(str(answer.get("error", "the broker gave no answer")))
        return answer.get("result")
