"""Graveyard: finished BLS iterators are released only by a cancellation check that began after them."""

from __future__ import annotations

import gc
import threading
import weakref

from disagg.triton.graveyard import Graveyard


class Iterator:
    """Stands in for a BLS response iterator: only its lifetime matters here."""


def buried(graveyard: Graveyard, count: int) -> list[weakref.ref[Iterator]]:
    refs = []
    for _ in range(count):
        iterator = Iterator()
        refs.append(weakref.ref(iterator))
        graveyard.bury(iterator)
    return refs


def alive(refs: list[weakref.ref[Iterator]]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_buried_iterators_stay_alive_until_a_check_passes() -> None:
    graveyard = Graveyard()
    refs = buried(graveyard, 3)
    assert alive(refs) == 3 and len(graveyard) == 3


def test_a_check_that_answered_false_releases_what_was_buried_before_it() -> None:
    graveyard = Graveyard()
    refs = buried(graveyard, 3)
    assert graveyard.checked(lambda: False) is False
    assert alive(refs) == 0 and len(graveyard) == 0


def test_a_check_releases_nothing_buried_after_it_started() -> None:
    graveyard = Graveyard()
    early = buried(graveyard, 2)
    late: list[weakref.ref[Iterator]] = []

    def check_while_more_finish() -> bool:  # iterators finishing while the round trip is under way
        late.extend(buried(graveyard, 2))
        return False

    graveyard.checked(check_while_more_finish)
    assert alive(early) == 0
    assert alive(late) == 2 and len(graveyard) == 2


def test_a_cancelled_answer_proves_nothing() -> None:
    # a request already seen cancelled answers from a cache, without a round trip through the queue
    graveyard = Graveyard()
    refs = buried(graveyard, 2)
    assert graveyard.checked(lambda: True) is True
    assert alive(refs) == 2


def test_a_failing_check_releases_nothing_and_raises() -> None:
    graveyard = Graveyard()
    refs = buried(graveyard, 1)

    def broken() -> bool:
        raise RuntimeError("stub gone")

    try:
        graveyard.checked(broken)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the check's error was swallowed")
    assert alive(refs) == 1


def test_release_all_empties_it() -> None:
    graveyard = Graveyard()
    refs = buried(graveyard, 4)
    assert graveyard.release_all() == 4
    assert alive(refs) == 0 and len(graveyard) == 0


def test_burying_and_checking_from_many_threads_loses_nothing() -> None:
    graveyard = Graveyard()
    refs: list[weakref.ref[Iterator]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def bury_many() -> None:
        start.wait()
        mine = buried(graveyard, 200)
        with lock:
            refs.extend(mine)

    def check_many() -> None:
        start.wait()
        for _ in range(200):
            graveyard.checked(lambda: False)

    threads = [threading.Thread(target=bury_many) for _ in range(4)]
    threads += [threading.Thread(target=check_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(refs) == 800
    assert alive(refs) == len(graveyard)  # what is still buried is exactly what is still alive
    graveyard.checked(lambda: False)
    assert alive(refs) == 0
