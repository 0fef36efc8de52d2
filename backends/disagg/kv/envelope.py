"""HMAC-SHA256 signed JSON envelopes: the wire form of descriptors and acks.

Wire form (UTF-8 JSON): ``{"p": purpose, "b": "<body as a JSON string>", "m": "<hex mac>"}``.
The MAC covers the purpose and the exact body string, so the body is parsed only after the
signature checks out, and a descriptor cannot be passed off as an ack (or the reverse).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from disagg.kv.errors import DescriptorError

MAX_ENVELOPE_BYTES = 1 << 20


def _mac(secret: bytes, purpose: str, body: str) -> str:
    return hmac.new(secret, purpose.encode() + b"\x00" + body.encode(), hashlib.sha256).hexdigest()


def seal(body: dict[str, Any], secret: bytes, purpose: str) -> bytes:
    """Serialize ``body`` canonically and sign it for ``purpose``."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return json.dumps({"p": purpose, "b": text, "m": _mac(secret, purpose, text)}).encode()


def open_sealed(token: bytes | str, secret: bytes, purpose: str, max_bytes: int) -> dict[str, Any]:
    """Check size, shape and signature of ``token`` and return its body.

    Raises DescriptorError for anything else; the message never echoes the token.
    """
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes | bytearray | memoryview):
        raise DescriptorError("descriptor must be bytes")
    if len(token) > min(max_bytes, MAX_ENVELOPE_BYTES):
        raise DescriptorError("descriptor is larger than allowed")
    try:
        outer = json.loads(bytes(token))
    except (ValueError, UnicodeDecodeError):
        raise DescriptorError("descriptor is not valid JSON") from None
    if not isinstance(outer, dict) or set(outer) != {"p", "b", "m"}:
        raise DescriptorError("descriptor envelope has the wrong fields")
    if not all(isinstance(outer[k], str) for k in ("p", "b", "m")):
        raise DescriptorError("descriptor envelope has the wrong field types")
    expected = _mac(secret, purpose, outer["b"])
    # Compare before looking at the purpose so a wrong purpose and a forged MAC look alike.
    if not hmac.compare_digest(expected, outer["m"]) or outer["p"] != purpose:
        raise DescriptorError("descriptor signature is invalid")
    try:
        body = json.loads(outer["b"], parse_constant=_refuse_constant)
    except ValueError:
        raise DescriptorError("descriptor body is not valid JSON") from None
    if not isinstance(body, dict):
        raise DescriptorError("descriptor body must be an object")
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError("NaN and Infinity are not allowed")
