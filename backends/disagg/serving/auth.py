"""Internal tokens: pools serve only requests that carry one, signed with the deployment secret.

A token is ``<expiry>.<hex HMAC-SHA256(secret, "pool-call|<expiry>")>``. The orchestrator mints one
per call (short expiry) and passes it as the request parameter ``disagg_auth``; Triton clients never
see it, so a client that calls a pool directly has none and is refused before any work starts.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from disagg.serving.errors import invalid

PARAMETER = "disagg_auth"
DEFAULT_TTL_S = 60.0
_CONTEXT = b"pool-call|"


class TokenSigner:
    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("the deployment secret is too short")
        self._secret = secret
        self._clock = clock

    def _mac(self, expiry: str) -> str:
        return hmac.new(self._secret, _CONTEXT + expiry.encode(), hashlib.sha256).hexdigest()

    def mint(self, ttl_s: float = DEFAULT_TTL_S) -> str:
        expiry = str(int(self._clock() + ttl_s))
        return f"{expiry}.{self._mac(expiry)}"

    def check(self, token: object) -> None:
        """Raise ServingError(INVALID_ARG) unless ``token`` is a valid, unexpired internal token."""
        refused = invalid("this model is internal: requests must come through the orchestrator")
        if not isinstance(token, str) or token.count(".") != 1 or len(token) > 128:
            raise refused
        expiry, mac = token.split(".")
        if not expiry.isdigit() or not hmac.compare_digest(mac, self._mac(expiry)):
            raise refused
        if int(expiry) < self._clock():
            raise invalid("internal token expired")
