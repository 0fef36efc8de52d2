"""The servers of one remote pool, and which of them a call goes to (no I/O here but the DNS lookup).

A pool on other hosts is named by a spec, ``ENTRY[,ENTRY...]``, each entry either ``HOST:PORT`` (a
Triton server's gRPC endpoint) or ``dns:NAME:PORT``: every address ``NAME`` resolves to, looked up again
at most every ``refresh_s``. A Kubernetes headless Service resolves to one address per ready pod, so a
pool Deployment scaled out is used without restarting the frontend, and a pod that goes is dropped.

Each server is *unknown* until its first ping, then *up* or *down* by its last one. Calls go to the up
server with the fewest calls open (ties in turn); to an unknown one when none is up yet; never to a
down one. A server that fails a call or a ping is marked down at once, so the next calls avoid it
until a ping finds it back. Its open calls are not given up here: a server that died ends them with a
connection error, and one cut off by a partition by the gRPC keepalive (``disagg.triton.remote``).
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from disagg.protocol.errors import UNAVAILABLE, ServingError

REFRESH_S = 5.0  # the most often a dns: entry is resolved again
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")

Resolve = Callable[[str], "list[str] | None"]


def resolve_host(name: str) -> list[str] | None:
    """Every address ``name`` resolves to (blocking: call it off the event loop); None when the lookup
    failed (no answer), as opposed to an answer without addresses."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return [] if exc.errno == socket.EAI_NONAME else None
    except OSError:
        return None
    return sorted({info[4][0] for info in infos})


@dataclass(frozen=True)
class Entry:
    host: str
    port: int
    dns: bool = False  # resolve ``host`` to every address it has


def _url(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def parse_spec(spec: str) -> tuple[Entry, ...]:
    """The entries of a pool's spec; ValueError naming what is wrong."""
    entries = []
    for raw in spec.split(","):
        text = raw.strip()
        dns = text.startswith("dns:")
        if dns:
            text = text[len("dns:") :]
        host, _, port = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"remote server {raw.strip()!r} needs a port (HOST:PORT or dns:NAME:PORT)")
        if not _HOST_RE.match(host) and not _is_ip(host):
            raise ValueError(f"remote server {raw.strip()!r} has no valid host")
        entries.append(Entry(host, int(port), dns))
    return tuple(entries)


def parse_remote_pools(text: str) -> dict[str, str]:
    """``POOL=SPEC[;POOL=SPEC...]`` (e.g. ``prefill=10.0.0.2:8001;decode=dns:decode.ns.svc:8001``)
    as pool -> spec, each spec checked; ValueError naming what is wrong."""
    pools: dict[str, str] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        pool, sep, spec = part.partition("=")
        pool = pool.strip()
        if not sep or not pool or pool in pools:
            raise ValueError(f"remote_pools entry {part!r} must be POOL=SERVERS, each pool once")
        parse_spec(spec)
        pools[pool] = spec.strip()
    return pools


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class Endpoint:
    """One server of a pool as the orchestrator sees it."""

    url: str
    up: bool | None = None  # None: not pinged yet
    open: int = 0  # calls on it now
    listed: bool = True  # still in the spec's resolution (a server that left keeps its open calls)


class Endpoints:
    """The servers of one pool (see the module docstring)."""

    def __init__(self, pool: str, spec: str, resolve: Resolve = resolve_host) -> None:
        self.pool = pool
        self.entries = parse_spec(spec)
        self._resolve = resolve
        self._by_url: dict[str, Endpoint] = {}
        self._turn: Iterator[int] = itertools.count()
        self._resolved_at: float | None = None
        self.refresh(0.0)

    @property
    def dynamic(self) -> bool:
        return any(entry.dns for entry in self.entries)

    def refresh(self, now: float) -> bool:
        """Resolve the spec again if ``REFRESH_S`` passed (blocking for dns: entries); True if it did.
        Servers that appear are added (unknown until pinged); servers that left are no longer picked.
        On an event loop, call ``resolve`` on a thread and ``apply`` on the loop instead."""
        if not self.due(now):
            return False
        self.apply(self.resolve(), now)
        return True

    def due(self, now: float) -> bool:
        """Whether the spec is due to be resolved again."""
        return self._resolved_at is None or (self.dynamic and now - self._resolved_at >= REFRESH_S)

    def resolve(self) -> list[str] | None:
        """The servers' URLs the spec names now (blocking for dns: entries); None when a lookup failed
        (the list stays as it was: a DNS hiccup does not empty the pool). Touches no state."""
        urls = []
        for entry in self.entries:
            hosts = self._resolve(entry.host) if entry.dns else [entry.host]
            if hosts is None:
                return None
            urls += [_url(host, entry.port) for host in hosts]
        return urls

    def apply(self, urls: list[str] | None, now: float) -> None:
        """Make ``urls`` (from ``resolve``) the listed servers."""
        self._resolved_at = now
        if urls is None:
            return
        for endpoint in self._by_url.values():
            endpoint.listed = endpoint.url in urls
        for url in urls:
            self._by_url.setdefault(url, Endpoint(url))
        for url in [u for u, e in self._by_url.items() if not e.listed and e.open == 0]:
            del self._by_url[url]

    def listed(self) -> list[Endpoint]:
        """The servers the spec names now (the ones to ping)."""
        return [e for e in self._by_url.values() if e.listed]

    def get(self, url: str) -> Endpoint | None:
        return self._by_url.get(url)

    def pick(self) -> Endpoint:
        """The server for a new call; ServingError(UNAVAILABLE) when none may take it."""
        listed = self.listed()
        candidates = [e for e in listed if e.up] or [e for e in listed if e.up is None]
        if not candidates:
            where = "no server is listed" if not listed else f"none of its {len(listed)} servers answers"
            raise ServingError(UNAVAILABLE, f"the remote {self.pool} pool is not available ({where})")
        least = min(e.open for e in candidates)
        tied = [e for e in candidates if e.open == least]
        return tied[next(self._turn) % len(tied)]

    def answered(self, endpoint: Endpoint) -> bool:
        """A ping answered; True if the server was not up before."""
        was, endpoint.up = endpoint.up, True
        return was is not True

    def down(self, endpoint: Endpoint) -> None:
        """The server failed a call or a ping: no new calls until a ping finds it back."""
        endpoint.up = False

    def all_down(self) -> None:
        for endpoint in self._by_url.values():
            endpoint.up = False
