"""Model readiness read from the server's own HTTP endpoint, for the pool watcher.

Why not ``pb_utils.is_model_ready``: on Triton 2.51 that call is a round trip through the stub's
queue to the server, answered on the model instance's stub-to-parent thread, and a call still open
when the server unloads the caller's own model aborts tritonserver (``boost::interprocess::
lock_exception`` in ``TRITONBACKEND_ModelInstanceFinalize``; seen about half the time at every shutdown
once the watcher asked every second). Over HTTP the question goes to the server's HTTP threads and
nothing of the stub's is held while it waits. At shutdown the pools are unloaded, or the endpoint is
gone: either way they read not ready, so the watcher neither gives up their calls nor restarts them.
(Not the server's own readiness: with strict readiness it is false whenever any model is loading,
a pool's restart included.)

The server's processes find the endpoint in ``DISAGG_SERVER_HTTP`` (host:port), which ``disagg serve``
and every launcher of the project set (``disagg.serverconfig.build_environment``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from disagg.serverconfig import ENV_SERVER_HTTP

TIMEOUT_S = 2.0


class ServerReadiness:
    """Readiness questions to one server's HTTP endpoint; any failure to answer reads "not ready"."""

    def __init__(self, http_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.base = f"http://{http_url}"
        self.timeout_s = timeout_s

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ServerReadiness | None:
        """The server this process runs in, when its launcher said where it listens; else None."""
        url = (os.environ if environ is None else environ).get(ENV_SERVER_HTTP, "")
        return cls(url) if url else None

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout_s) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError, ValueError):  # refused, 4xx/5xx, timed out, going away
            return False

    def server_exiting(self) -> bool:
        """The server is shutting down (or already gone): its liveness endpoint does not answer 200.

        Triton answers liveness with an error only once it is exiting, and it unloads models at exit
        only after every in-flight inference has ended (or its exit timeout forced the exit)."""
        return not self._ok("/v2/health/live")

    def model_ready(self, model: str) -> bool:
        """The server answers and reports ``model`` ready."""
        return self._ok(f"/v2/models/{urllib.parse.quote(model)}/ready")

    def model_config(self, model: str) -> dict[str, Any] | None:
        """``model``'s live config as the server reports it (what it runs now, an autoscaler's
        instance count included), or None when the server does not answer with one."""
        url = f"{self.base}/v2/models/{urllib.parse.quote(model)}/config"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                found = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return found if isinstance(found, dict) else None
