"""Which waiting imports' KV leases the decode loop renews, and when."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.pool.renewal import Renewals


def test_an_import_is_due_once_less_than_half_its_lease_is_left_and_again_after_each_renewal():
    table = Renewals()
    a = SimpleNamespace(issued_at=100.0, expires_at=110.0)  # what Renewals reads of a Descriptor
    b = SimpleNamespace(issued_at=103.0, expires_at=113.0)
    table.watch("a", a)
    table.watch("b", b)
    assert table.due(104.9) == []
    assert table.due(105.1) == [("a", a)]
    table.renewed("a", 115.1)
    assert table.due(108.1) == [("b", b)]
    assert table.due(110.2) == [("a", a), ("b", b)]
    table.forget("b")
    table.forget("b")  # idempotent
    table.renewed("b", 999.0)  # a renewal answered after the import left: ignored
    assert table.due(111.0) == [("a", a)] and len(table) == 1
    table.clear()
    assert table.due(1e9) == []


def test_the_fraction_is_checked():
    with pytest.raises(ValueError):
        Renewals(fraction=1.0)
