"""Goodput bisection against synthetic attainment curves."""

from __future__ import annotations

import pytest
from benchlib.search import RateSearch, SearchConfig


def run(config: SearchConfig, attainment) -> RateSearch:
    search = RateSearch(config)
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment(rate))
    return search


def step(limit: float):
    return lambda rate: 1.0 if rate <= limit else 0.5


def test_expands_then_bisects_from_below():
    s = run(SearchConfig(start=1.0, rel_tol=0.1, max_probes=20), step(3.3))
    assert [r for r, _ in s.probes] == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert s.best == 3.25


def test_shrinks_then_bisects_from_above():
    s = run(SearchConfig(start=10.0, rel_tol=0.1, max_probes=20), step(3.3))
    assert [r for r, _ in s.probes] == [10.0, 5.0, 2.5, 3.75, 3.125, 3.4375]
    assert s.best == 3.125


def test_a_smaller_growth_brackets_a_known_goodput_in_fewer_probes():
    # started at an earlier run's goodput (3.0): x1.25 misses at once, then bisection to 5 %
    s = run(SearchConfig(start=3.0, rel_tol=0.05, max_probes=20, growth=1.25), step(3.3))
    assert [r for r, _ in s.probes] == [3.0, 3.75, 3.375, 3.1875, 3.28125]
    assert s.best == 3.28125
    below = run(SearchConfig(start=4.0, rel_tol=0.05, max_probes=20, growth=1.25), step(3.3))
    assert [r for r, _ in below.probes][:3] == [4.0, 3.2, 3.6]


def test_smooth_curve_converges_near_the_crossing():
    # attainment falls linearly from 1 at rate 2 to 0 at rate 6: crosses 0.9 at 2.4
    s = run(SearchConfig(start=1.0, rel_tol=0.02, max_probes=30), lambda r: min(1.0, max(0.0, (6 - r) / 4)))
    assert 2.4 * 0.98 <= s.best <= 2.4


def test_bounds_and_probe_budget():
    assert run(SearchConfig(start=1.0, min_rate=0.25), lambda r: 0.0).best == 0.0
    everything = run(SearchConfig(start=1.0, max_rate=8.0, max_probes=20), lambda r: 1.0)
    assert everything.best == 8.0
    assert len(run(SearchConfig(start=1.0, max_probes=3), step(3.3)).probes) == 3


def test_config_validation():
    with pytest.raises(ValueError):
        SearchConfig(start=0.01, min_rate=0.05)
    with pytest.raises(ValueError):
        SearchConfig(start=1.0, target=1.5)
    with pytest.raises(ValueError):
        RateSearch(SearchConfig(start=1.0)).record(1.0, 2.0)
    with pytest.raises(ValueError, match="growth"):
        SearchConfig(start=1.0, growth=1.0)
