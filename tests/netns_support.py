"""Network namespaces joined by a bridge: hosts with real TCP between them, on one machine.

``Topology(tag, hosts)`` creates one namespace per host, each with a veth pair whose outer end is on a
bridge in the root namespace; host ``i`` has address ``10.<subnet>.0.<i + 1>/24``, the bridge (the
test process's way in) ``.254``. ``partition(i)`` sets host ``i``'s link down, ``heal(i)`` up again.
Needs root and ``ip netns`` (``netns_unavailable`` says why not).

``start_host`` runs ``disagg serve`` (with its arguments, e.g. ``--role prefill``) on one host, the KV
transport's UCX kept to TCP on that host's link; ``wait_ready`` waits for servers to be ready.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import tritonclient.grpc as grpcclient

from disagg.server import remove_shm_regions

READY_S = 120.0


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if shutil.which("openssl") is None:
        return "needs openssl (the pools' TLS certificates)"
    probe = subprocess.run(["ip", "netns", "add", "kvprobe"], capture_output=True)
    if probe.returncode != 0:
        return "ip netns is not permitted here"
    subprocess.run(["ip", "netns", "del", "kvprobe"], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


class Topology:
    def __init__(self, tag: str, hosts: Sequence[str], subnet: int = 233) -> None:
        self.tag = tag
        self.hosts = list(hosts)
        self.subnet = subnet
        self.bridge = f"br{tag}"[:15]
        self.namespaces = [f"{host}{tag}" for host in self.hosts]
        self.devices = [f"v{tag}{i}"[:15] for i in range(len(self.hosts))]  # inside each namespace
        self._outer = [f"o{tag}{i}"[:15] for i in range(len(self.hosts))]  # on the bridge
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"10.{self.subnet}.0.254/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            _sh(
                "ip",
                "link",
                "add",
                self._outer[i],
                "type",
                "veth",
                "peer",
                "name",
                self.devices[i],
                "netns",
                ns,
            )
            _sh("ip", "link", "set", self._outer[i], "master", self.bridge)
            _sh("ip", "link", "set", self._outer[i], "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.devices[i])
            _sh("ip", "-n", ns, "link", "set", self.devices[i], "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def address(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def run_in(self, i: int) -> list[str]:
        """The command prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def partition(self, i: int) -> None:
        _sh("ip", "-n", self.namespaces[i], "link", "set", self.devices[i], "down")

    def heal(self, i: int) -> None:
        _sh("ip", "-n", self.namespaces[i], "link", "set", self.devices[i], "up")

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes of host ``i``'s link, as its namespace counts them."""
        out = []
        for name in ("rx_bytes", "tx_bytes"):
            path = f"/sys/class/net/{self.devices[i]}/statistics/{name}"
            done = subprocess.run([*self.run_in(i), "cat", path], capture_output=True, text=True, check=True)
            out.append(int(done.stdout.strip()))
        return out[0], out[1]

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for outer in self._outer:
            subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@dataclass
class Host:
    """One `disagg serve` in a namespace; ``config`` has the URLs the suite's helpers read."""

    address: str
    process: subprocess.Popen[bytes]
    log: Path
    config: SimpleNamespace
    tls: Path | None = None
    """The TLS folder its gRPC asks client certificates of (a pool host of a spec with remote.tls)."""

    def ready(self) -> bool:
        """Readiness over gRPC: a pool role keeps its HTTP endpoint on loopback (only gRPC, the pools'
        link, is exposed), so only the frontend's HTTP is reachable from outside its namespace."""
        try:
            client = grpcclient.InferenceServerClient(self.config.grpc_url, **tls_options(self.tls))
            try:
                return bool(client.is_server_ready(client_timeout=2))
            finally:
                client.close()
        except Exception:  # unreachable, refused, or not answering yet
            return False

    def kill(self) -> None:
        """SIGKILL the server and all it started: `disagg serve` runs tritonserver (and its model
        processes) in a process group of its own, which a kill of its own group would leave behind."""
        groups = {self.process.pid}
        for child in _children(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(child))
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.process.wait(10)
        # A host that dies takes its shared memory with it; on this one machine, Triton's Python
        # backend regions of the killed server (named by its prefix, no owner pid to sweep by) would
        # stay in /dev/shm after the suite.
        prefix = re.search(
            r'"shm-region-prefix-name":"(disagg_[0-9a-f]+_)"', self.log.read_text(errors="replace")
        )
        if prefix is not None:
            remove_shm_regions(prefix.group(1))

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        """SIGTERM, then the exit status (SIGKILL after the exit timeout and a grace period)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)


def tls_options(folder: Path | None) -> dict[str, object]:
    """tritonclient.grpc's options for a server that asks a client certificate (disagg.tls)."""
    if folder is None:
        return {}
    return {"ssl": True, "root_certificates": str(folder / "ca.pem"), "private_key": str(folder / "key.pem"),
            "certificate_chain": str(folder / "cert.pem")}  # fmt: skip


def make_tls(folder: Path, addresses: Sequence[str]) -> Path:
    """A throwaway CA and one certificate it signed for every host (`addresses` as IP names, for
    serving and as a client): `folder` then holds ca.pem, cert.pem and key.pem (disagg.tls)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = ",".join(f"IP:{a}" for a in (*addresses, "127.0.0.1"))
    (folder / "ext.cnf").write_text(f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\n")
    for command in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "1", "-subj", "/CN=disagg-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out", "host.csr",
         "-subj", "/CN=disagg-host"],
        ["x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "cert.pem", "-days", "1", "-extfile", "ext.cnf"],
    ):  # fmt: skip
        subprocess.run(["openssl", *command], cwd=folder, capture_output=True, check=True)
    (folder / "ca.key").unlink()  # the CA signs nothing more
    return folder


def start_host(
    topology: Topology,
    i: int,
    workdir: Path,
    secret: str,
    *args: str,
    port: int = 8000,
    tls: Path | None = None,
) -> Host:
    folder = workdir / f"{topology.hosts[i]}-{port}"
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DISAGG_SECRET": secret,
        "UCX_TLS": "tcp",  # the KV crosses the veth, not shared memory between the namespaces
        "UCX_NET_DEVICES": topology.devices[i],
        "HTTP_PORT": str(port),
        "GRPC_PORT": str(port + 1),
        "METRICS_PORT": str(port + 2),
        "PYTHONUNBUFFERED": "1",
    }
    disagg = str(Path(sys.executable).parent / "disagg")
    command = [*topology.run_in(i), disagg, "serve", "--address", "0.0.0.0", "--openai-port", "0"]
    command += ["--exit-timeout", "10", "--max-restarts", "0", *args]
    log = folder / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    address = topology.address(i)
    urls = SimpleNamespace(
        http_url=f"{address}:{port}",
        grpc_url=f"{address}:{port + 1}",
        metrics_url=f"http://{address}:{port + 2}/metrics",
    )
    return Host(address, process, log, urls, tls)


def wait_ready(*hosts: Host) -> None:
    def all_ready() -> bool:
        for host in hosts:
            if host.process.poll() is not None:
                raise AssertionError(f"server exited with {host.process.returncode}:\n{host.tail()}")
        return all(host.ready() for host in hosts)

    deadline = time.monotonic() + READY_S
    while not all_ready():  # polled with a deadline
        if time.monotonic() > deadline:
            raise AssertionError(f"servers not ready within {READY_S:.0f} s")
        time.sleep(0.2)


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid``."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found
