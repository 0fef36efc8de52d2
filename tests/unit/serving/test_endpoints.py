"""The servers of a remote pool (``disagg.serving.endpoints``): specs parse or are refused with a clear
ValueError, DNS entries are resolved again at most every REFRESH_S, and a call goes to the up server
with the fewest calls open (ties in turn), to an unknown one only while none is up, never to a down one."""

from __future__ import annotations

import pytest

from disagg.protocol.errors import UNAVAILABLE, ServingError
from disagg.serving import endpoints
from disagg.serving.endpoints import REFRESH_S, Endpoint, Endpoints, Entry, parse_remote_pools, parse_spec


class _Dns:
    """A resolver whose answers the test sets; counts its lookups."""

    def __init__(self, **names: list[str]) -> None:
        self.names = dict(names)
        self.lookups: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.lookups.append(name)
        return list(self.names.get(name, []))


def _no_dns(name: str) -> list[str]:
    raise AssertionError(f"a static spec must not be resolved ({name!r})")


def _urls(pool: Endpoints) -> list[str]:
    return [e.url for e in pool.listed()]


def _picks(pool: Endpoints, n: int) -> list[str]:
    return [pool.pick().url for _ in range(n)]


# ---------------------------------------------------------------- parse_spec


def test_a_spec_lists_static_and_dns_entries() -> None:
    assert parse_spec("10.0.0.2:8001, dns:decode.ns.svc.cluster.local:9001,host-a:1") == (
        Entry("10.0.0.2", 8001),
        Entry("decode.ns.svc.cluster.local", 9001, dns=True),
        Entry("host-a", 1),
    )


@pytest.mark.parametrize(
    ("spec", "host"),
    [("[::1]:8001", "::1"), ("[fd00::2]:8001", "fd00::2"), ("dns:[fe80::1]:7", "fe80::1")],
)
def test_an_ipv6_host_is_written_in_brackets(spec: str, host: str) -> None:
    (entry,) = parse_spec(spec)
    assert (entry.host, entry.port) == (host, int(spec.rpartition(":")[2]))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("host", "needs a port"),
        ("host:", "needs a port"),
        ("host:http", "needs a port"),
        ("host:0", "needs a port"),
        ("host:65536", "needs a port"),
        ("host:-1", "needs a port"),
        ("", "needs a port"),
        ("a:1,", "needs a port"),
        ("dns:name", "needs a port"),
        (":8001", "no valid host"),
        ("dns::8001", "no valid host"),
        ("-host:8001", "no valid host"),
        ("bad_host:8001", "no valid host"),
        ("a b:8001", "no valid host"),
        ("[::g]:8001", "no valid host"),
        ("[]:8001", "no valid host"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_entry(spec: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_spec(spec)
    named = "" if spec.endswith(",") else spec
    assert str(refused.value).startswith(f"remote server {named!r} ") and says in str(refused.value)


def test_the_refusal_names_the_entry_at_fault() -> None:
    with pytest.raises(ValueError) as refused:
        parse_spec("good:1, bad_host:2")
    assert str(refused.value) == "remote server 'bad_host:2' has no valid host"


def test_the_highest_and_lowest_ports_are_valid() -> None:
    assert [e.port for e in parse_spec("a:1,b:65535")] == [1, 65535]


# ---------------------------------------------------------------- parse_remote_pools


def test_remote_pools_map_each_pool_to_its_spec() -> None:
    text = " prefill = 10.0.0.2:8001 ; decode=dns:decode.ns.svc:8001;;"
    assert parse_remote_pools(text) == {"prefill": "10.0.0.2:8001", "decode": "dns:decode.ns.svc:8001"}
    assert parse_remote_pools("") == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prefill", "must be POOL=SERVERS"),
        ("=a:1", "must be POOL=SERVERS"),
        ("prefill=a:1;prefill=b:2", "each pool once"),
        ("prefill=a", "needs a port"),
        ("prefill=", "needs a port"),
        ("prefill=a:1;decode=bad_host:2", "no valid host"),
    ],
)
def test_bad_remote_pools_are_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_remote_pools(text)


# ---------------------------------------------------------------- Endpoints: listing and refresh


def test_a_static_spec_lists_its_servers_unknown_and_never_resolves() -> None:
    pool = Endpoints("decode", "10.0.0.1:8001,[::1]:8002,host:8003", _no_dns)
    assert _urls(pool) == ["10.0.0.1:8001", "[::1]:8002", "host:8003"]
    assert all(e.up is None and e.open == 0 and e.listed for e in pool.listed())
    assert not pool.dynamic
    assert not pool.refresh(1e9)  # nothing to resolve, ever


def test_a_dns_entry_lists_every_address_and_ipv6_ones_in_brackets() -> None:
    dns = _Dns(svc=["10.0.0.1", "fd00::1"])
    pool = Endpoints("decode", "dns:svc:8001,10.0.0.9:8001", dns)
    assert pool.dynamic
    assert _urls(pool) == ["10.0.0.1:8001", "[fd00::1]:8001", "10.0.0.9:8001"]
    assert dns.lookups == ["svc"]


def test_an_address_listed_twice_is_one_server() -> None:
    pool = Endpoints("decode", "dns:a:1,dns:b:1,10.0.0.1:1", _Dns(a=["10.0.0.1"], b=["10.0.0.1", "10.0.0.2"]))
    assert _urls(pool) == ["10.0.0.1:1", "10.0.0.2:1"]


def test_dns_is_resolved_again_at_most_every_refresh_s() -> None:
    dns = _Dns(svc=["10.0.0.1"])
    pool = Endpoints("decode", "dns:svc:8001", dns)
    assert pool.refresh(100.0)  # constructed at 0.0: due
    assert not pool.refresh(100.0 + REFRESH_S / 2)
    assert dns.lookups == ["svc", "svc"]
    assert pool.refresh(100.0 + REFRESH_S)
    assert dns.lookups == ["svc"] * 3


def test_servers_appear_unknown_and_leave_when_dns_says_so() -> None:
    dns = _Dns(svc=["10.0.0.1", "10.0.0.2"])
    pool = Endpoints("decode", "dns:svc:8001", dns)
    first = pool.get("10.0.0.1:8001")
    assert first is not None
    pool.answered(first)
    dns.names["svc"] = ["10.0.0.1", "10.0.0.3"]
    assert pool.refresh(REFRESH_S)
    assert _urls(pool) == ["10.0.0.1:8001", "10.0.0.3:8001"]
    assert pool.get("10.0.0.1:8001") is first and first.up is True  # kept, with what is known of it
    new = pool.get("10.0.0.3:8001")
    assert new is not None and new.up is None
    assert pool.get("10.0.0.2:8001") is None  # gone, with no call open on it


def test_a_server_that_left_is_tracked_while_it_has_open_calls() -> None:
    dns = _Dns(svc=["10.0.0.1", "10.0.0.2"])
    pool = Endpoints("decode", "dns:svc:8001", dns)
    leaving = pool.get("10.0.0.2:8001")
    assert leaving is not None
    for endpoint in pool.listed():
        pool.answered(endpoint)
    leaving.open = 1
    dns.names["svc"] = ["10.0.0.1"]
    pool.refresh(REFRESH_S)
    assert pool.get("10.0.0.2:8001") is leaving and not leaving.listed
    assert _urls(pool) == ["10.0.0.1:8001"]  # not pinged
    assert _picks(pool, 3) == ["10.0.0.1:8001"] * 3  # not picked, though it has a call like the other
    leaving.open = 0
    pool.refresh(2 * REFRESH_S)
    assert pool.get("10.0.0.2:8001") is None


def test_a_server_that_left_and_came_back_keeps_its_record() -> None:
    dns = _Dns(svc=["10.0.0.1"])
    pool = Endpoints("decode", "dns:svc:8001", dns)
    endpoint = pool.get("10.0.0.1:8001")
    assert endpoint is not None
    endpoint.open = 2
    dns.names["svc"] = []
    pool.refresh(REFRESH_S)
    assert pool.listed() == [] and not endpoint.listed
    dns.names["svc"] = ["10.0.0.1"]
    pool.refresh(2 * REFRESH_S)
    assert pool.listed() == [endpoint] and endpoint.listed and endpoint.open == 2


def test_resolve_host_answers_each_address_once_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """``resolve_host`` answers every address once, sorted; an empty list when the name has none; None
    when the lookup itself failed."""

    def getaddrinfo(name: str, port: object, type: int = 0) -> list[tuple]:
        if name == "missing":
            raise endpoints.socket.gaierror(endpoints.socket.EAI_NONAME, "no such host")
        if name == "flaky":
            raise endpoints.socket.gaierror(endpoints.socket.EAI_AGAIN, "temporary failure")
        return [(0, type, 0, "", (address, 0)) for address in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]

    monkeypatch.setattr(endpoints.socket, "getaddrinfo", getaddrinfo)
    assert endpoints.resolve_host("svc") == ["10.0.0.1", "10.0.0.2"]
    assert endpoints.resolve_host("missing") == []
    assert endpoints.resolve_host("flaky") is None


def test_a_failed_lookup_keeps_the_servers_listed() -> None:
    answers: list[list[str] | None] = [["10.0.0.1", "10.0.0.2"], None, ["10.0.0.2"]]
    pool = Endpoints("decode", "dns:svc:8001", lambda name: answers.pop(0))
    assert [e.url for e in pool.listed()] == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert pool.refresh(endpoints.REFRESH_S)  # the lookup failed: nothing dropped
    assert [e.url for e in pool.listed()] == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert pool.refresh(2 * endpoints.REFRESH_S)  # an answer without 10.0.0.1: it is dropped
    assert [e.url for e in pool.listed()] == ["10.0.0.2:8001"]


# ---------------------------------------------------------------- Endpoints: pick, answered, down


def _three(up: tuple[bool | None, ...] = (True, True, True)) -> Endpoints:
    pool = Endpoints("decode", "a:1,b:1,c:1", _no_dns)
    for endpoint, state in zip(pool.listed(), up, strict=True):
        endpoint.up = state
    return pool


def test_ties_go_in_turn() -> None:
    assert _picks(_three(), 6) == ["a:1", "b:1", "c:1"] * 2


def test_the_server_with_fewest_open_calls_is_picked() -> None:
    pool = _three()
    a, b, c = pool.listed()
    a.open, b.open, c.open = 2, 0, 1
    assert _picks(pool, 3) == ["b:1"] * 3
    b.open = 1
    assert set(_picks(pool, 4)) == {"b:1", "c:1"}  # the two least busy, in turn


def test_calls_spread_when_the_caller_counts_them_open() -> None:
    pool = _three()
    picked = []
    for _ in range(9):
        endpoint = pool.pick()
        endpoint.open += 1
        picked.append(endpoint.url)
    assert sorted(picked) == ["a:1"] * 3 + ["b:1"] * 3 + ["c:1"] * 3
    assert [e.open for e in pool.listed()] == [3, 3, 3]


def test_a_down_server_is_never_picked_until_it_answers_again() -> None:
    pool = _three()
    a, b, c = pool.listed()
    pool.down(b)
    assert b.up is False
    assert set(_picks(pool, 6)) == {"a:1", "c:1"}
    a.open = c.open = 5  # busier than the down one: still not picked
    assert set(_picks(pool, 4)) == {"a:1", "c:1"}
    assert pool.answered(b)  # back in rotation
    assert _picks(pool, 2) == ["b:1", "b:1"]


def test_answered_says_whether_the_server_was_not_up_before() -> None:
    pool = _three((None, False, True))
    a, b, c = pool.listed()
    assert pool.answered(a) and a.up is True
    assert pool.answered(b) and b.up is True
    assert not pool.answered(c) and c.up is True
    assert not pool.answered(a)


def test_unknown_servers_are_used_only_when_none_is_up() -> None:
    pool = _three((None, None, None))
    assert _picks(pool, 3) == ["a:1", "b:1", "c:1"]  # none pinged yet: the unknown ones
    b = pool.listed()[1]
    pool.answered(b)
    b.open = 10
    assert _picks(pool, 3) == ["b:1"] * 3  # one up, however busy: never the unknown ones
    pool.down(b)
    assert set(_picks(pool, 4)) == {"a:1", "c:1"}  # none up: the unknown ones again, not the down one


def test_a_newly_listed_server_waits_for_its_first_ping_while_others_are_up() -> None:
    dns = _Dns(svc=["10.0.0.1"])
    pool = Endpoints("decode", "dns:svc:8001", dns)
    (old,) = pool.listed()
    pool.answered(old)
    old.open = 3
    dns.names["svc"] = ["10.0.0.1", "10.0.0.2"]
    pool.refresh(REFRESH_S)
    assert _picks(pool, 2) == ["10.0.0.1:8001"] * 2
    new = pool.get("10.0.0.2:8001")
    assert new is not None
    pool.answered(new)
    assert _picks(pool, 2) == ["10.0.0.2:8001"] * 2


def test_no_server_to_take_a_call_is_unavailable_and_says_why() -> None:
    pool = _three((False, False, False))
    with pytest.raises(ServingError) as none_answers:
        pool.pick()
    assert none_answers.value.code == UNAVAILABLE
    assert (
        "decode" in none_answers.value.message
        and "none of its 3 servers answers" in none_answers.value.message
    )

    empty = Endpoints("prefill", "dns:svc:8001", _Dns())
    with pytest.raises(ServingError) as none_listed:
        empty.pick()
    assert none_listed.value.code == UNAVAILABLE
    assert "prefill" in none_listed.value.message and "no server is listed" in none_listed.value.message


def test_all_down_takes_every_server_out_of_rotation() -> None:
    pool = _three((True, None, True))
    pool.all_down()
    assert [e.up for e in pool.listed()] == [False, False, False]
    with pytest.raises(ServingError):
        pool.pick()
    a = pool.listed()[0]
    assert pool.answered(a) and _picks(pool, 2) == ["a:1", "a:1"]


def test_an_endpoint_starts_unknown_listed_and_idle() -> None:
    assert Endpoint("h:1") == Endpoint("h:1", up=None, open=0, listed=True)
