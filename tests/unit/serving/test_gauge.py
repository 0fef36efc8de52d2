"""Gauge and SerialMetric: Triton 2.51's set() holds the GIL over a round trip, and two threads on one
metric crash the server, so gauges move by increments and every metric's operations run one at a time."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from disagg.triton import metrics, pool_metrics, request_metrics
from disagg.triton.metrics import Gauge, SerialMetric


class FakeMetric:
    """Records calls; a Triton gauge's value is the sum of its increments (it starts at 0)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def increment(self, value: float) -> None:
        self.calls.append(("increment", value))

    def set(self, value: float) -> None:  # pragma: no cover - must never be called
        self.calls.append(("set", value))

    @property
    def total(self) -> float:
        return sum(v for _, v in self.calls)


def test_set_sends_the_difference_and_never_calls_set() -> None:
    metric = FakeMetric()
    gauge = Gauge(metric)
    for value in (5, 3, 3, 0, 2.5):
        gauge.set(value)
    assert [name for name, _ in metric.calls] == ["increment"] * 4  # the repeated 3 sent nothing
    assert [v for _, v in metric.calls] == [5.0, -2.0, -3.0, 2.5]
    assert metric.total == pytest.approx(2.5) and gauge.value == 2.5


def test_two_holders_of_one_series_add_up_and_a_retiring_one_leaves_the_other() -> None:
    series = FakeMetric()  # a reloaded instance and the one it replaces share the labels
    old, new = Gauge(series), Gauge(series)
    old.set(7)
    new.set(4)
    assert series.total == 11
    old.set(0)  # the old instance retires
    assert series.total == 4


class BlockingMetric:
    """A metric whose first increment waits for `release`, as a stub's call waits on the server with
    the GIL released; it records how many callers are inside at once."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.total = 0.0
        self._count = threading.Lock()

    def increment(self, value: float) -> None:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        first = not self.entered.is_set()
        self.entered.set()
        if first:
            self.release.wait(timeout=10)
        self.total += value
        with self._count:
            self.inside -= 1


def test_a_serial_metric_never_lets_two_threads_into_one_metric() -> None:
    raw = BlockingMetric()
    metric = SerialMetric(raw)
    first = threading.Thread(target=metric.increment, args=(1,))
    first.start()
    assert raw.entered.wait(timeout=10)
    second = threading.Thread(target=metric.increment, args=(2,))
    second.start()
    second.join(timeout=0.2)  # bounded: with the lock, the second caller is still waiting
    assert second.is_alive() and raw.inside == 1
    raw.release.set()
    first.join(timeout=10)
    second.join(timeout=10)
    assert raw.most_inside == 1 and raw.total == 3


def test_gauge_setters_on_several_threads_leave_the_last_value() -> None:
    series = FakeMetric()
    gauge = Gauge(SerialMetric(series))
    barrier = threading.Barrier(4)

    def setter(offset: int) -> None:
        barrier.wait()
        for value in range(offset, 4000, 4):
            gauge.set(value)

    workers = [threading.Thread(target=setter, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so an unguarded read-modify-write shows
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert series.total == pytest.approx(gauge.value)  # the increments add up to what was published


def test_every_triton_metric_of_the_package_is_created_through_families() -> None:
    """Only ``disagg.triton.metrics`` may call ``MetricFamily(...)`` or ``family.Metric(...)``: that is
    where each metric is wrapped in a ``SerialMetric``."""
    package = Path(metrics.__file__).resolve().parents[1]
    creators = re.compile(r"\bMetricFamily\(|\.Metric\(")
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "metrics.py" and creators.search(path.read_text())
    ]
    assert offenders == []


def test_families_wrap_each_metric_in_a_serial_metric() -> None:
    class FakeFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, **_: object) -> None:
            pass

        def Metric(self, **_: object) -> FakeMetric:
            return FakeMetric()

    families = metrics.Families(SimpleNamespace(MetricFamily=FakeFamily))
    assert isinstance(families.metric("disagg_requests_total", {}), SerialMetric)
    assert isinstance(families.histogram("disagg_prompt_tokens", {}, (1.0,)), SerialMetric)
    assert isinstance(families.gauge("disagg_kv_blocks_used", {})._metric, SerialMetric)


def test_the_hot_group_cap_and_its_decisions_are_published_from_the_orchestrator() -> None:
    """``disagg_hot_group_rate_limit`` is the cap now; ``disagg_hot_rate_decisions_total{action,reason}``
    counts what the adaptive cap decided, by increments of what is new at each refresh; every decision
    series exists from the start (at 0), and a stopped instance takes its share of the gauge out."""
    from disagg.hot.throttle import DECISIONS
    from disagg.serving.telemetry import SloConfig, SloWindow

    series: dict[tuple[str, tuple[tuple[str, str], ...]], FakeMetric] = {}

    class FakeFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name: str, **_: object) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str], **_: object) -> FakeMetric:
            return series.setdefault((self.name, tuple(sorted(labels.items()))), FakeMetric())

    state: list[tuple[float, dict[tuple[str, str], int]]] = [(2.0, {})]
    published = request_metrics.OrchestratorMetrics(
        SimpleNamespace(MetricFamily=FakeFamily),
        "llm",
        "disaggregated",
        SloWindow(SloConfig()),
        instance="llm_0",
        hot_rate=lambda: state[-1],
    )

    def total(name: str, **labels: str) -> float:
        found = [m.total for (n, ls), m in series.items() if n == name and set(labels.items()) <= set(ls)]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    decided = {(n, dict(ls)["action"], dict(ls)["reason"]) for n, ls in series if "action" in dict(ls)}
    assert decided == {("disagg_hot_rate_decisions_total", a, r) for a, r in DECISIONS}
    published.refresh()
    assert total("disagg_hot_group_rate_limit", instance="llm_0") == 2.0
    state.append((1.0, {("decrease", "step_time"): 1, ("hold", "no_baseline"): 2}))
    published.refresh()
    state.append((0.5, {("decrease", "step_time"): 2, ("hold", "no_baseline"): 2}))
    published.refresh()
    published.refresh()
    assert total("disagg_hot_group_rate_limit", instance="llm_0") == 0.5
    assert total("disagg_hot_rate_decisions_total", action="decrease", reason="step_time") == 2
    assert total("disagg_hot_rate_decisions_total", action="hold", reason="no_baseline") == 2
    assert total("disagg_hot_rate_decisions_total", action="increase", reason="headroom") == 0
    published.stop()
    assert total("disagg_hot_group_rate_limit", instance="llm_0") == 0.0


class ValuedMetric(FakeMetric):
    """A FakeMetric whose series already holds `start` (another holder's share) and answers value()."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.start = start

    def value(self) -> float:
        return self.start + self.total


def test_a_dead_holders_share_is_taken_over_and_corrected_by_the_next_set() -> None:
    """A stub killed with 78 blocks published never retires: its share stays in the series. The
    instance that replaces it adopts the series' value, so publishing its own 0 brings the series to 0
    (without adopting, the series would read 78 for as long as the server runs)."""
    series = ValuedMetric(78)
    gauge = Gauge(series)
    gauge.adopt()
    assert gauge.value == 78
    gauge.set(0)
    assert series.value() == 0
    gauge.set(5)
    assert series.value() == 5


def _reporter_gauges(start: float) -> tuple[SimpleNamespace, list[ValuedMetric]]:
    """A decode pool's reporter as far as taking over goes: three gauges, the others its role lacks."""
    series = [ValuedMetric(start) for _ in range(3)]
    used, info, active = (Gauge(m) for m in series)
    fake = SimpleNamespace(used=used, info=info, active=active, free=None, cached=None, queue=None)
    fake.pending = fake.limit = fake.load = None
    fake._gauges = lambda: pool_metrics.PoolReporter._gauges(fake)
    return fake, series


@pytest.mark.parametrize(("others", "adopted"), [((), True), ((4242,), False)])
def test_a_pool_takes_over_only_when_no_other_stub_of_it_lives(
    others: tuple[int, ...], adopted: bool
) -> None:
    """With no other stub of its model under this server, what the gauges hold is a dead stub's; with
    one alive (a reload beside a live instance), that one retires its own share and nothing is taken."""
    fake, series = _reporter_gauges(78)
    live = lambda server, model: [os.getpid(), *others]  # noqa: E731
    pool_metrics.PoolReporter._adopt_orphaned_shares(fake, "decode", live_stubs=live)
    fake.used.set(0)
    fake.info.set(1)
    assert series[0].value() == (0 if adopted else 78)
    assert series[1].value() == (1 if adopted else 79)


def test_a_failed_look_at_the_stubs_leaves_the_gauges_as_they_were() -> None:
    fake, series = _reporter_gauges(3)

    def broken(server: int, model: str) -> list[int]:
        raise OSError("no /proc")

    pool_metrics.PoolReporter._adopt_orphaned_shares(fake, "decode", live_stubs=broken)
    assert fake.used.value == 0 and series[0].value() == 3
