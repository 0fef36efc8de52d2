"""Pool tokens bound to one call: a token admits the job (handle) or control message it was minted
for, and no other; forged, malformed and expired tokens are refused with their reason."""

from __future__ import annotations

import pytest
from kv_support import Clock

from disagg.protocol.errors import INVALID_ARG, ServingError
from disagg.protocol.messages import Stop
from disagg.serving.auth import EXPIRED, MALFORMED, MISMATCH, TokenSigner
from disagg.triton import wire

SECRET = b"s" * 32


def test_a_token_admits_only_the_call_it_was_minted_for() -> None:
    signer = TokenSigner(SECRET, Clock())
    job = wire.call_subject("req-1~0", None)
    token = signer.mint(job)
    assert signer.refusal(token, job) is None
    signer.check(token, job)
    for other in (
        wire.call_subject("req-2~0", None),  # another request
        wire.call_subject("req-1~1", None),  # the same request's next attempt
        wire.call_subject(None, wire.encode_control(Stop("req-1~0"))),  # a control message
    ):
        assert signer.refusal(token, other) == MISMATCH
        with pytest.raises(ServingError) as refused:
            signer.check(token, other)
        assert refused.value.code == INVALID_ARG and "internal" in refused.value.message


def test_control_tokens_are_bound_to_their_message() -> None:
    signer = TokenSigner(SECRET, Clock())
    stop = wire.call_subject(None, wire.encode_control(Stop("job-1")))
    token = signer.mint(stop)
    assert signer.refusal(token, stop) is None
    assert signer.refusal(token, wire.call_subject(None, wire.encode_control(Stop("job-2")))) == MISMATCH
    # the two sides compute the subject from str (the caller) and bytes (the pool's tensor) alike
    assert wire.call_subject("h", None) == wire.call_subject(b"h", None) != wire.call_subject(None, "h")


def test_forged_malformed_and_expired_tokens_are_refused_with_their_reason() -> None:
    clock = Clock()
    signer = TokenSigner(SECRET, clock)
    job = wire.call_subject("req-1", None)
    assert TokenSigner(b"t" * 32, clock).refusal(signer.mint(job), job) == MISMATCH  # another secret
    for bad in (None, 42, "", "no-dot", "1.2.3", "x.abc", "1." + "a" * 200):
        assert signer.refusal(bad, job) == MALFORMED, bad
    token = signer.mint(job, ttl_s=10)
    clock.now += 11
    assert signer.refusal(token, job) == EXPIRED
    with pytest.raises(ServingError, match="expired"):
        signer.check(token, job)
