"""KV cache layout and the hand-off between prefill and decode.

Public API: ``create_transport(kind, TransportConfig(secret=load_secret(...)))`` returns a
``Transport`` (see ``transport`` for the protocol); errors are in ``errors``.

Importing this package does not import torch: the layout, descriptors, errors and secrets load
now; the transport names (which need torch) load on first access, so the torch-free text path
(tokenizer, orchestrator, error mapping) can use ``disagg.kv.errors`` and ``disagg.kv.stale``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from disagg.kv.descriptor import Descriptor, DescriptorLimits
from disagg.kv.errors import (
    ChecksumMismatch,
    DescriptorError,
    KVError,
    LeaseExpired,
    LeaseGone,
    SecretError,
    TransferError,
    TransportClosed,
)
from disagg.kv.layout import KVLayout
from disagg.kv.secret import load_secret

if TYPE_CHECKING:
    from disagg.kv.transport import (
        ImportResult,
        Transport,
        TransportConfig,
        create_transport,
        register_transport,
        transport_kinds,
    )

# Names that live in a torch-dependent module, loaded on first access: name -> module.
_LAZY: dict[str, str] = {
    "ImportResult": "disagg.kv.transport",
    "Transport": "disagg.kv.transport",
    "TransportConfig": "disagg.kv.transport",
    "create_transport": "disagg.kv.transport",
    "register_transport": "disagg.kv.transport",
    "transport_kinds": "disagg.kv.transport",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ChecksumMismatch",
    "Descriptor",
    "DescriptorError",
    "DescriptorLimits",
    "ImportResult",
    "KVError",
    "KVLayout",
    "LeaseExpired",
    "LeaseGone",
    "SecretError",
    "TransferError",
    "Transport",
    "TransportClosed",
    "TransportConfig",
    "create_transport",
    "load_secret",
    "register_transport",
    "transport_kinds",
]
