"""Where a request's time goes inside Triton: each model's statistics (``GET /v2/models/stats``, the
KServe statistics extension), as the difference between two snapshots taken around a load.

Per model, over the requests it executed in between: how many, and the mean milliseconds each spent
waiting in its queue and computing (input, execute, output). For a decoupled model (the orchestrator)
"compute" ends when its ``execute`` returns, not when its last response is sent.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def model_stats(http_url: str, timeout_s: float = 10.0) -> dict[str, dict[str, tuple[int, int]]]:
    """Every loaded model's counters now: ``name/version`` -> phase -> (count, nanoseconds)."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=timeout_s) as reply:
        return parse(json.loads(reply.read()))


def parse(raw: dict[str, Any]) -> dict[str, dict[str, tuple[int, int]]]:
    out = {}
    for model in raw.get("model_stats", []):
        stats = model.get("inference_stats", {})
        phases = {
            p: (int(stats.get(p, {}).get("count", 0)), int(stats.get(p, {}).get("ns", 0))) for p in PHASES
        }
        out[f"{model['name']}/{model['version']}"] = phases
    return out


def delta(
    before: dict[str, dict[str, tuple[int, int]]], after: dict[str, dict[str, tuple[int, int]]]
) -> dict[str, dict[str, float]]:
    """Per model that executed requests in between: ``requests`` (succeeded + failed) and the mean
    milliseconds per request of its queue and of its compute (input + execute + output)."""
    out = {}
    for model, phases in sorted(after.items()):
        old = before.get(model, dict.fromkeys(PHASES, (0, 0)))

        def grew(phase: str) -> tuple[int, int]:
            return phases[phase][0] - old[phase][0], phases[phase][1] - old[phase][1]  # noqa: B023

        requests = grew("success")[0] + grew("fail")[0]
        if requests <= 0:
            continue
        queue_ns = grew("queue")[1]
        compute_ns = sum(grew(p)[1] for p in ("compute_input", "compute_infer", "compute_output"))
        out[model] = {
            "requests": requests,
            "failed": grew("fail")[0],
            "queue_ms": queue_ns / requests / 1e6,
            "compute_ms": compute_ns / requests / 1e6,
        }
    return out


def table(models: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows for ``delta``'s result."""
    lines = ["| model | requests (failed) | queue, ms each | compute, ms each |", "|---|---:|---:|---:|"]
    for model, m in models.items():
        counts = f"{m['requests']:.0f} ({m['failed']:.0f})"
        lines.append(f"| `{model}` | {counts} | {m['queue_ms']:.2f} | {m['compute_ms']:.2f} |")
    return lines
