"""Small factories for autoscaler tests: a fake exporter that keeps cumulative server-side metrics
and renders them as Prometheus text (so the real parser runs), a fake clock, sources, HTTP fakes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from disagg_tools.autoscaler.config import AutoscalerConfig, build_config
from disagg_tools.autoscaler.controller import ACTIVE, KV_FREE, KV_USED, PENDING, PROMPT, QUEUE, TPOT, TTFT
from disagg_tools.autoscaler.snapshot import Snapshot, parse_exposition

# Percentiles are only as fine as the buckets: bounds near the SLO targets matter.
TIME_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
TOKEN_BUCKETS = (16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)

LabelKey = tuple[tuple[str, str], ...]


def _key(labels: dict[str, str]) -> LabelKey:
    return tuple(sorted(labels.items()))


def _fmt(x: float) -> str:
    return "+Inf" if x == float("inf") else repr(float(x))


def _labels(items: LabelKey) -> str:
    return ",".join(f'{k}="{v}"' for k, v in items)


@dataclass
class _Hist:
    bounds: tuple[float, ...]
    counts: list[float]
    total: float = 0.0


@dataclass
class FakeExporter:
    """Cumulative histograms and gauges as a server would hold them; `render()` is its /metrics page."""

    hists: dict[tuple[str, LabelKey], _Hist] = field(default_factory=dict)
    gauges: dict[tuple[str, LabelKey], float] = field(default_factory=dict)

    def declare(self, family: str, bounds: tuple[float, ...], **labels: str) -> None:
        self.hists.setdefault((family, _key(labels)), _Hist(bounds, [0.0] * (len(bounds) + 1)))

    def observe(self, family: str, value: float, n: int = 1, **labels: str) -> None:
        h = self.hists[(family, _key(labels))]
        for i, bound in enumerate((*h.bounds, float("inf"))):
            if value <= bound:
                h.counts[i] += n
                break
        h.total += value * n

    def set(self, name: str, value: float, **labels: str) -> None:
        self.gauges[(name, _key(labels))] = value

    def drop(self, name: str) -> None:
        self.gauges = {k: v for k, v in self.gauges.items() if k[0] != name}
        self.hists = {k: v for k, v in self.hists.items() if k[0] != name}

    def restart(self) -> None:
        """A server restart: every cumulative counter starts again from zero."""
        for h in self.hists.values():
            h.counts = [0.0] * len(h.counts)
            h.total = 0.0

    def render(self) -> str:
        lines: list[str] = []
        families = sorted({name for name, _ in self.hists})
        for name in families:
            lines += [f"# HELP {name} test histogram", f"# TYPE {name} histogram"]
            for (fam, labels), h in sorted(self.hists.items()):
                if fam != name:
                    continue
                cum = 0.0
                for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
                    cum += count
                    lines.append(f'{name}_bucket{{{_labels(labels)},le="{_fmt(bound)}"}} {cum}')
                lines.append(f"{name}_sum{{{_labels(labels)}}} {h.total}")
                lines.append(f"{name}_count{{{_labels(labels)}}} {cum}")
        for name in sorted({name for name, _ in self.gauges}):
            lines += [f"# HELP {name} test gauge", f"# TYPE {name} gauge"]
            for (fam, labels), value in sorted(self.gauges.items()):
                if fam == name:
                    lines.append(f"{name}{{{_labels(labels)}}} {value}")
        # Unrelated Triton families are present on a real page and must be ignored.
        lines += ["# TYPE nv_inference_count counter", 'nv_inference_count{model="prefill",version="1"} 7']
        return "\n".join(lines) + "\n"

    def prometheus_answers(self, sample_time: float) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The same data as a Prometheus server's /api/v1/query answers (values, timestamps by gauge)."""
        snap = parse_exposition(self.render(), 0.0)
        result = [
            {"metric": {"__name__": name, **dict(labels)}, "value": [sample_time, str(v)]}
            for (name, labels), v in snap.samples.items()
        ]
        values = {"status": "success", "data": {"resultType": "vector", "result": result}}
        stamps = {}
        for gauge in (PENDING, QUEUE, ACTIVE, KV_USED, KV_FREE):
            res = [
                {"metric": dict(labels), "value": [sample_time, str(sample_time)]}
                for (name, labels) in snap.samples
                if name == gauge
            ]
            stamps[gauge] = {"status": "success", "data": {"resultType": "vector", "result": res}}
        return values, stamps


def prefill_exporter(model: str = "prefill", path: str = "disaggregated") -> FakeExporter:
    ex = FakeExporter()
    ex.declare(TTFT, TIME_BUCKETS, model=model, path=path)
    ex.declare(PROMPT, TOKEN_BUCKETS, model=model, path=path)
    ex.set(PENDING, 0, model=model)
    ex.set(QUEUE, 0, model=model)
    return ex


def decode_exporter(model: str = "decode", path: str = "disaggregated", blocks: int = 1000) -> FakeExporter:
    ex = FakeExporter()
    ex.declare(TPOT, TIME_BUCKETS, model=model, path=path)
    ex.set(ACTIVE, 0, model=model)
    ex.set(KV_USED, 0, model=model, pool="decode")  # labelled as the server does: pool = role
    ex.set(KV_FREE, blocks, model=model, pool="decode")
    return ex


class FakeClock:
    """Time that moves only when told (or when something waits on it)."""

    def __init__(self, start: float = 1000.0, wall: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall - start
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + self.wall_offset

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += max(0.0, seconds)
        return False

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TextSource:
    """A source that renders the exporter and parses the text (the real parser path), or fails."""

    def __init__(self, exporter: FakeExporter, clock: FakeClock) -> None:
        self.exporter = exporter
        self.clock = clock
        self.text_override: str | None = None
        self.error: Exception | None = None

    def fetch(self) -> Snapshot:
        if self.error is not None:
            raise self.error
        text = self.text_override if self.text_override is not None else self.exporter.render()
        return parse_exposition(text, self.clock.time())


def config(pools: list[dict[str, Any]], **top: Any) -> AutoscalerConfig:
    data: dict[str, Any] = {"pools": pools, "interval_s": 10.0, "window_s": 60.0, "metrics_port": 0}
    data.update(top)
    return build_config(data)


def prefill_pool(**over: Any) -> dict[str, Any]:
    pool = {
        "name": "prefill",
        "role": "prefill",
        "ttft_target_s": 1.0,
        "capacity_tokens_per_s": 2000.0,
        "min_size": 1,
        "max_size": 4,
        "cooldown_out_s": 30.0,
        "cooldown_in_s": 60.0,
    }
    pool.update(over)
    return pool


def decode_pool(**over: Any) -> dict[str, Any]:
    pool = {
        "name": "decode",
        "role": "decode",
        "tpot_target_s": 0.05,
        "min_size": 1,
        "max_size": 4,
        "cooldown_out_s": 30.0,
        "cooldown_in_s": 60.0,
    }
    pool.update(over)
    return pool


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@contextmanager
def http_fake(
    handler: Callable[[str, str, dict[str, str], bytes], tuple[int, str, bytes]],
) -> Iterator[tuple[str, list[Recorded]]]:
    """An in-process HTTP server on 127.0.0.1: `handler(method, path, headers, body)` returns
    (status, content type, body); every request is recorded. Yields (base URL, records)."""
    records: list[Recorded] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            with lock:
                records.append(Recorded(self.command, self.path, headers, body))
            status, ctype, out = handler(self.command, self.path, headers, body)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PATCH = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", records
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def json_body(obj: Any, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


ADMIN_KEY = "k3y-for-tests-0123456789"


def model_config(name: str, count: int) -> dict[str, Any]:
    """A pool model's live config as Triton's `GET /v2/models/<name>/config` answers it."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "instance_group": [{"name": f"{name}_0", "kind": "KIND_CPU", "count": count, "gpus": []}],
        "parameters": {"pool": {"string_value": name}},
    }


def triton_repository(models: dict[str, dict[str, Any]], key: str = ADMIN_KEY):
    """A handler for :func:`http_fake` acting as Triton's model configuration and repository API for
    several models (`models`: name -> live config, updated by each load); a load without the admin
    key is refused as the server does."""

    def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        parts = path.strip("/").split("/")
        name = (
            parts[2] if len(parts) == 4 and parts[:2] == ["v2", "models"] and parts[3] == "config" else None
        )
        if method == "GET" and name in models:
            return json_body(models[name])
        loading = len(parts) == 5 and parts[:3] == ["v2", "repository", "models"] and parts[4] == "load"
        if method == "POST" and loading and parts[3] in models:
            if headers.get("disagg-admin-key") != key:
                return json_body({"error": "This API is restricted"}, 403)
            models[parts[3]] = json.loads(json.loads(body)["parameters"]["config"])
            return 200, "application/json", b""
        return json_body({"error": "not found"}, 404)

    return handle
