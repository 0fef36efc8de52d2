"""Move a live server's pools from one model version to another under load, and back.

    disagg rollout --to 2              # load version 2 beside 1, switch new requests, drain, unload 1
    disagg rollout --rollback          # the same, back to the version served before the last switch

The pool models (prefill, decode, colocated, decode_hot) carry numbered version folders, written by
``disagg repository --spec`` from the spec's ``model.versions``. A rollout to version N, for every pool
model the server runs:

1. **pin**: the routing file (``disagg.serving.routing``) names the versions served now, so that no
   request is left to Triton's "latest" while two versions are loaded;
2. **load**: each model's ``version_policy`` becomes ``[old, N]`` (a load with the live config as
   override: Triton keeps the old version's instances and KV regions and adds N's). An instance of N
   runs its version's readiness probe before it serves; a load that fails (missing weights, a probe
   that does not reproduce its text) puts back ``[old]`` on the models already loaded and stops the
   rollout with Triton's reason: the old version never stopped serving;
3. **switch**: the routing names N; every request arriving from now on is pinned to N's pools;
4. **drain**: wait until no request pinned to the old version is in flight
   (``disagg_pinned_requests`` on /metrics, every entry point instance), bounded by ``--drain-timeout``;
5. **unload**: each model's policy becomes ``[N]``; the old version's instances end, and their KV
   regions with them.

Each load goes through the server's model-control broker (``disagg.broker``: the process that launched
the server, the one holder of its admin key), which makes it under the server's model-control lock,
shared with the pool watchers' restarts and the autoscaler's actuator. The change is to the live
server: a server started again loads what its repository's ``version_policy`` says, so set
``serving:`` in the spec and regenerate the repository to make it last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from disagg.broker import BrokerClient, BrokerError
from disagg.control import ModelControl
from disagg.serving.routing import Routing, RoutingFile
from disagg_tools.repository import POOL_MODELS

POLL_S = 0.2
PINNED_FAMILY = "disagg_pinned_requests"


class RolloutError(RuntimeError):
    """The rollout stopped; the message says at which step and why, and what still serves."""


@dataclass(frozen=True)
class RolloutConfig:
    url: str = "http://127.0.0.1:8000"  # the server's HTTP endpoint
    metrics_url: str = "http://127.0.0.1:8002/metrics"
    load_timeout_s: float = 300.0
    drain_timeout_s: float = 600.0


class TritonControl:
    """The server as a rollout sees it: model control through the server's broker (``disagg.broker``,
    the holder of its admin key), the pinned requests from its /metrics."""

    def __init__(self, config: RolloutConfig, broker: BrokerClient | None = None) -> None:
        self.config = config
        self.broker = broker if broker is not None else BrokerClient(config.url, config.load_timeout_s)

    def _call(self, op: str, model: str = "", config: dict[str, Any] | None = None) -> Any:
        try:
            return self.broker.call(op, model, config)
        except BrokerError as exc:
            raise RolloutError(str(exc)) from None

    def loaded_versions(self) -> dict[str, list[int]]:
        """Model -> its versions that are READY now."""
        found: dict[str, list[int]] = {}
        for entry in self._call("index") or []:
            if entry.get("state") == "READY" and str(entry.get("version", "")).isdigit():
                found.setdefault(entry["name"], []).append(int(entry["version"]))
        return {name: sorted(versions) for name, versions in found.items()}

    def set_versions(self, model: str, versions: list[int]) -> None:
        """Load ``model`` with its live config and ``version_policy`` = ``versions``."""
        self._call("update", model, {"version_policy": {"specific": {"versions": versions}}})

    def pinned(self) -> dict[tuple[str, int], float]:
        """(pool model, version) -> requests in flight pinned to it, summed over entry points."""
        try:
            with urllib.request.urlopen(self.config.metrics_url, timeout=10) as reply:
                text = reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise RolloutError(f"metrics unreachable at {self.config.metrics_url} ({exc})") from None
        return pinned_counts(text)


def pinned_counts(text: str) -> dict[tuple[str, int], float]:
    """Sum ``disagg_pinned_requests`` by (pool, version) from a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[tuple[str, int], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != PINNED_FAMILY:
            continue
        for sample in family.samples:
            key = (sample.labels.get("pool", ""), int(sample.labels.get("version", "0")))
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


class Rollout:
    """One server's rollouts; ``say`` reports each step."""

    def __init__(
        self,
        triton: TritonControl,
        routing: RoutingFile,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], None] = time.sleep,
    ) -> None:
        self.triton, self.routing = triton, routing
        self.say, self._clock, self._wait = say, clock, wait

    def serving(self) -> tuple[dict[str, int], dict[str, list[int]], Routing]:
        """The pool models and the version each serves new requests now, the versions each has
        loaded, and the routing."""
        loaded = {m: v for m, v in self.triton.loaded_versions().items() if m in POOL_MODELS}
        if not loaded:
            raise RolloutError("the server runs none of the pool models " + ", ".join(POOL_MODELS))
        routing = self.routing.current()
        current = {m: routing.versions.get(m, versions[-1]) for m, versions in loaded.items()}
        return current, loaded, routing

    def rollback_target(self) -> int:
        previous = set(self.routing.current().previous.values())
        if len(previous) != 1:
            raise RolloutError("nothing to roll back to: no earlier rollout on this server since it started")
        return previous.pop()

    def run(self, target: int) -> None:
        current, loaded, routing = self.serving()
        if all(versions == [target] for versions in loaded.values()):
            self.say(f"already serving version {target}")
            return
        models = sorted(current)
        pin = Routing(current, routing.previous, time.time())
        self.routing.write(pin)  # 1. pin
        self.say(f"pinned: new requests stay on {_describe(current)}")
        added: list[str] = []
        for model in models:  # 2. load beside
            versions = sorted({current[model], target})
            try:
                self.triton.set_versions(model, versions)
            except RolloutError as exc:
                self._undo(added, current)
                raise RolloutError(
                    f"version {target} of {model} failed to load; still serving {_describe(current)} ({exc})"
                ) from None
            added.append(model)
            self.say(f"loaded {model} version {target} beside {current[model]}")
        self.routing.write(pin.switched(dict.fromkeys(models, target)))
        self.say(f"switched: new requests go to version {target}")  # 3. switch
        self._drain(current)  # 4. drain
        for model in models:  # 5. unload the old
            self.triton.set_versions(model, [target])
            self.say(f"unloaded {model} version {current[model]}")
        self.say(f"serving version {target}")

    def _undo(self, added: list[str], current: Mapping[str, int]) -> None:
        for model in added:
            self.triton.set_versions(model, [current[model]])

    def _drain(self, old: Mapping[str, int]) -> None:
        deadline = self._clock() + self.triton.config.drain_timeout_s
        while True:
            counts = self.triton.pinned()
            left = sum(counts.get((m, v), 0.0) for m, v in old.items())
            if left <= 0:
                self.say("drained: no request in flight on the old version")
                return
            if self._clock() >= deadline:
                raise RolloutError(
                    f"{left:g} requests still in flight on the old version after "
                    f"{self.triton.config.drain_timeout_s:g} s; both versions stay loaded (run the "
                    "rollout again to finish it, or --rollback)"
                )
            self._wait(POLL_S)


def _describe(versions: Mapping[str, int]) -> str:
    numbers = sorted(set(versions.values()))
    return "version " + ", ".join(map(str, numbers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg rollout", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", type=int, metavar="VERSION", help="the version to serve")
    target.add_argument("--rollback", action="store_true", help="back to the version served before")
    http_port = os.environ.get("HTTP_PORT", "8000")
    metrics_port = os.environ.get("METRICS_PORT", "8002")
    parser.add_argument("--url", default=f"http://127.0.0.1:{http_port}", help="the server's HTTP endpoint")
    parser.add_argument("--metrics-url", default=f"http://127.0.0.1:{metrics_port}/metrics")
    parser.add_argument("--load-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--drain-timeout", type=float, default=600.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    config = RolloutConfig(args.url, args.metrics_url, args.load_timeout, args.drain_timeout)
    try:
        server = urllib.parse.urlsplit(args.url).netloc or args.url
        control = ModelControl(server)  # names the server's routing file
        rollout = Rollout(TritonControl(config), RoutingFile(control.routing_path))
        version = rollout.rollback_target() if args.rollback else args.to
        if version is None or version < 1:
            parser.error("--to must be a version number >= 1")
        rollout.run(version)
    except (RolloutError, ValueError, OSError) as exc:
        print(f"disagg rollout: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
