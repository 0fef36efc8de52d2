"""Internal tokens: pools serve only calls that carry one, signed with the deployment secret and bound
to the one call it was minted for.

A token is ``<expiry>.<hex HMAC-SHA256(secret, "pool-call|<expiry>|<subject>")>``. The subject is what
the call is about (``wire.call_subject``): the job's handle (the request's id, with its attempt after a
migration), or the control message itself (stop this handle, abort this lease, ping). The orchestrator
mints one per call (short expiry) and passes it as the request parameter ``disagg_auth``; Triton
clients never see it, so a client that calls a pool directly has none and is refused before any work
starts. A token captured on the wire starts no other work: for another handle or another control
message its MAC does not match.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from disagg.protocol.errors import ServingError, invalid

PARAMETER = "disagg_auth"
DEFAULT_TTL_S = 60.0
MAX_TOKEN_CHARS = 128
_CONTEXT = b"pool-call|"

MALFORMED, MISMATCH, EXPIRED = "malformed", "mismatch", "expired"
REFUSALS = (MALFORMED, MISMATCH, EXPIRED)
"""Why a token is refused: not a token (or none), signed for another call (or forged), out of date."""


class TokenSigner:
    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("the deployment secret is too short")
        self._secret = secret
        self._clock = clock

    def _mac(self, expiry: str, subject: bytes) -> str:
        message = _CONTEXT + expiry.encode() + b"|" + subject
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def mint(self, subject: bytes, ttl_s: float = DEFAULT_TTL_S) -> str:
        """A token for the one call about `subject`."""
        expiry = str(int(self._clock() + ttl_s))
        return f"{expiry}.{self._mac(expiry, subject)}"

    def refusal(self, token: object, subject: bytes) -> str | None:
        """Why `token` does not admit the call about `subject` (one of REFUSALS), or None."""
        if not isinstance(token, str) or token.count(".") != 1 or len(token) > MAX_TOKEN_CHARS:
            return MALFORMED
        expiry, mac = token.split(".")
        if not expiry.isdigit():
            return MALFORMED
        if not hmac.compare_digest(mac, self._mac(expiry, subject)):
            return MISMATCH
        if int(expiry) < self._clock():
            return EXPIRED
        return None

    def check(self, token: object, subject: bytes) -> None:
        """Raise ServingError(INVALID_ARG) unless ``token`` is a valid, unexpired token for `subject`."""
        reason = self.refusal(token, subject)
        if reason is not None:
            raise refused(reason)


def refused(reason: str) -> ServingError:
    """The error a call refused for `reason` (one of REFUSALS) gets: INVALID_ARG, naming no detail of
    the token beyond its expiry."""
    if reason == EXPIRED:
        return invalid("internal token expired")
    return invalid("this model is internal: requests must come through the orchestrator")
