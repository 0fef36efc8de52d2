"""A request's one identity at the pools: its id and its attempt, and the handle they make on the wire."""

from __future__ import annotations

import pytest

from disagg.protocol.messages import JobId


def test_the_first_attempt_is_the_request_id_and_each_migration_a_new_handle():
    job = JobId("4f1c")
    assert str(job) == "4f1c"
    assert [str(JobId("4f1c", 1)), str(JobId("4f1c", 2))] == ["4f1c~1", "4f1c~2"]
    assert job == JobId("4f1c", 0) and JobId("4f1c", 1) != job


@pytest.mark.parametrize(("request_id", "attempt"), [("", 0), ("a~1", 0), ("a", -1)])
def test_an_id_that_would_be_ambiguous_on_the_wire_is_refused(request_id: str, attempt: int):
    with pytest.raises(ValueError):
        JobId(request_id, attempt)
