"""The signed descriptor by which the TensorRT-LLM backend hands a sequence to another engine.

NOT VERIFIED against a real TensorRT-LLM, like the backend (``disagg.engine.trtllm``) that uses it: the
``DisaggregatedParams`` fields it carries follow TensorRT-LLM's documented LLM API, tested only through
the fake in ``tests/unit/engine/fake_trtllm.py``.

The descriptor is an HMAC-signed envelope (``disagg.kv.envelope``, purpose :data:`PURPOSE`) of one JSON
body with exactly these fields::

    version      VERSION
    engine       "tensorrt_llm"
    fingerprint  the model and block size (fingerprint()): an importer of another model refuses it
    lease_id     new_lease_id(), used once: a replayed descriptor is refused while it would be valid
    issued_at    the exporter's clock, seconds
    expires_at   issued_at + ttl_s
    trtllm       TensorRT-LLM's DisaggregatedParams of the context request, JSON-safe (params_to_wire)
    state        the SequenceState (prompt, the first token, sampling parameters)

No KV bytes travel in it: TensorRT-LLM's own cache transceiver moves them. The body is signed, not
encrypted: the prompt is in the clear.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disagg.engine.backend import Exported
from disagg.engine.sequence import SequenceState
from disagg.kv.descriptor import new_lease_id
from disagg.kv.envelope import open_sealed, seal
from disagg.kv.errors import DescriptorError, LeaseExpired, LeaseGone

__all__ = [
    "ENGINE",
    "MAX_DESCRIPTOR_BYTES",
    "PURPOSE",
    "VERSION",
    "DescriptorSeal",
    "Handoff",
    "fingerprint",
    "params_to_wire",
]

PURPOSE = "disagg.trtllm.descriptor"
VERSION = 1
ENGINE = "tensorrt_llm"
MAX_DESCRIPTOR_BYTES = 1 << 20
_FIELDS = {"version", "engine", "fingerprint", "lease_id", "issued_at", "expires_at", "trtllm", "state"}
# DisaggregatedParams fields that travel (JSON-safe; opaque_state as base64). Older TensorRT-LLM
# versions lack some: only those that are set are passed back.
_PARAMS = (
    "first_gen_tokens",
    "ctx_request_id",
    "opaque_state",
    "draft_tokens",
    "disagg_request_id",
    "ctx_dp_rank",
    "ctx_info_endpoint",
)
Clock = Callable[[], float]


def fingerprint(model_id: str, tokens_per_block: int) -> str:
    """What a descriptor names its model by: exporter and importer must agree on model and block size."""
    return hashlib.blake2b(f"{model_id}|{tokens_per_block}".encode(), digest_size=8).hexdigest()


def params_to_wire(params: Any) -> dict[str, Any]:
    """TensorRT-LLM's ``DisaggregatedParams`` as the body's ``trtllm`` field: the known fields that are
    set, token lists as ints, ``opaque_state`` as base64. Whether ``first_gen_tokens`` is there is the
    caller's check (its absence is TensorRT-LLM's failure, not the descriptor's)."""
    wire: dict[str, Any] = {}
    for name in _PARAMS:
        value = getattr(params, name, None)
        if value is None:
            continue
        if name == "opaque_state":
            value = base64.b64encode(bytes(value)).decode()
        elif name in ("first_gen_tokens", "draft_tokens"):
            value = [int(t) for t in value]
        wire[name] = value
    return wire


@dataclass(frozen=True)
class Handoff:
    """An opened descriptor whose signature, fields, fingerprint and lifetime were checked."""

    lease_id: str
    expires_at: float
    wire: dict[str, Any]  # the body's ``trtllm`` field
    state: SequenceState  # as sealed: the importer compares it with the state it was given

    @property
    def first_gen_tokens(self) -> list[int]:
        """The tokens TensorRT-LLM's context request generated (checked non-empty ints)."""
        return self.wire["first_gen_tokens"]

    def disaggregated_params(self) -> dict[str, Any]:
        """Keyword arguments for ``DisaggregatedParams`` (``request_type`` aside): the fields that
        are set, ``opaque_state`` decoded back to bytes."""
        params = {k: v for k, v in self.wire.items() if v is not None}
        if "opaque_state" in params:
            params["opaque_state"] = base64.b64decode(params["opaque_state"])
        return params


class DescriptorSeal:
    """Seals descriptors at export and opens and checks them at import, for one backend.

    ``fingerprint`` is this backend's (:func:`fingerprint`); ``secret`` signs, or, unset, the
    transport passed to :meth:`seal` / :meth:`unseal` supplies it (``transport.config.secret``).
    Keeps the leases it admitted until they expire, so that a descriptor imports once: :meth:`unseal`
    refuses a claimed lease, :meth:`claim` records one, :meth:`release` forgets it again (the import
    failed before anything arrived, and the caller may retry while the lease lives). Thread-safe.
    """

    def __init__(self, fingerprint: str, *, ttl_s: float, clock: Clock, secret: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self._ttl_s = ttl_s
        self._clock = clock
        self._secret_bytes = secret
        self._lock = threading.Lock()
        self._consumed: OrderedDict[str, float] = OrderedDict()  # lease id -> expiry (replay guard)

    def seal(self, state: SequenceState, wire: dict[str, Any], transport: Any) -> Exported:
        """Sign ``state`` and TensorRT-LLM's params (``wire``, from :func:`params_to_wire`) under a
        new lease that lives ``ttl_s``."""
        secret = self._secret(transport)
        lease_id, now = new_lease_id(), self._clock()
        body = {
            "version": VERSION,
            "engine": ENGINE,
            "fingerprint": self.fingerprint,
            "lease_id": lease_id,
            "issued_at": now,
            "expires_at": now + self._ttl_s,
            "trtllm": wire,
            "state": state.to_dict(),
        }
        return Exported(seal(body, secret, PURPOSE), lease_id, state)

    def unseal(self, descriptor: bytes, transport: Any) -> Handoff:
        """Verify and check ``descriptor``. Raises DescriptorError (forged, malformed, another model),
        LeaseExpired, LeaseGone (already claimed) or InvalidRequest (a malformed sealed state).
        Claims nothing: call :meth:`claim` once the import is admitted."""
        body = open_sealed(descriptor, self._secret(transport), PURPOSE, MAX_DESCRIPTOR_BYTES)
        lease_id, expires_at, wire = self._check(body)
        return Handoff(lease_id, expires_at, wire, SequenceState.from_dict(body["state"]))

    def claim(self, handoff: Handoff) -> None:
        """Record the lease as used (until it expires); forget the leases that expired."""
        now = self._clock()
        with self._lock:
            while self._consumed and next(iter(self._consumed.values())) < now:
                self._consumed.popitem(last=False)
            self._consumed[handoff.lease_id] = handoff.expires_at

    def release(self, handoff: Handoff) -> None:
        """Forget a claim: the descriptor may be imported again while its lease lives."""
        with self._lock:
            self._consumed.pop(handoff.lease_id, None)

    def _check(self, body: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        if body.get("version") != VERSION or set(body) != _FIELDS or body.get("engine") != ENGINE:
            raise DescriptorError("descriptor has an unknown version or fields")
        if body["fingerprint"] != self.fingerprint:
            raise DescriptorError("descriptor is for another model or block size")
        lease_id, issued, expires = body["lease_id"], body["issued_at"], body["expires_at"]
        if not isinstance(lease_id, str) or len(lease_id) != 32:
            raise DescriptorError("descriptor lease id is invalid")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (issued, expires)):
            raise DescriptorError("descriptor lifetime is invalid")
        if not 0 < expires - issued <= 3600:
            raise DescriptorError("descriptor lifetime is out of range")
        if self._clock() >= expires:
            raise LeaseExpired("descriptor lease has expired")
        wire = body["trtllm"]
        if not isinstance(wire, dict) or not set(wire) <= set(_PARAMS):
            raise DescriptorError("descriptor carries unknown TensorRT-LLM parameters")
        first = wire.get("first_gen_tokens")
        if not isinstance(first, list) or not first or not all(type(t) is int for t in first):
            raise DescriptorError("descriptor has no first generated tokens")
        if wire.get("opaque_state") is not None and not isinstance(wire["opaque_state"], str):
            raise DescriptorError("descriptor opaque state is malformed")
        with self._lock:
            if lease_id in self._consumed:
                raise LeaseGone("descriptor was already used")
        return lease_id, float(expires), wire

    def _secret(self, transport: Any) -> bytes:
        if self._secret_bytes is not None:
            return self._secret_bytes
        secret = getattr(getattr(transport, "config", None), "secret", None)
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("no deployment secret: set TrtllmConfig.secret or pass a transport with one")
        return secret
