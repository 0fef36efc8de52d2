"""Helpers for integration tests against a real Triton: polling, ports, leak snapshots, client calls.

Plain functions and classes (no fixtures), so tests and other helpers can import them:
`from triton_support import wait_until, LeakProbe, GrpcStream, ...` (this folder is on `sys.path`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import queue
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np

from disagg.server import ServerConfig, ServerError, TritonServer
from disagg.tritonbin import prepare_backend_directory

T = TypeVar("T")

SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("disagg", "triton_python_backend")
"""/dev/shm names the leak probe watches: the project's KV regions (`disagg-<pid>-...`), the Python backend
regions of servers started here (`disagg_<id>_...`) and Triton's default prefix. /dev/shm is shared by
the whole machine: other processes' entries (e.g. `sem.mp-*` of concurrent test runs) are not ours."""
REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_REPOS = Path(__file__).resolve().parent / "repos"
TEST_BACKENDS = Path(__file__).resolve().parent / "backends"


def wait_until(
    predicate: Callable[[], T], timeout_s: float, what: str = "condition", interval_s: float = 0.05
) -> T:
    """Poll `predicate` until it returns something truthy (returned) or `timeout_s` passes (AssertionError).

    The only way tests wait for asynchronous effects: never a bare `sleep`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:.1f} s (last value: {value!r})")
        time.sleep(interval_s)


def log_count(server: Any, text: str) -> int:
    """How often `text` occurs in `server`'s log so far: a cue a test can wait on (with `wait_until`)
    where a server's step shows nowhere else, e.g. a pool's loop thread busy inside one call."""
    if server.log_path is None:
        raise ValueError("the server logs to the terminal: nothing to count in")
    return server.log_path.read_text(encoding="utf-8", errors="replace").count(text)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free right now on `host` (all bound at once, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _proc_stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or None if it is gone."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid, pgrp = line.rsplit(")", 1)[1].split()[:3]
    return state, int(ppid), int(pgrp)


def live_children(pid: int) -> frozenset[int]:
    """Direct, non-zombie children of `pid`."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = _proc_stat(entry.name)
            if info is not None and info[1] == pid and info[0] != "Z":
                children.add(int(entry.name))
    return frozenset(children)


def descendants(pid: int) -> frozenset[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = live_children(frontier.pop()) - found
        found |= children
        frontier.extend(children)
    return frozenset(found)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    except OSError:
        pass
    return inodes


def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian words of hex) in its usual form."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(words)}:{int(port, 16)}"


def listening_addresses(pids: Iterable[int]) -> set[str]:
    """`address:port` of every TCP socket in LISTEN state held open by one of `pids`."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    out.add(_hex_address(fields[1]))
    return out


def live_group_members(pgid: int) -> frozenset[int]:
    """Non-zombie processes of process group `pgid` (a server started by `TritonServer` and its stubs)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = _proc_stat(entry.name)
            if info is not None and info[2] == pgid and info[0] != "Z":
                members.add(int(entry.name))
    return frozenset(members)


def shm_entries(prefix: str = "") -> frozenset[str]:
    """Names in /dev/shm, optionally only those starting with `prefix`."""
    return frozenset(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def open_fds() -> frozenset[int]:
    """This process's open fds, without the one `listdir` used to read /proc/self/fd (listed, then
    closed: counted, it could hide a new fd that took its number, and show itself in its place)."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
    return frozenset(fd for fd in listed if _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def fd_target(fd: int) -> str:
    """What fd `fd` of this process refers to (a path, `socket:[inode]`, `anon_inode:[eventfd]`...)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "(closed)"


TRITON_ABORTS: list[str] = []
"""Tests in which tritonserver itself aborted (Triton 2.51's lock_exception under a killed stub): the
run's summary reports how many."""

RUNNING_SERVERS: list[TritonServer] = []
"""Servers the factories started and have not stopped: the leak probe reads their pools' KV blocks."""


def kv_blocks_held() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """KV blocks each pool instance of each running server holds for requests, by (metrics URL, series
    labels). A server that does not answer is left out. Blocks the prefix cache keeps are free ones
    (``disagg_prefix_cache_blocks``), never in ``disagg_kv_blocks_used``: how many it keeps may fall
    (evictions, a reloaded instance) without any block being held."""
    held = {}
    RUNNING_SERVERS[:] = [server for server in RUNNING_SERVERS if server.returncode is None]
    for server in RUNNING_SERVERS:
        try:
            samples = scrape_metrics(server.config.metrics_url)
        except OSError:
            continue
        for labels, used in metric_series(samples, "disagg_kv_blocks_used").items():
            held[(server.config.metrics_url, labels)] = used
    return held


@dataclass(frozen=True)
class LeakSnapshot:
    """Resources that a test must give back: /dev/shm entries (see `SHM_PREFIXES`), this process's open
    fds, its Python threads and its child processes, and the KV blocks the running servers' pools hold
    for requests."""

    shm: frozenset[str]
    fds: frozenset[int]
    threads: frozenset[int]
    children: frozenset[int]
    kv_blocks: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def take(cls) -> LeakSnapshot:
        return cls(
            shm=frozenset(name for name in shm_entries() if name.startswith(SHM_PREFIXES)),
            fds=open_fds(),
            threads=frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            children=live_children(os.getpid()),
            kv_blocks=kv_blocks_held(),
        )

    def leaks_since(self, before: LeakSnapshot) -> dict[str, list[Any]]:
        """What exists now and did not exist in `before` (empty dict: nothing leaked)."""
        found = {
            "shm": sorted(self.shm - before.shm),
            "fds": [f"{fd} -> {fd_target(fd)}" for fd in sorted(self.fds - before.fds)],
            "threads": sorted(
                t.name for t in threading.enumerate() if t.ident in self.threads - before.threads
            ),
            "children": sorted(self.children - before.children),
            # a pool instance holding more blocks than before the test (one present both times)
            "kv_blocks": sorted(
                f"{url} {dict(labels)}: {before.kv_blocks[(url, labels)]:g} -> {held:g}"
                for (url, labels), held in self.kv_blocks.items()
                if held > before.kv_blocks.get((url, labels), held)
            ),
        }
        return {kind: items for kind, items in found.items() if items}


class LeakProbe:
    """Baseline taken at construction; `check(timeout_s)` polls until nothing new remains, or fails
    listing what leaked. Resources that existed at the baseline may disappear freely."""

    def __init__(self) -> None:
        self.before = LeakSnapshot.take()
        self.ignored_shm: tuple[str, ...] = ()

    def ignore_shm(self, prefix: str) -> None:
        """Leave /dev/shm names starting with `prefix` out: e.g. a module server's own Python backend
        regions, which grow on demand and live until that server exits (the factory checks them then)."""
        self.ignored_shm += (prefix,)

    def leaks(self) -> dict[str, list[Any]]:
        leaks = LeakSnapshot.take().leaks_since(self.before)
        if self.ignored_shm and "shm" in leaks:
            leaks["shm"] = [name for name in leaks["shm"] if not name.startswith(self.ignored_shm)]
            if not leaks["shm"]:
                del leaks["shm"]
        return leaks

    def check(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            leaks = self.leaks()
            if not leaks:
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"resources leaked (still there after {timeout_s:.0f} s): {leaks}")
            time.sleep(0.05)


# ---- clients -------------------------------------------------------------------------------------------


class ClientThreads:
    """Client threads running ``self._run(index)`` until ``_stop`` is set; a context manager that starts
    them on entry and stops and joins them on exit. Subclasses keep their results behind ``_lock``."""

    JOIN_TIMEOUT_S = 120.0

    def __init__(self, clients: int) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(clients)
        ]

    def _run(self, index: int) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.JOIN_TIMEOUT_S)


def grpc_inputs(values: Mapping[str, np.ndarray]) -> list[Any]:
    """`tritonclient.grpc.InferInput`s for named numpy arrays (dtype and shape taken from the arrays)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass(frozen=True)
class StreamEvent:
    """One item of a gRPC stream: a result (with `final` from Triton's final-response flag) or an error."""

    result: Any | None
    error: Exception | None
    final: bool


class GrpcStream:
    """A `tritonclient.grpc` bidirectional stream whose responses are queued as `StreamEvent`s.

    Use as a context manager: the stream and client are closed on exit (no leaked channel threads or fds).
    Requests are sent with `enable_empty_final_response=True`, so every request ends with `final`.
    """

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self._closed = False
        self.events: queue.Queue[StreamEvent] = queue.Queue()
        self.client.start_stream(callback=self._on_response, headers=dict(headers or {}))

    def _on_response(self, result: Any, error: Exception | None) -> None:
        final = False
        if result is not None:
            params = result.get_response().parameters
            final = "triton_final_response" in params and params["triton_final_response"].bool_param
        self.events.put(StreamEvent(result, error, final))

    def send(
        self,
        model: str,
        values: Mapping[str, np.ndarray],
        request_id: str = "",
        parameters: Mapping[str, str] | None = None,
    ) -> None:
        self.client.async_stream_infer(
            model,
            grpc_inputs(values),
            request_id=request_id,
            enable_empty_final_response=True,
            parameters=dict(parameters) if parameters else None,
        )

    def next(self, timeout_s: float = 10.0) -> StreamEvent:
        """The next event; AssertionError if none arrives within `timeout_s`."""
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no stream response within {timeout_s:.1f} s") from None

    def until_final(self, timeout_s: float = 30.0) -> Iterator[StreamEvent]:
        """Events up to and including the final one or the first error, all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.next(max(0.0, deadline - time.monotonic()))
            yield event
            if event.final or event.error is not None:
                return

    def close(self) -> None:
        """Idempotent: a reader may close its stream when its request ends, and the test again."""
        if self._closed:
            return
        self._closed = True
        self.client.stop_stream()
        self.client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def http_json(
    url: str,
    body: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> tuple[int, Any]:
    """POST `body` (or GET without one) and return (status, parsed JSON or raw text)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def http_sse(url: str, body: Mapping[str, Any], timeout_s: float = 30) -> list[Any]:
    """POST to a `generate_stream` endpoint and return the parsed `data:` events in order."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for line in response:
            text = line.decode().strip()
            if text.startswith("data:"):
                events.append(json.loads(text[len("data:") :]))
    return events


# ---- servers -------------------------------------------------------------------------------------------


# ---- servers ---------------------------------------------------------------------------------------


def stop_checked(server: Any) -> None:
    """Stop `server` (one `TritonFactory.release`d); nothing of it may be left. Its exit status may be
    1 for one reason only: Triton 2.51 sometimes keeps a reference to `llm` after traffic through it
    (seen after a client cancelled a stream mid-request, after `llm` was reloaded with streams in
    between, and about one run in five without either), and then cannot unload it at shutdown: `llm`'s
    stub has exited, its model finalize never runs, and the server exits after its exit timeout
    ("Exit timeout expired"). Not a leak of ours (nothing of ours holds Triton's model); not
    understood further yet."""
    status = server.stop(grace_s=5)
    if status != 0:
        assert "Exit timeout expired" in server.log_tail(5), server.log_tail(40)
    assert not live_group_members(server.pid), "no process of the server is left"
    assert not shm_entries(server.config.shm_prefix), "no shared memory of the server is left"


class TritonFactory:
    """Starts Triton servers for one test module; see the module docstring."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.backend_directory = workdir / "backends"
        self.admin_key = secrets.token_urlsafe(24)
        self.servers: list[TritonServer] = []
        self.failed: list[TritonServer] = []

    def add_backend(self, name: str, source: Path) -> None:
        """Serve the Python-based backend in `source` (a folder with `model.py`) as `backend: "<name>"`,
        beside the project's `disagg` backend, for the servers this factory starts from now on."""
        link_backend(self.backend_directory, name, source)

    def config(self, repository: Path, **overrides: object) -> ServerConfig:
        """A config on free loopback ports with this factory's backend directory and admin key."""
        http_port, grpc_port, metrics_port = free_ports(3)
        values: dict[str, object] = {
            "model_repository": Path(repository).resolve(),
            "backend_directory": self.backend_directory,
            "admin_key": self.admin_key,
            "http_port": http_port,
            "grpc_port": grpc_port,
            "metrics_port": metrics_port,
            "address": "127.0.0.1",
            "metrics_address": "127.0.0.1",
            "exit_timeout_s": 5,
        }
        values.update(overrides)
        return ServerConfig.from_mapping(values)

    def start(self, repository: Path, ready_timeout_s: float = 120.0, **overrides: object) -> TritonServer:
        """Start a server on `repository` and wait until it is ready (all models loaded).

        `overrides` are `ServerConfig` fields. On failure the server is stopped, moved to `failed`, and
        `ServerError` (carrying the log's error lines and tail) is raised.
        """
        config = self.config(repository, **overrides)
        log_path = self.workdir / f"tritonserver-{len(self.servers)}-{config.http_port}.log"
        server = TritonServer(config, log_path)
        self.servers.append(server)
        server.start()
        try:
            server.wait_ready(ready_timeout_s)
        except ServerError:
            server.stop(grace_s=5)
            self.servers.remove(server)
            self.failed.append(server)
            raise
        RUNNING_SERVERS.append(server)
        return server

    def release(self, server: TritonServer) -> None:
        """Take `server` out of the clean-exit check: the test stops it and checks the outcome itself."""
        self.servers.remove(server)

    def stop_all(self) -> list[str]:
        """Stop every server still registered; return a description of each unclean exit."""
        problems = []
        for server in self.servers:
            status = server.stop()
            if status != 0:
                problems.append(f"server {server.pid} exited with {status}:\n{server.log_tail()}")
            if live_group_members(server.pid):
                problems.append(f"server {server.pid} left processes behind")
            if shm_entries(server.config.shm_prefix):
                problems.append(f"server {server.pid} left shared memory behind")
        return problems


def start_smoke(factory: TritonFactory, **overrides: object) -> TritonServer:
    """Start a server on the test-only `smoke` repository (its `adder` needs the `smoke_pybackend`)."""
    factory.add_backend("smoke_pybackend", TEST_BACKENDS / "smoke_pybackend")
    return factory.start(TEST_REPOS / "smoke", **overrides)


def link_backend(backend_directory: Path, name: str, source: Path) -> None:
    """Prepare `backend_directory` and add the Python-based backend `source` to it as `name`."""
    prepare_backend_directory(backend_directory)
    link = backend_directory / name
    if not link.is_symlink():
        link.symlink_to(Path(source).resolve())


# ---- metrics and timed streams (test_metrics, test_autoscale) ------------------------------------------


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(metrics_url: str, prefix: str = "disagg_") -> Samples:
    """The server's /metrics, parsed with `prometheus_client`: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include all of `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= have)


def metric_series(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """The series called `name` whose labels include all of `labels`."""
    want = set(labels.items())
    return {have: v for (n, have), v in samples.items() if n == name and want <= have}


@dataclass(frozen=True)
class TimedStream:
    """One streamed request as the client saw it: send, first and last non-empty piece, final flag."""

    sent: float
    first: float | None
    last: float | None
    final: float | None
    pieces: int
    text: str
    error: Exception | None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def text_request(prompt: str, max_tokens: int, **extra: Any) -> dict[str, np.ndarray]:
    """Inputs of the `llm`/`ensemble` interface, shape [1, 1], streaming; `min_length` = `max_tokens`
    (so exactly `max_tokens` tokens come out) unless given; `extra` adds or overrides inputs."""
    values: dict[str, Any] = {"min_length": max_tokens, "stream": True, **extra}
    arrays = {
        "text_input": np.array([[prompt.encode()]], dtype=np.object_),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
    }
    dtypes = {"min_length": np.int32, "stream": bool, "temperature": np.float32, "top_k": np.int32}
    for name, value in values.items():
        arrays[name] = np.array([[value]], dtype=dtypes.get(name, np.int32))
    return arrays


def timed_stream(
    stream: GrpcStream, model: str, values: Mapping[str, np.ndarray], timeout_s: float = 60
) -> TimedStream:
    """Send one request on `stream` and time its pieces client-side (monotonic clock) up to the final one."""
    sent = time.monotonic()
    stream.send(model, values)
    first = last = final = None
    pieces, text, error = 0, [], None
    for event in stream.until_final(timeout_s):
        now = time.monotonic()
        if event.error is not None:
            error = event.error
            break
        output = event.result.as_numpy("text_output")
        piece = b"" if output is None or output.size == 0 else bytes(output.reshape(-1)[0])
        if piece:
            first = now if first is None else first
            last = now
            pieces += 1
            text.append(piece.decode())
        if event.final:
            final = now
    return TimedStream(sent, first, last, final, pieces, "".join(text), error)
