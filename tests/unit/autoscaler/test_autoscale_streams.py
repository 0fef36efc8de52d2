"""The whole loop over synthetic metric streams: exporter text -> parser -> controller -> log actuator.

Time is a FakeClock moved by the test; every interval the test changes the exporter as a server would.
"""

from __future__ import annotations

import itertools
from typing import Any

from autoscale_factory import (
    ACTIVE,
    KV_FREE,
    KV_USED,
    PENDING,
    PROMPT,
    QUEUE,
    TPOT,
    TTFT,
    FakeClock,
    FakeExporter,
    TextSource,
    config,
    decode_exporter,
    decode_pool,
    prefill_exporter,
    prefill_pool,
)

from disagg_tools.autoscaler.actuator import LogActuator
from disagg_tools.autoscaler.config import AutoscalerConfig
from disagg_tools.autoscaler.governor import HOLD, SCALE_OUT
from disagg_tools.autoscaler.histogram import histogram_delta
from disagg_tools.autoscaler.runner import Runner
from disagg_tools.autoscaler.snapshot import GarbageMetrics, parse_exposition
from disagg_tools.autoscaler.source import SourceError

L = {"model": "prefill", "path": "disaggregated"}
D = {"model": "decode", "path": "disaggregated"}


class Harness:
    def __init__(self, cfg: AutoscalerConfig, exporter: FakeExporter) -> None:
        self.clock = FakeClock()
        self.exporter = exporter
        self.source = TextSource(exporter, self.clock)
        self.actuator = LogActuator()
        self.records: list[dict[str, Any]] = []
        self.cfg = cfg
        self.runner = Runner(
            cfg, self.source, self.actuator, self.clock, emit=self.records.append, dry_run=True
        )

    def step(self) -> dict[str, dict[str, Any]]:
        """Advance one interval and run; returns this interval's record per pool."""
        self.clock.advance(self.cfg.interval_s)
        self.runner.run_once()
        return {r["pool"]: r for r in self.records[-len(self.cfg.pools) :]}

    def size(self, pool: str) -> int:
        return self.actuator.current(next(p for p in self.cfg.pools if p.name == pool))


def steady_prefill(ex: FakeExporter, n: int = 30, ttft: float = 0.2, prompt: float = 200.0) -> None:
    ex.observe(TTFT, ttft, n=n, **L)
    ex.observe(PROMPT, prompt, n=n, **L)
    ex.set(PENDING, 0, model="prefill")
    ex.set(QUEUE, 0, model="prefill")


def test_long_prompt_burst_scales_prefill_out_before_p99_ttft_exceeds_target() -> None:
    h = Harness(config([prefill_pool()]), prefill_exporter())
    seen: list[float] = []  # windowed p99 TTFT as a separate observer computes it, per interval
    snaps = [parse_exposition(h.exporter.render(), 0.0)]
    for _ in range(6):
        steady_prefill(h.exporter)
        assert h.step()["prefill"]["kind"] == HOLD
        snaps.append(parse_exposition(h.exporter.render(), 0.0))
    # A burst: 40 prompts of 8000 tokens admitted. None has its first token yet; TTFT still looks fine.
    steady_prefill(h.exporter)
    h.exporter.observe(PROMPT, 8000.0, n=40, **L)
    h.exporter.set(PENDING, 40 * 8000, model="prefill")
    h.exporter.set(QUEUE, 40, model="prefill")
    rec = h.step()["prefill"]
    snaps.append(parse_exposition(h.exporter.render(), 0.0))
    window = histogram_delta(snaps[-7], snaps[-1], TTFT, model="prefill")
    assert window is not None
    seen.append(window.quantile(0.99) or 0.0)
    assert rec["kind"] == SCALE_OUT and "queue_wait_above_budget" in rec["signals"]
    assert rec["detail"]["ttft_quantile_s"] < 1.0 and seen[-1] < 1.0  # target not yet broken
    assert h.size("prefill") == 2
    # Only afterwards do the burst's first tokens arrive, late: the TTFT breach the scale-out anticipated.
    h.exporter.observe(TTFT, 20.0, n=40, **L)
    h.exporter.set(PENDING, 20 * 8000, model="prefill")
    rec = h.step()["prefill"]
    assert rec["detail"]["ttft_quantile_s"] > 1.0
    assert rec["kind"] == HOLD and rec["reason"] == "cooldown"  # one step, then the cooldown


def test_oscillation_around_a_threshold_causes_a_bounded_number_of_scale_events() -> None:
    # window = interval, so the percentile follows each interval's values: the harshest case.
    cfg = config([decode_pool(max_size=8)], window_s=10.0)
    h = Harness(cfg, decode_exporter())
    h.exporter.set(KV_USED, 100, model="decode", pool="decode")
    h.exporter.set(KV_FREE, 900, model="decode", pool="decode")
    h.exporter.set(ACTIVE, 10, model="decode")
    events = []
    for i in range(60):  # 10 minutes, TPOT p99 alternating 1.3x and 0.7x the 50 ms target
        h.exporter.observe(TPOT, 0.065 if i % 2 else 0.035, n=100, **D)
        rec = h.step()["decode"]
        if rec["kind"] != HOLD:
            events.append((i, rec["kind"]))
    # scale-in needs 3 consecutive low intervals: never, with alternation. Scale-out at most once per
    # 30 s cooldown; naive threshold-following would have made 59 changes.
    assert all(kind == SCALE_OUT for _, kind in events)
    assert len(events) <= min(600 / 30 + 1, 8 - 1)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(events)]
    assert all(g * 10 >= 30 for g in gaps)
    assert h.size("decode") <= 8


def test_noise_inside_the_hysteresis_band_never_moves_the_pool() -> None:
    h = Harness(config([decode_pool()], window_s=10.0), decode_exporter())
    for i in range(40):
        h.exporter.observe(TPOT, 0.058 if i % 2 else 0.042, n=100, **D)  # 1.16x / 0.84x target
        assert h.step()["decode"]["kind"] == HOLD


def test_at_most_one_step_per_interval_and_never_above_max() -> None:
    h = Harness(config([prefill_pool(max_size=3, cooldown_out_s=10.0)]), prefill_exporter())
    sizes = []
    for _ in range(8):
        steady_prefill(h.exporter, ttft=50.0)
        h.exporter.set(PENDING, 10**7, model="prefill")
        h.step()
        sizes.append(h.size("prefill"))
    assert sizes == [1, 2, 3, 3, 3, 3, 3, 3]  # first interval is warm-up; then +1 per interval
    # A second call in the same instant changes nothing.
    h.runner.run_once()
    assert h.size("prefill") == 3


def test_idle_pool_scales_in_to_min_and_never_below() -> None:
    h = Harness(config([decode_pool(min_size=2, scale_in_after=2)]), decode_exporter())
    h.actuator.apply(h.cfg.pools[0], 2, 4)
    sizes = []
    for _ in range(30):
        sizes.append(h.size("decode"))
        h.step()
    assert min(sizes) == 2 and sizes[-1] == 2
    assert sorted(set(sizes), reverse=True) == [4, 3, 2]


def _busy_prefill_at(h: Harness, size: int) -> None:
    h.actuator.apply(h.cfg.pools[0], 1, size)
    steady_prefill(h.exporter)
    h.step()  # warm-up


def test_missing_metrics_hold_the_size_and_are_reported() -> None:
    h = Harness(config([prefill_pool(scale_in_after=1)]), prefill_exporter())
    _busy_prefill_at(h, 3)
    h.exporter.drop(PENDING)  # the server stopped exporting it; the rest looks idle
    for _ in range(10):
        rec = h.step()["prefill"]
        assert (rec["kind"], rec["fail_static"]) == (HOLD, True)
        assert rec["reason"] == f"missing:{PENDING}"
    assert h.size("prefill") == 3
    metric = h.runner.telemetry.registry.get_sample_value(
        "disagg_autoscaler_fail_static_total", {"pool": "prefill", "reason": "missing"}
    )
    assert metric == 10
    assert h.runner.telemetry.last_error is not None


def test_endpoint_down_and_garbage_hold_the_size_and_are_reported() -> None:
    h = Harness(config([prefill_pool(scale_in_after=1)]), prefill_exporter())
    _busy_prefill_at(h, 2)
    h.source.error = SourceError("metrics source unreachable (ConnectionRefusedError)")
    for _ in range(5):
        assert h.step()["prefill"]["reason"] == "scrape_failed"
    h.source.error = GarbageMetrics("unparseable exposition (ValueError)")
    assert h.step()["prefill"]["reason"] == "garbage"
    h.source.error = None
    h.source.text_override = "<html><body>502 Bad Gateway</body></html>"
    assert h.step()["prefill"]["reason"] == "garbage"
    assert h.size("prefill") == 2
    assert h.runner.telemetry.registry.get_sample_value("disagg_autoscaler_scrape_failures_total") == 7
    err = h.runner.telemetry.last_error
    assert err is not None and err["reason"] == "garbage"


def test_unknown_current_size_holds() -> None:
    h = Harness(config([prefill_pool()]), prefill_exporter())

    def broken(pool: Any) -> int:
        from disagg_tools.autoscaler.actuator import ActuatorError

        raise ActuatorError("Triton unreachable (URLError)")

    h.actuator.current = broken  # type: ignore[method-assign]
    steady_prefill(h.exporter, ttft=50.0)
    h.step()
    steady_prefill(h.exporter, ttft=50.0)
    rec = h.step()["prefill"]
    assert (rec["kind"], rec["reason"], rec["desired"]) == (HOLD, "size_unknown", None)


def test_server_restart_mid_stream_is_not_a_spike() -> None:
    h = Harness(config([prefill_pool()]), prefill_exporter())
    for _ in range(3):
        steady_prefill(h.exporter, n=50)
        h.step()
    h.exporter.restart()
    steady_prefill(h.exporter, n=50)
    rec = h.step()["prefill"]
    assert rec["kind"] == HOLD and not rec["fail_static"]
    assert rec["detail"]["ttft_quantile_s"] < 0.25


def test_first_reading_is_a_warmup_hold_not_an_error() -> None:
    h = Harness(config([prefill_pool()]), prefill_exporter())
    rec = h.step()["prefill"]
    assert (rec["kind"], rec["reason"], rec["fail_static"]) == (HOLD, "warmup", True)
    assert h.runner.telemetry.last_error is None


def test_kv_gauges_are_read_per_model_or_by_the_configured_pool_label() -> None:
    ex = decode_exporter()
    ex.set(KV_USED, 950, model="prefill", pool="prefill")  # the prefill pool's KV must not count
    ex.set(KV_FREE, 50, model="prefill", pool="prefill")
    h = Harness(config([decode_pool()]), ex)
    h.step()
    assert h.step()["decode"]["detail"]["kv_utilisation"] == 0.0
    h = Harness(config([decode_pool(kv_pool="prefill")]), ex)
    h.step()
    assert h.step()["decode"]["detail"]["kv_utilisation"] == 0.95
