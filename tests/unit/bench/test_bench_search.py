"""Goodput bisection against synthetic attainment curves; goodput as a bracket: the search refines until it
is at most 3 % wide or says why it stopped, the bracket rule compares deployments, and an old result
without a bracket gets one from its probes."""

from __future__ import annotations

import pytest

from perf.benchlib.search import BOTTOM, FLAT, NARROW, PROBES, TOP, Bracket, RateSearch, SearchConfig


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


def test_the_search_refines_until_the_bracket_is_at_most_three_percent_wide():
    s = run(SearchConfig(start=1.0, growth=1.4, max_probes=20), step(2.5))
    # x1.4 up: 1.0, 1.4, 1.96 pass, 2.744 misses; then bisection: 2.352 pass, 2.548 miss, 2.45 pass,
    # 2.499 pass -> [2.499, 2.548) is 1.96 % wide (2.45 -> 2.548 was 4 %)
    rates = [round(r, 4) for r, _ in s.probes]
    assert rates == [1.0, 1.4, 1.96, 2.744, 2.352, 2.548, 2.45, 2.499]
    assert s.stop_reason == NARROW
    assert s.bracket.low == s.best and s.bracket.high == pytest.approx(2.548)
    assert s.bracket.width is not None and s.bracket.width <= 0.03
    assert s.best <= 2.5 < s.bracket.high


def test_the_search_says_why_it_stopped_before_three_percent():
    limited = run(SearchConfig(start=1.0, growth=2.0, max_probes=4), step(2.5))
    assert limited.stop_reason == PROBES  # 1, 2 pass, 4 misses, 3 misses: [2, 3) is 50 % wide
    assert limited.bracket == Bracket(2.0, 3.0) and limited.bracket.width == 0.5
    top = run(SearchConfig(start=1.0, max_rate=4.0), lambda r: 1.0)
    assert top.stop_reason == TOP and top.bracket == Bracket(4.0, None) and top.bracket.width is None
    bottom = run(SearchConfig(start=1.0, min_rate=0.25), lambda r: 0.0)
    assert bottom.stop_reason == BOTTOM and bottom.bracket == Bracket(0.0, 0.25)
    assert RateSearch(SearchConfig(start=1.0)).stop_reason is None  # nothing probed yet


def test_a_miss_below_a_pass_does_not_close_the_bracket():
    # noise: 2.0 misses, then 3.0 passes; the bracket is above the highest pass
    answers = {1.0: 1.0, 2.0: 0.8, 3.0: 0.95, 4.0: 0.5}
    s = RateSearch(SearchConfig(start=1.0))
    for rate, attainment in answers.items():
        s.record(rate, attainment)
    assert s.bracket == Bracket(3.0, 4.0)


def test_the_bracket_rule():
    ours, theirs = Bracket(2.6, 2.7), Bracket(1.9, 2.0)
    assert ours.at_least(theirs, 1.3)  # 2.6 >= 1.3 x 2.0
    assert not Bracket(2.59, 2.7).at_least(theirs, 1.3)
    assert not ours.at_least(Bracket(1.9, None))  # an open high end is never beaten
    assert not Bracket(0.0, 0.1).at_least(Bracket(0.0, 0.0))  # nothing met is no win
    assert Bracket(1.95, 2.05).overlaps(theirs) and theirs.overlaps(Bracket(1.95, 2.05))
    assert not ours.overlaps(theirs)
    # touching: our low end is their high end, the rate they missed and we met: above, not a tie
    assert Bracket(2.0, 2.1).at_least(theirs) and not Bracket(2.0, 2.1).overlaps(theirs)
    with pytest.raises(ValueError):
        Bracket(2.0, 1.0)


def test_an_entry_without_a_bracket_gets_one_from_its_probes():
    def probe(rate: float, attainment: float) -> dict:
        return {"rate": rate, "summary": {"attainment": attainment}}

    old = {
        "goodput_rps": 2.0,
        "probes": [probe(1.0, 1.0), probe(2.0, 0.95), probe(4.0, 0.5), probe(3.0, 0.7)],
    }
    assert Bracket.of(old) == Bracket(2.0, 3.0)
    assert Bracket.of({"goodput_rps": 0.0, "probes": [], "misses_alone": True}) == Bracket(0.0, 0.0)
    stored = {"goodput_rps": 2.0, "bracket": {"low": 2.0, "high": 2.05, "width": 0.025}, "probes": []}
    assert Bracket.of(stored) == Bracket(2.0, 2.05)
    assert Bracket.from_dict(Bracket(1.0, None).to_dict()) == Bracket(1.0, None)


def test_going_down_the_search_stops_when_attainment_no_longer_rises():
    # every rate misses; attainment rises 0.56 -> 0.69 -> 0.69 -> 0.75, then 0.69: flat over three probes
    curve = {1.0: 0.56, 0.5: 0.69, 0.25: 0.69, 0.125: 0.75, 0.0625: 0.69}
    s = run(SearchConfig(start=1.0, min_rate=0.01, max_probes=20), lambda r: curve[r])
    assert [r for r, _ in s.probes] == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert s.stop_reason == FLAT and s.bracket == Bracket(0.0, 0.0625)
    # a rise of 5 points or more over three probes keeps it going, down to where it passes
    rising = {1.0: 0.5, 0.5: 0.6, 0.25: 0.7, 0.125: 0.8, 0.0625: 0.95, 0.09375: 0.85, 0.078125: 0.9}
    s = run(SearchConfig(start=1.0, min_rate=0.01, max_probes=7), lambda r: rising[r])
    assert [r for r, _ in s.probes] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.09375, 0.078125]
    assert s.best == 0.078125 and s.stop_reason == PROBES


def test_small_steps_down_are_not_called_flat():
    # started near a known goodput with x1.15 steps: three misses within 1.3x of each other are noise
    config = SearchConfig(start=0.435, growth=1.15, min_rate=0.01, max_probes=6)
    s = run(config, lambda r: 1.0 if r < 0.25 else 0.6)
    rates = [round(r, 3) for r, _ in s.probes]
    assert rates[:3] == [0.435, 0.378, 0.329] and len(rates) == 6 and s.best > 0


def test_a_slow_server_is_not_called_flat_while_its_prompts_alone_keep_it_busy():
    # llama.cpp-like: a prompt takes 1.1 s alone; misses at 1.64, 1.17 and 0.84 req/s are its queue,
    # not a floor: the search goes on down to where prompts leave it half idle, and finds the pass
    def curve(rate: float) -> float:
        return 0.95 if rate <= 0.45 else (0.0 if rate > 1.0 else 0.03)

    slow = SearchConfig(start=1.64, growth=1.4, min_rate=0.01, max_probes=10, alone_s=1.1)
    s = run(slow, curve)
    assert s.best > 0 and s.stop_reason != FLAT
    assert min(r for r, _ in s.probes) < 0.5
    # without the prompt's time alone, the same misses stop it as flat at 0.84
    s = run(SearchConfig(start=1.64, growth=1.4, min_rate=0.01, max_probes=10), curve)
    assert s.stop_reason == FLAT and s.best == 0.0
    # and with it, a server that misses even half idle is still stopped as flat, without a pass
    s = run(SearchConfig(start=1.64, growth=1.4, min_rate=0.01, max_probes=10, alone_s=1.1), lambda r: 0.0)
    assert s.stop_reason == FLAT and min(r for r, _ in s.probes) * 1.1 <= 0.5
    with pytest.raises(ValueError):
        SearchConfig(start=1.0, alone_s=0.0)
