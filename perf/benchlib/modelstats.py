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
    milliseconds per request of its queue and of its compute (input + execute + output), and of a
    failed request from its arrival to its error (``failed_ms``; for the ensemble, a refusal's time
    inside the server)."""
    out = {}
    for model, phases in sorted(after.items()):
        old = before.get(model, dict.fromkeys(PHASES, (0, 0)))
        count = {p: phases[p][0] - old[p][0] for p in PHASES}
        ns = {p: phases[p][1] - old[p][1] for p in PHASES}
        requests = count["success"] + count["fail"]
        if requests <= 0:
            continue
        queue_ns = ns["queue"]
        compute_ns = ns["compute_input"] + ns["compute_infer"] + ns["compute_output"]
        out[model] = {
            "requests": requests,
            "failed": count["fail"],
            "queue_ms": queue_ns / requests / 1e6,
            "compute_ms": compute_ns / requests / 1e6,
            "failed_ms": ns["fail"] / count["fail"] / 1e6 if count["fail"] > 0 else None,
        }
    return out


def table(models: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows for ``delta``'s result."""
    lines = [
        "| model | requests (failed) | queue, ms each | compute, ms each | a failed one, ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, m in models.items():
        counts = f"{m['requests']:.0f} ({m['failed']:.0f})"
        failed = "–" if m.get("failed_ms") is None else f"{m['failed_ms']:.1f}"
        lines.append(f"| `{model}` | {counts} | {m['queue_ms']:.2f} | {m['compute_ms']:.2f} | {failed} |")
    return lines
