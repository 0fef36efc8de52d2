"""Three hosts on one machine: a frontend, a prefill and a decode server, each a `disagg serve --spec
SPEC --role ROLE` (the form the Kubernetes manifests run) in its own network namespace, joined by a
bridge; real TCP between them, the KV over NIXL / UCX (TCP only) on the veth links, the pools reached
from the frontend over gRPC with mutual TLS (`disagg.triton.remote`, `disagg.tls`; a throwaway CA).

Skipped where network namespaces cannot be made (needs root and `ip netns`)."""

from __future__ import annotations

import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from netns_support import Host, Topology, make_tls, netns_unavailable, start_host, tls_options, wait_ready
from serving_support import cancel_after, engine_texts, metric_samples, pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, wait_until

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

FRONTEND, PREFILL, DECODE = 0, 1, 2
PROMPTS = ("Hello world", "The quick brown fox")
MAX_TOKENS = 12


@dataclass
class Deployment:
    topology: Topology
    workdir: Path
    secret: str
    frontend: Host
    prefill: Host
    decode: Host


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    topology = Topology(secrets.token_hex(3), ("front", "pre", "dec"))
    workdir = tmp_path_factory.mktemp("hosts")
    secret = secrets.token_hex(32)
    started: list[Host] = []
    try:
        # one deployment spec served by role on every host, as the Kubernetes manifests serve theirs
        decode = topology.address(DECODE)
        spec = workdir / "spec.yaml"
        # the decode host's second gRPC port: a server started there at run time (the last test)
        # the pools' gRPC over mutual TLS: one throwaway CA, one certificate every host shows
        tls = make_tls(workdir / "tls", [topology.address(i) for i in (FRONTEND, PREFILL, DECODE)])
        spec.write_text(
            f"remote:\n  prefill: {topology.address(PREFILL)}:8001\n  decode: {decode}:8001,{decode}:8005\n"
            "  tls: tls\n"
        )
        pools = [start_host(topology, i, workdir, secret, "--spec", str(spec), "--role", role, tls=tls)
                 for i, role in ((PREFILL, "prefill"), (DECODE, "decode"))]  # fmt: skip
        started += pools
        frontend = start_host(topology, FRONTEND, workdir, secret, "--spec", str(spec), "--role", "frontend")
        started.append(frontend)
        wait_ready(*started)
        deployment = Deployment(topology, workdir, secret, frontend, *pools)
        # the watcher's pings put both pools in rotation (they start with the first request)
        yield deployment
    finally:
        statuses = {host.config.http_url: host.stop() for host in started}
        topology.close()
    killed = {deployment.decode.config.http_url: -signal.SIGKILL}  # by the last test
    assert all(status in (0, killed.get(url)) for url, status in statuses.items()), statuses


@pytest.fixture(autouse=True)
def python_backend_regions_ignored(leak_probe: LeakProbe) -> None:
    """The servers' Python backend regions live until they exit (the namespaces share /dev/shm)."""
    leak_probe.ignore_shm("disagg_")


def stream(host: Host, model: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: object) -> str:
    with GrpcStream(host.config.grpc_url) as s:
        s.send(model, text_inputs(prompt, max_tokens, stream=True, **extra))
        result = read_stream(s)
    assert result.error is None and result.final, result
    return "".join(result.pieces)


def pool_idle(host: Host) -> bool:
    gauges = pool_gauges(host)
    return bool(gauges) and all(v == 0 for k, v in gauges.items() if k[0] != "disagg_kv_blocks_free")


def counter(host: Host, name: str) -> float:
    return sum(value for n, _, value in metric_samples(host) if n == name)


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return engine_texts(PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_greedy_text_through_the_frontend_equals_the_engine(
    hosts: Deployment, expected: dict[str, str], model: str
) -> None:
    """The same oracle as the single-server deployment's (test_serving): the engine's greedy text."""
    for prompt in PROMPTS:
        text = stream(hosts.frontend, model, prompt)
        assert text == expected[prompt], (model, prompt)


def test_the_pools_grpc_asks_a_certificate_of_its_ca(hosts: Deployment) -> None:
    """The pools' gRPC runs over mutual TLS (the spec's remote.tls): a plain client, and a TLS client
    without a certificate, get nothing from a pool host; one with the deployment's certificate does,
    and every request of this module crossed those links."""
    url = hosts.prefill.config.grpc_url
    tls = tls_options(hosts.prefill.tls)
    for options in ({}, {**tls, "private_key": None, "certificate_chain": None}):
        client = grpcclient.InferenceServerClient(url, **options)
        try:
            with pytest.raises(Exception):  # noqa: B017 - refused: unavailable or handshake failure
                client.is_server_ready(client_timeout=5)
        finally:
            client.close()
    client = grpcclient.InferenceServerClient(url, **tls)
    try:
        assert client.is_server_ready(client_timeout=5)
    finally:
        client.close()


def test_the_frontend_shows_its_remote_servers_by_state(hosts: Deployment) -> None:
    """Both pool servers answer its pings; the decode host's second port has no server yet: down."""

    def states(pool: str) -> dict[str, float]:
        return {labels["state"]: value for name, labels, value in metric_samples(hosts.frontend)
                if name == "disagg_remote_servers" and labels.get("pool") == pool
                and labels.get("model") == "llm"}  # fmt: skip

    wait_until(
        lambda: (
            states("prefill") == {"up": 1, "down": 0, "unknown": 0}
            and states("decode") == {"up": 1, "down": 1, "unknown": 0}
        ),
        15,
        "the servers' states on the frontend's /metrics",
    )


def test_kv_crosses_the_link_and_both_sides_count_it(hosts: Deployment) -> None:
    """Every hand-off so far was imported once (no request here ends at its first token), so the
    exporter's and the importer's totals converge to one value, and the prefill host's link has sent
    at least that many bytes since it was made. Totals, not deltas: a pool publishes its counters every
    0.25 s, later under load, so a baseline read before a test can miss the last hand-off."""
    before = counter(hosts.decode, "disagg_kv_transfer_bytes_total")
    stream(hosts.frontend, "llm", "A prompt long enough to fill a few blocks of KV cache " * 4)

    def totals() -> tuple[float, float]:
        return (
            counter(hosts.prefill, "disagg_kv_exported_bytes_total"),
            counter(hosts.decode, "disagg_kv_transfer_bytes_total"),
        )

    _, imported = wait_until(
        lambda: (t := totals())[1] > before and t[0] == t[1] and t, 15, "equal export and import totals"
    )
    assert hosts.topology.link_bytes(PREFILL)[1] >= imported  # the KV left the prefill host on its link


def test_sixteen_concurrent_streams_complete(hosts: Deployment) -> None:
    results: list[object] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with GrpcStream(hosts.frontend.config.grpc_url) as s:
            s.send(
                "llm",
                text_inputs(
                    f"Stream number {i} says", 16, min_length=np.array([[16]], np.int32), stream=True
                ),
            )
            result = read_stream(s, timeout_s=180)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)
    assert len(results) == 16
    for result in results:
        assert result.error is None and result.final, result  # type: ignore[attr-defined]
    wait_until(lambda: pool_idle(hosts.decode) and pool_idle(hosts.prefill), 15, "both pools idle")


def test_a_cancel_reaches_the_remote_decode_pool_and_frees_its_blocks(hosts: Deployment) -> None:
    wait_until(lambda: pool_idle(hosts.decode), 15, "decode idle")
    # 1500 tokens take far longer than the wait below: the decode pool is idle again only if stopped
    result = cancel_after(hosts.frontend.config.grpc_url, "llm", 1500, pieces=5)
    assert result["errors"] == []
    wait_until(lambda: pool_idle(hosts.decode) and pool_idle(hosts.prefill), 10, "both pools idle")


# ---- faults (last: they take servers away) --------------------------------------------------------


class Streams:
    """``count`` long `llm` streams, each on its own thread, read to their final response or error."""

    def __init__(self, host: Host, count: int, tokens: int) -> None:
        self.results: list[Any] = []
        self.first = threading.Semaphore(0)  # released once per stream that got its first piece
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, args=(host, i, tokens)) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _one(self, host: Host, i: int, tokens: int) -> None:
        length = np.array([[tokens]], np.int32)
        with GrpcStream(host.config.grpc_url) as s:
            s.send("llm", text_inputs(f"Long story number {i}", tokens, min_length=length, stream=True))
            pieces, error, final = [], None, False
            for event in s.until_final(180):
                if event.error is not None:
                    error = str(event.error)
                    break
                if not pieces:
                    self.first.release()
                pieces.append(event)
                final = event.final
        with self._lock:
            self.results.append((len(pieces), error, final))

    def join(self) -> list[Any]:
        for thread in self._threads:
            thread.join(200)
        return self.results


def clear_failure(error: str | None) -> bool:
    """An error a client can act on: the pool that failed, or Triton's UNAVAILABLE."""
    return error is not None and any(w in error for w in ("UNAVAILABLE", "not reachable", "decode pool"))


def wait_idle(*hosts: Host, timeout_s: float = 45) -> None:
    # a prefill lease whose importer went away is held until its TTL (30 s)
    wait_until(lambda: all(pool_idle(h) for h in hosts), timeout_s, "the pools idle")


def test_a_partition_of_the_decode_host_loses_no_request_silently(hosts: Deployment) -> None:
    """RELIABILITY D7: the decode host's link down for 10 s under 4 long streams. Each stream finishes
    (moved to the prefill pool's local decode, the ladder's next rung) or fails with a clear error;
    after the link returns the decode pool serves again, and neither pool holds anything."""
    wait_idle(hosts.decode, hosts.prefill)
    streams = Streams(hosts.frontend, 4, 400)
    for _ in range(4):
        assert streams.first.acquire(timeout=60), "a stream got no first piece"
    hosts.topology.partition(DECODE)
    cut = time.monotonic()
    try:
        results = streams.join()
    finally:
        wait_until(lambda: time.monotonic() - cut >= 10, 15, "10 s of partition")
        hosts.topology.heal(DECODE)
    assert len(results) == 4
    for pieces, error, final in results:
        assert final or clear_failure(error), (pieces, error)
    wait_idle(hosts.decode, hosts.prefill)
    # the decode pool is back in rotation: a new request is decoded there again
    imported = counter(hosts.decode, "disagg_kv_transfer_bytes_total")

    def decoded_there() -> bool:
        stream(hosts.frontend, "llm", "After the partition")
        return counter(hosts.decode, "disagg_kv_transfer_bytes_total") > imported

    wait_until(decoded_there, 30, "a request decoded on the decode host again")


def test_the_decode_server_killed_then_a_second_one_added_at_run_time(hosts: Deployment) -> None:
    """The decode host's server is killed (SIGKILL, every process it started) under 4 long streams:
    each finishes on the next rung (the prefill pool's local decode) or fails with a clear error, and
    new requests are served through the ladder. The frontend lists the decode host's second port from
    the start; a decode server started there at run time answers its pings and takes the load."""
    counted = frontend_fallbacks(hosts)
    streams = Streams(hosts.frontend, 4, 400)
    for _ in range(4):
        assert streams.first.acquire(timeout=60), "a stream got no first piece"
    hosts.decode.kill()
    for pieces, error, final in streams.join():
        assert final or clear_failure(error), (pieces, error)
    for i in range(3):
        stream(hosts.frontend, "llm", f"While decode is gone {i}")  # served: the local rung
    wait_until(lambda: frontend_fallbacks(hosts) > counted, 10, "the fallbacks counted")  # after finals
    wait_idle(hosts.prefill)

    spec = str(hosts.workdir / "spec.yaml")
    second = start_host(
        hosts.topology, DECODE, hosts.workdir, hosts.secret, "--spec", spec, "--role", "decode", port=8004,
        tls=hosts.decode.tls,
    )  # fmt: skip
    try:
        wait_ready(second)

        def second_used() -> bool:
            stream(hosts.frontend, "llm", "Which server decodes this?")
            return counter(second, "disagg_kv_transfer_bytes_total") > 0

        wait_until(second_used, 60, "the second decode server used")
        wait_idle(second, hosts.prefill)
    finally:
        assert second.stop() == 0, second.tail()


def frontend_fallbacks(hosts: Deployment) -> float:
    return counter(hosts.frontend, "disagg_fallbacks_total")
