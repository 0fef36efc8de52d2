"""Config validation, the command line, HTTP sources and the autoscaler's own /metrics."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from autoscale_factory import (
    PENDING,
    FakeClock,
    config,
    decode_exporter,
    decode_pool,
    http_fake,
    json_body,
    prefill_exporter,
    prefill_pool,
)

from disagg_tools.autoscaler import AUTOSCALER_METRIC_NAMES, main
from disagg_tools.autoscaler.actuator import LogActuator
from disagg_tools.autoscaler.config import ConfigError, SourceConfig, build_config
from disagg_tools.autoscaler.runner import Runner
from disagg_tools.autoscaler.snapshot import GarbageMetrics
from disagg_tools.autoscaler.source import PrometheusSource, SourceError, TritonSource
from disagg_tools.autoscaler.telemetry import Telemetry


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pools": [prefill_pool()], "intervall_s": 5}, "unknown key(s) intervall_s"),
        ({"pools": [prefill_pool(colour="red")]}, "pools[0]: unknown key(s) colour"),
        ({"pools": [prefill_pool(min_size=0)]}, "pools[0].min_size"),
        ({"pools": [prefill_pool(max_size=0)]}, "pools[0].max_size"),
        ({"pools": [prefill_pool(ttft_target_s=None)]}, "ttft_target_s: required"),
        ({"pools": [prefill_pool(in_ratio=1.3)]}, "in_ratio"),
        ({"pools": [prefill_pool(cooldown_out_s=1.0)]}, "cooldown_out_s"),
        ({"pools": [prefill_pool(min_size="2")]}, "pools[0].min_size: must be an integer"),
        ({"pools": [decode_pool(kv_low=0.9)]}, "kv_low"),
        ({"pools": [prefill_pool(), prefill_pool()]}, "unique"),
        ({"pools": []}, "non-empty list"),
        ({"pools": [prefill_pool()], "source": {"kind": "graphite"}}, "source.kind"),
        ({"pools": [prefill_pool()], "actuator": {"kind": "log", "pasword": "x"}}, "actuator: unknown"),
        ({"pools": [prefill_pool()], "window_s": 1.0}, "window_s"),
        ({"source": {}}, "pools: required"),
    ],
)
def test_config_refuses_bad_input(data: dict[str, Any], message: str) -> None:
    data.setdefault("interval_s", 10.0)
    with pytest.raises(ConfigError) as info:
        build_config(data)
    assert message in str(info.value)


def test_config_is_frozen() -> None:
    cfg = config([prefill_pool()])
    with pytest.raises(AttributeError):
        cfg.interval_s = 1.0  # type: ignore[misc]


def test_yaml_file_with_flags_on_top(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from disagg_tools.autoscaler.cli import _parser, config_from_args

    path = tmp_path / "autoscale.yaml"
    path.write_text(
        "interval_s: 5\nwindow_s: 30\nsource: {url: 'http://x:8002/metrics'}\n"
        "pools:\n  - {name: prefill, role: prefill, ttft_target_s: 0.5,\n"
        "     cooldown_out_s: 10, cooldown_in_s: 20}\n"
    )
    args = _parser().parse_args(["--config", str(path), "--ttft-target", "0.25", "--prefill-max", "6"])
    cfg = config_from_args(args)
    assert cfg.interval_s == 5.0 and cfg.source.url == "http://x:8002/metrics"
    assert (cfg.pools[0].ttft_target_s, cfg.pools[0].max_size) == (0.25, 6)
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [\n")
    assert main(["--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["--decode-min", "2"]) == 2  # no decode pool defined
    assert main(["--ttft-target", "0.5", "--prefill-min", "0"]) == 2


def test_main_once_with_the_log_actuator_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    ex = prefill_exporter()
    with http_fake(lambda m, p, h, b: (200, "text/plain", ex.render().encode())) as (url, _):
        rc = main(
            ["--metrics-url", f"{url}/metrics", "--ttft-target", "0.5", "--tpot-target", "0.05", "--once"]
        )
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["pool"] for r in lines} == {"prefill", "decode"}
    by_pool = {r["pool"]: r for r in lines}
    assert by_pool["prefill"]["reason"] == "warmup" and by_pool["prefill"]["current"] == 1
    # The decode families are absent from this page: still a hold, never a change.
    assert by_pool["decode"]["kind"] == "hold" and by_pool["decode"]["fail_static"]


def test_triton_source_reads_http_and_reports_down_and_garbage() -> None:
    clock = FakeClock()
    ex = prefill_exporter()
    ex.set(PENDING, 77, model="prefill")
    with http_fake(lambda m, p, h, b: (200, "text/plain", ex.render().encode())) as (url, _):
        snap = TritonSource(SourceConfig(url=url + "/metrics"), clock.time).fetch()
    assert snap.select(PENDING, model="prefill") == {frozenset({("model", "prefill")}): 77.0}
    assert snap.taken_at == clock.time()
    with (
        http_fake(lambda m, p, h, b: (503, "text/plain", b"busy")) as (url, _),
        pytest.raises(SourceError, match="503"),
    ):
        TritonSource(SourceConfig(url=url), clock.time).fetch()
    with (
        http_fake(lambda m, p, h, b: (200, "text/html", b"<html>login</html>")) as (url, _),
        pytest.raises(GarbageMetrics),
    ):
        TritonSource(SourceConfig(url=url), clock.time).fetch()
    # Nothing listens there any more: the port was released when the fake closed.
    with pytest.raises(SourceError, match="unreachable"):
        TritonSource(SourceConfig(url=url, timeout_s=2.0), clock.time).fetch()


def prometheus_handler(answers: dict[str, Any]):
    def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        parsed = urlparse(path)
        query = parse_qs(parsed.query)["query"][0]
        assert parsed.path == "/api/v1/query"
        if query.startswith("timestamp("):
            family = query[len("timestamp(") :].split("{")[0].rstrip(")")
            return json_body(answers["stamps"][family])
        answers["values_query"] = query
        return json_body(answers["values"])

    return handle


def test_prometheus_source_and_stale_series_hold() -> None:
    clock = FakeClock()
    ex = decode_exporter()
    ex.hists.update(prefill_exporter().hists)
    ex.gauges.update(prefill_exporter().gauges)
    answers: dict[str, Any] = {}
    cfg = config(
        [prefill_pool(), decode_pool()],
        source={"kind": "prometheus", "url": "http://unused", "label_matchers": 'namespace="llm"'},
    )
    with http_fake(prometheus_handler(answers)) as (url, _):
        source = PrometheusSource(
            SourceConfig(kind="prometheus", url=url, label_matchers='namespace="llm"'), clock.time
        )
        records: list[dict[str, Any]] = []
        runner = Runner(cfg, source, LogActuator(), clock, emit=records.append)
        answers["values"], answers["stamps"] = ex.prometheus_answers(sample_time=clock.time())
        runner.run_once()
        assert answers["values_query"] == '{__name__=~"disagg_.+",namespace="llm"}'
        clock.advance(10)
        answers["values"], answers["stamps"] = ex.prometheus_answers(sample_time=clock.time() - 5)
        runner.run_once()
        assert [r["reason"] for r in records[-2:]] == ["in_band", "in_band"]
        # The exporter froze: Prometheus still answers, but the newest samples are minutes old.
        clock.advance(300)
        runner.run_once()
        assert [(r["reason"], r["fail_static"]) for r in records[-2:]] == [("stale", True)] * 2


def test_own_metrics_endpoint_serves_sizes_and_decisions() -> None:
    telemetry = Telemetry()
    port = telemetry.serve(0, "127.0.0.1")
    try:
        clock = FakeClock()
        cfg = config([prefill_pool()])
        source = TritonSource(SourceConfig(url="http://127.0.0.1:9/metrics", timeout_s=1.0), clock.time)
        Runner(cfg, source, LogActuator(), clock, telemetry, emit=lambda r: None).run_once()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        telemetry.close()
    for name in AUTOSCALER_METRIC_NAMES:
        if name != "disagg_autoscaler_actuator_failures_total":  # no failure yet: no labelled series
            assert name in text, name
    assert 'disagg_autoscaler_current_size{pool="prefill"} 1.0' in text
    assert 'disagg_autoscaler_fail_static_total{pool="prefill",reason="scrape_failed"} 1.0' in text


def test_the_deployment_spec_gives_bounds_and_targets(tmp_path: Path) -> None:
    from disagg_tools.autoscaler.cli import _parser, config_from_args

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "entry_points: {slo: {ttft_s: 0.8, tpot_s: 0.05}}\n"
        "pools:\n  prefill: {autoscale: {min_size: 1, max_size: 3}}\n"
        "  decode: {autoscale: {min_size: 2, max_size: 4}}\n"
    )
    path = tmp_path / "autoscale.yaml"
    path.write_text("pools:\n  - {name: prefill, role: prefill, ttft_target_s: 0.5, cooldown_in_s: 20}\n")
    args = _parser().parse_args(["--config", str(path), "--spec", str(spec), "--decode-max", "5"])
    pools = {p.name: p for p in config_from_args(args).pools}
    prefill, decode = pools["prefill"], pools["decode"]
    assert (prefill.max_size, prefill.ttft_target_s, prefill.cooldown_in_s) == (3, 0.8, 20.0)
    assert (decode.min_size, decode.max_size, decode.tpot_target_s) == (2, 5, 0.05)


def test_the_deployment_spec_carries_the_schedule_into_the_autoscaler(tmp_path: Path) -> None:
    from disagg_tools.autoscaler.cli import _parser, config_from_args

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "entry_points: {slo: {ttft_s: 0.8, tpot_s: 0.05}}\n"
        "pools:\n  prefill: {autoscale: {min_size: 1, max_size: 3}}\n"
        "  decode: {autoscale: {min_size: 2, max_size: 8}}\n"
        "schedule:\n  timezone: Europe/Paris\n  total: 10\n  windows:\n"
        "    - {start: '07:00', name: day, shares: {prefill: 0.3, decode: 0.7}}\n"
        "    - {start: '22:00', name: night, shares: {prefill: 0.3, decode: 0.7}, release: {decode: 0.5}}\n"
    )
    cfg = config_from_args(_parser().parse_args(["--spec", str(spec)]))
    assert cfg.schedule is not None and [w.label for w in cfg.schedule.windows] == ["day", "night"]
    assert cfg.schedule.windows[1].release == (("decode", 0.5),)
    both = tmp_path / "autoscale.yaml"
    both.write_text("schedule: {windows: [{start: '00:00', sizes: {decode: 2}}]}\n")
    with pytest.raises(ConfigError, match="schedule: given both in --config and in --spec"):
        config_from_args(_parser().parse_args(["--config", str(both), "--spec", str(spec)]))
    # the spec's schedule names its pools prefill and decode; a config renaming them is refused
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text(
        "pools:\n  - {name: prefill, role: prefill, ttft_target_s: 1}\n"
        "  - {name: gen, role: decode, tpot_target_s: 0.05}\n"
        "schedule: {windows: [{start: '00:00', sizes: {decode: 2}}]}\n"
    )
    with pytest.raises(ConfigError, match=r"^schedule\.windows\[0\]: no pool named 'decode'$"):
        config_from_args(_parser().parse_args(["--config", str(renamed)]))


def test_planner_dry_run_flag_and_an_unreadable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from disagg_tools.autoscaler.cli import _parser, config_from_args

    argv = ["--ttft-target", "1", "--tpot-target", "0.05", "--planner-dry-run"]
    argv += ["--planner-profile", str(tmp_path / "p.json")]
    cfg = config_from_args(_parser().parse_args(argv))
    assert (cfg.planner.enabled, cfg.planner.mode, cfg.planner.profile) == (
        True,
        "dry_run",
        tmp_path / "p.json",
    )
    assert main([*argv, "--once"]) == 2
    err = capsys.readouterr().err
    assert "planner.profile: cannot read the profile" in err and str(tmp_path) not in err
