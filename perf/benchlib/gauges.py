"""The server's idle gauges read from `/metrics`, and a wait until they are back where they were: the
leak check of the cancel storm and the overload run."""

from __future__ import annotations

import time
import urllib.request

# the gauges that must return to their values from before the load (summed over pool instances)
IDLE_GAUGES = (
    "disagg_prefill_queue_requests",
    "disagg_prefill_pending_tokens",
    "disagg_decode_active_sequences",
    "disagg_kv_blocks_used",
    "disagg_pool_calls_open",
)


def scrape(metrics_url: str) -> dict[str, float]:
    """Each family of interest summed over its series, and `llm`'s request count."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out = dict.fromkeys((*IDLE_GAUGES, "llm_requests"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in IDLE_GAUGES:
                out[sample.name] += sample.value
            elif sample.name == "disagg_requests_total" and sample.labels.get("model") == "llm":
                out["llm_requests"] += sample.value
    return out


def settle(metrics_url: str, baseline: dict[str, float], timeout_s: float) -> tuple[float | None, dict]:
    """Seconds until every idle gauge is back at its baseline (open pool calls: at 0; None if not within
    `timeout_s`), and what is still off at the end."""
    started = time.monotonic()
    while True:
        now = scrape(metrics_url)
        # open pool calls go back to 0, not to the baseline: a probe in flight when it was read
        # counts as one for a moment
        target = {**baseline, "disagg_pool_calls_open": 0.0}
        off = {k: now[k] for k in IDLE_GAUGES if now[k] != target[k]}
        if not off:
            return time.monotonic() - started, {}
        if time.monotonic() - started > timeout_s:
            return None, off
        time.sleep(0.2)  # polling a server-side effect with a deadline, not synchronising
