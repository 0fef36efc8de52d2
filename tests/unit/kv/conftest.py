from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kv_support import SECRET, Clock

from disagg.kv import Transport, TransportConfig, create_transport
from disagg.kv.cuda_ipc import CudaIpcTransport, FakeCudaIpc
from disagg.kv.faulty import FaultyTransport
from disagg.kv.stale import list_regions


@pytest.fixture
def prefix() -> Iterator[str]:
    p = "t" + secrets.token_hex(5)
    yield p
    assert list_regions("/dev/shm", p) == [], "shm regions leaked"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(prefix: str, clock: Clock) -> Iterator[Callable[..., Any]]:
    """make(kind, **config) -> a transport; all closed at teardown. cuda_ipc shares one fake GPU."""
    made: list[Any] = []
    gpu = FakeCudaIpc()

    def factory(kind: str, on_release: Any = None, **cfg: Any) -> Any:
        cfg.setdefault("checksum", True)
        cfg.setdefault("transfer_timeout_s", 10.0)
        config = TransportConfig(secret=SECRET, prefix=prefix, **cfg)
        t: Transport | FaultyTransport
        if kind == "cuda_ipc":
            t = CudaIpcTransport(config, backend=gpu, clock=clock, on_release=on_release)
        elif kind == "faulty":
            t = FaultyTransport(
                create_transport("shm", config, clock=clock, on_release=on_release), sleep=lambda s: None
            )
        else:
            t = create_transport(kind, config, clock=clock, on_release=on_release)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.close()
