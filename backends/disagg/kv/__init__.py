"""KV cache layout and the hand-off between prefill and decode.

Public API: ``create_transport(kind, TransportConfig(secret=load_secret(...)))`` returns a
``Transport`` (see ``transport`` for the protocol); errors are in ``errors``.
"""

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
from disagg.kv.transport import (
    ImportResult,
    Transport,
    TransportConfig,
    create_transport,
    register_transport,
    transport_kinds,
)


def _fake() -> type[Transport]:
    from disagg.kv.fake import FakeTransport

    return FakeTransport


def _shm() -> type[Transport]:
    from disagg.kv.shm import ShmTransport

    return ShmTransport


def _nixl() -> type[Transport]:
    from disagg.kv.nixl import NixlTransport

    return NixlTransport


def _cuda_ipc() -> type[Transport]:
    from disagg.kv.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport


register_transport("fake", _fake)
register_transport("shm", _shm)
register_transport("nixl", _nixl)
register_transport("cuda_ipc", _cuda_ipc)

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
