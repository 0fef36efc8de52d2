"""Network namespaces joined by a bridge: hosts with real TCP between them, on one machine.

``Topology(tag, hosts)`` creates one namespace per host, each with a veth pair whose outer end is on a
bridge in the root namespace; host ``i`` has address ``10.<subnet>.0.<i + 1>/24``, the bridge (the
test process's way in) ``.254``. ``partition(i)`` sets host ``i``'s link down, ``heal(i)`` up again.
Needs root and ``ip netns`` (``netns_unavailable`` says why not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
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
