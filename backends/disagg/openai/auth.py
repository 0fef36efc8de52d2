"""The OpenAI front end's API key: every ``/v1/*`` route needs ``Authorization: Bearer <key>`` once a key
is set; ``/health`` and ``/metrics`` stay open.

The key comes from ``$DISAGG_API_KEY`` or from a file (``--api-key-file``); a flag holding the key
itself would show in ``ps``. Keys are compared in constant time. A refused request gets 401 with an
OpenAI error body (``code: invalid_api_key``) and is counted in
``disagg_auth_refusals_total{reason}``: ``missing`` (no Authorization header), ``malformed`` (not a
Bearer credential) or ``wrong``.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from disagg.openai.errors import INVALID_REQUEST, ApiError
from disagg.serverconfig import ENV_API_KEY

PROTECTED_PREFIX = "/v1/"
REASONS = ("missing", "malformed", "wrong")
MAX_KEY_BYTES = 4096


def load_key(env: Mapping[str, str], key_file: Path | None) -> str | None:
    """The API key: the file's content (stripped) when one is named, else ``$DISAGG_API_KEY``; None
    when neither is set. Raises ValueError for an empty or oversized key, or a file that cannot be
    read (naming it, never the key)."""
    if key_file is not None:
        try:
            key = key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {key_file}: cannot read it ({exc})") from None
        source = f"--api-key-file {key_file}"
    else:
        key = env.get(ENV_API_KEY, "")
        if not key:
            return None
        key, source = key.strip(), f"${ENV_API_KEY}"
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    if len(key.encode()) > MAX_KEY_BYTES or any(c.isspace() for c in key):
        raise ValueError(f"{source}: the API key must be at most {MAX_KEY_BYTES} bytes, without spaces")
    return key


class Refusals:
    """``disagg_auth_refusals_total{reason}`` in the front end's own registry (served at /metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "disagg_auth_refusals_total",
            "OpenAI requests refused for their API key, by reason (missing, malformed, wrong)",
            ["reason"],
            registry=registry,
        )
        for reason in REASONS:
            self.counter.labels(reason=reason)  # every series exists from the start, at 0

    def count(self, reason: str) -> None:
        self.counter.labels(reason=reason).inc()


def refusal(headers: Mapping[str, str], key: str) -> str | None:
    """Why a request with `headers` is refused under `key` (a REASONS entry), or None to let it in."""
    header = headers.get("Authorization")
    if header is None:
        return "missing"
    scheme, _, credential = header.partition(" ")
    credential = credential.strip()
    if scheme.lower() != "bearer" or not credential:
        return "malformed"
    if not hmac.compare_digest(credential.encode(), key.encode()):
        return "wrong"
    return None


def unauthorized(reason: str) -> ApiError:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        if reason in ("missing", "malformed")
        else "Incorrect API key provided."
    )
    return ApiError(401, message, INVALID_REQUEST, None, "invalid_api_key")


def middleware(key: str, refusals: Refusals) -> Any:
    """An aiohttp middleware refusing every ``/v1/*`` request without the key."""

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIX):
            reason = refusal(request.headers, key)
            if reason is not None:
                refusals.count(reason)
                raise unauthorized(reason)
        return await handler(request)

    return require_key
