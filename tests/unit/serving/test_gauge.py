"""Gauge: a Triton gauge moved by increments only (Triton 2.51's set() holds the GIL over a round trip)."""

from __future__ import annotations

import pytest

from disagg.triton.metrics import Gauge


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
