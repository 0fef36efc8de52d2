"""Which version of each pool new requests take, and the pin a request keeps to the end.

During a rollout a server runs two versions of every pool model side by side. Each request is pinned,
when it arrives, to one version per pool (``Routing.versions``: model name -> version), and every call
it makes to a pool (prefill, decode, a migration, a stop, a lease abort) goes to that version through
BLS ``model_version``. A prefill of version N therefore never hands KV to a decode of version N+1,
and a request started before a switch finishes on the pair it started on.

The routing is one small JSON file per server, written atomically by ``disagg rollout`` (the server's
model-control owner, ``disagg.control``) and read by every entry point instance when a request
arrives: one ``stat`` per request, a read only when it changed. No file: no pin (``-1``, Triton's
choice: the latest version its policy loaded), which is right while only one version is loaded.

The pin travels with the request's task as a context variable (``PINNED``): asyncio copies the
context into every task the request starts, so the pool client reads it without each call passing
it along.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from disagg.statefile import write_private

log = logging.getLogger(__name__)

LATEST = -1  # BLS model_version: the server's choice
PINNED: contextvars.ContextVar[Mapping[str, int]] = contextvars.ContextVar(
    "disagg_pinned_versions", default=MappingProxyType({})
)


def pinned_version(model: str) -> int:
    """The version of ``model`` the current request is pinned to (``LATEST``: none)."""
    return PINNED.get().get(model, LATEST)


@dataclass(frozen=True)
class Routing:
    """New requests take ``versions`` (model -> version); ``previous`` is what they took before the
    last switch (``disagg rollout --rollback`` goes back to it)."""

    versions: Mapping[str, int] = field(default_factory=dict)
    previous: Mapping[str, int] = field(default_factory=dict)
    changed_at: float = 0.0

    def to_json(self) -> str:
        body = {"versions": dict(self.versions), "previous": dict(self.previous)}
        return json.dumps({**body, "changed_at": self.changed_at}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Routing:
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) - {"versions", "previous", "changed_at"}:
            raise ValueError("routing file has unknown keys")
        return cls(
            _versions(data.get("versions", {})),
            _versions(data.get("previous", {})),
            float(data.get("changed_at", 0.0)),
        )

    def switched(self, versions: Mapping[str, int]) -> Routing:
        """The routing after new requests move to ``versions``."""
        return Routing(dict(versions), dict(self.versions), time.time())


def _versions(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError("routing versions must be an object")
    out = {}
    for model, version in value.items():
        if not isinstance(model, str) or isinstance(version, bool) or not isinstance(version, int):
            raise ValueError("routing versions map model names to integers")
        if version < 1:
            raise ValueError("routing versions are >= 1")
        out[model] = version
    return out


class RoutingFile:
    """The routing file of one server, re-read only when its stat changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._routing = Routing()

    def current(self) -> Routing:
        """The routing now; the last good one while the file is unreadable or malformed (logged)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._routing = None, Routing()
            return self._routing
        except OSError:
            return self._routing
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                self._routing = Routing.from_json(self.path.read_text())
            except (OSError, ValueError):
                log.warning("routing file %s is not valid; keeping the last routing", self.path)
            self._stamp = stamp
        return self._routing

    def write(self, routing: Routing) -> None:
        """Replace the file atomically (readers see the old routing or the new one, never a part)."""
        write_private(self.path, routing.to_json())

    def clear(self) -> None:
        """Remove the file: no pins (one version loaded)."""
        self.path.unlink(missing_ok=True)
