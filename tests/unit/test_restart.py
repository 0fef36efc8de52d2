"""`disagg serve`'s restart policy (disagg.restart): which exits of tritonserver it starts again."""

from __future__ import annotations

import pytest

from disagg.restart import RestartPolicy


def test_restarts_a_server_that_was_ready_up_to_the_budget_per_window() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=100.0)
    assert policy.should_restart(now=0.0, was_ready=True, stopping=False)
    assert policy.should_restart(now=10.0, was_ready=True, stopping=False)
    assert not policy.should_restart(now=20.0, was_ready=True, stopping=False)  # budget spent
    assert policy.recent == 2
    # the first restart leaves the window at 100 s: one more is allowed, then none again
    assert policy.should_restart(now=100.0, was_ready=True, stopping=False)
    assert not policy.should_restart(now=105.0, was_ready=True, stopping=False)


@pytest.mark.parametrize(
    ("was_ready", "stopping"),
    [(False, False), (True, True), (False, True)],
    ids=["failed-while-starting", "stop-requested", "both"],
)
def test_never_restarts_a_start_failure_or_a_requested_stop(was_ready: bool, stopping: bool) -> None:
    policy = RestartPolicy()
    assert not policy.should_restart(now=0.0, was_ready=was_ready, stopping=stopping)
    assert policy.recent == 0  # a refusal spends nothing


def test_zero_disables_restarts() -> None:
    assert not RestartPolicy(max_restarts=0).should_restart(now=0.0, was_ready=True, stopping=False)


@pytest.mark.parametrize(("max_restarts", "window_s"), [(-1, 10.0), (1, 0.0), (1, -5.0)])
def test_invalid_settings_are_refused(max_restarts: int, window_s: float) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=max_restarts, window_s=window_s)
