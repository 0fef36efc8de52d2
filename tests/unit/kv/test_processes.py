"""Hand-offs between real processes: round trip, importer death, exporter kill -9, netns."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kv_support import CROSS_PROCESS_KINDS, SECRET, small_layout
from kvpeer import digest, exporter_main, fill, importer_main, make_transport
from netns_support import netns_unavailable

from disagg.kv import TransferError
from disagg.kv.stale import list_regions

CTX = mp.get_context("spawn")
TIMEOUT = 60


def start(target, *args):
    parent, child = CTX.Pipe()
    p = CTX.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    return p, parent


def recv(conn, timeout: float = TIMEOUT):
    if not conn.poll(timeout):
        raise TimeoutError("peer process did not answer")
    return conn.recv()


def wait_released(t, deadline_s: float = 20.0) -> int:
    deadline = time.monotonic() + deadline_s
    while t.held_leases() and time.monotonic() < deadline:
        t.poll()
    return t.held_leases()


def _importer(kind, prefix, layout, n, conn):
    importer_main(kind, prefix, SECRET, conn, layout, n)


def _exporter(kind, prefix, layout, n, seed, conn):
    exporter_main(kind, prefix, SECRET, conn, layout, n, seed)


@pytest.mark.parametrize("kind", CROSS_PROCESS_KINDS)
def test_round_trip_between_processes(kind, prefix):
    layout = small_layout(64)
    exp = make_transport(kind, prefix, SECRET)
    try:
        pool = exp.allocate_memory(32, layout.block_bytes)
        fill(pool, 3)
        proc, conn = start(_importer, kind, prefix, layout.to_dict(), 16)
        for ids in ([0, 1, 2, 3, 4, 5, 6, 7], [20, 9, 31, 8, 10, 11, 12, 13]):
            conn.send((exp.export_blocks(pool, ids, layout), 64))
            status, got = recv(conn)
            assert status == "ok" and got == digest(pool, ids)
            assert wait_released(exp) == 0  # the native ack, taken in by poll
        conn.send(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        exp.close()


@pytest.mark.parametrize("kind", CROSS_PROCESS_KINDS)
def test_importer_dies_before_pulling_exporter_recovers_at_ttl(kind, prefix):
    clock = [time.time()]
    layout = small_layout(16)
    from disagg.kv import TransportConfig, create_transport

    exp = create_transport(
        "nixl" if kind == "nixl" else "shm",
        TransportConfig(secret=SECRET, prefix=prefix, ttl_s=3.0),
        clock=lambda: clock[0],
    )
    released = []
    exp._leases._on_release_user = lambda lid, why: released.append(why)
    try:
        pool = exp.allocate_memory(8, layout.block_bytes)
        proc, conn = start(_importer, kind, prefix, layout.to_dict(), 8)
        exp.export_blocks(pool, [2, 3], layout)
        conn.send("die")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0 and exp.held_leases() == 1
        clock[0] += 3.0
        assert exp.poll() == 1 and released == ["expired"] and exp.held_leases() == 0
        exp.export_blocks(pool, [2, 3], layout)  # capacity is back
    finally:
        exp.close()
    make_transport(kind, prefix, SECRET).close()  # the next start sweeps the dead importer's pool


@pytest.mark.parametrize("kind", CROSS_PROCESS_KINDS)
def test_exporter_killed_leaves_nothing_after_restart(kind, prefix):
    layout = small_layout(16)
    proc, conn = start(_exporter, kind, prefix, layout.to_dict(), 8, 5)
    assert recv(conn)[0] == "ready"
    conn.send(("export", [0, 1], 16))
    _, token, _ = recv(conn)
    if kind != "nixl":
        assert len(list_regions("/dev/shm", prefix)) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    imp = make_transport(kind, prefix, SECRET, ttl_s=5.0)  # a restart cleans stale regions
    try:
        assert list_regions("/dev/shm", prefix) == []
        dst = imp.allocate_memory(4, layout.block_bytes)
        with pytest.raises(TransferError) as info:
            imp.import_blocks(token, dst, [0, 1])
        assert prefix not in str(info.value)
    finally:
        imp.close()
    assert list_regions("/dev/shm", prefix) == []


@pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))
def test_nixl_across_network_namespaces(prefix):
    """The two sides live in two network namespaces joined by a veth pair, UCX over TCP only."""
    tag = prefix[-6:]
    ns = [f"kva{tag}", f"kvb{tag}"]
    veth = [f"va{tag}", f"vb{tag}"]
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    layout = small_layout(256)  # 32 blocks, 64 KiB
    try:
        for n in ns:
            sh("ip", "netns", "add", n)
        sh(
            "ip",
            "link",
            "add",
            veth[0],
            "netns",
            ns[0],
            "type",
            "veth",
            "peer",
            "name",
            veth[1],
            "netns",
            ns[1],
        )
        for i, (n, v) in enumerate(zip(ns, veth, strict=True)):
            sh("ip", "-n", n, "addr", "add", f"10.231.7.{i + 1}/24", "dev", v)
            sh("ip", "-n", n, "link", "set", v, "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")
        script = str(Path(__file__).resolve().parents[2] / "kvpeer.py")
        env = {
            **os.environ,
            "DISAGG_SECRET": SECRET.decode(),
            "UCX_TLS": "tcp",
            "PYTHONPATH": os.pathsep.join(sys.path),
        }

        def side(i: int, role: str) -> subprocess.Popen:
            env_i = {**env, "UCX_NET_DEVICES": veth[i]}
            cmd = ["ip", "netns", "exec", ns[i], sys.executable, script, role, json.dumps(layout.to_dict())]
            return subprocess.Popen(cmd, env=env_i, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def kv_line(p: subprocess.Popen) -> list[str]:
            for line in p.stdout:
                if line.startswith("KV "):
                    return line[3:].strip().rsplit(" ", 1)  # the token itself contains spaces
            return []

        exporter = side(0, "export")
        line = kv_line(exporter)
        assert len(line) == 2, "exporter did not start"
        token, want = line
        importer = side(1, "import")
        out, _ = importer.communicate(token + "\n", timeout=TIMEOUT)
        assert f"KV digest {want}" in out
        exporter.stdin.write("done\n")
        exporter.stdin.flush()
        assert kv_line(exporter) == ["held", "0"]  # the ack crossed back as a NIXL notification
        assert exporter.wait(TIMEOUT) == 0 and importer.returncode == 0
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
