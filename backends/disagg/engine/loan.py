"""Loans of a pool's CPU cores to another pool: a decode pool lends, a prefill pool borrows.

A static split leaves the decode pool's cores idle between its steps while the prefill pool's single
core prefills every prompt. Here the decode pool (the lender) lends a core whenever it does not need
it: while it is idle, and, while prompts wait, after each step for what is left of its per-token
budget (``disagg.scheduling.pacing``). The prefill pool (the borrower) runs one *borrowed helper*
thread per lent core, pinned to it (at the pool's own niceness: ``Borrower``), which joins its
kernels' thread team (``kernels/team.c``) and claims their parts one at a time while the core is lent.

The two processes share one *loan segment* per core, 64 bytes of ``/dev/shm`` named by the
deployment's prefix and the core (``segment_path``). Its word carries four bits::

    LENT    the lender does not need the core now          (lender: lend / reclaim)
    WANT    the borrower has prompt work                    (borrower: want)
    BUSY    a borrowed helper is computing one part         (helper, only while LENT)
    WAITER  the lender waits for that part to end           (lender, asleep on the word)

    lender          word                 borrowed helper (on the lent core)
    lend()   ---->  LENT|WANT  -------->  wakes; BUSY; one part; clears BUSY; next part ...
    reclaim() --->  clears LENT; if BUSY: WAITER, sleeps  <---- part ends: clears BUSY, wakes it
    (steps)

All waits are futexes on the word (process-shared), never spins: the lender waits at most for the
one part in flight. The segment also counts the helper's seconds in parts (the borrowed seconds), its
parts, and the lender's reclaims that had to wait. Which thread computes a part changes no bits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from disagg import loanpath
from disagg.engine import kernel
from disagg.kv.stale import owner_alive

log = logging.getLogger(__name__)


class Pacing(Protocol):
    """How long a lender lends after a step (``disagg.scheduling.pacing.Pacing``, the policy; the
    engine takes it as this protocol, below the schedulers)."""

    def lend_s(self, step_s: float, reclaim_s: float, prompts_waiting: bool) -> float: ...


SHM = loanpath.SHM
SEGMENT_BYTES = 64  # kernels/team.c's struct loan_segment
LENT, BUSY, WAITER, WANT = 1, 2, 4, 8
_COUNTERS = struct.Struct("<IIQQQQ")  # word, reserved, borrowed_ns, parts, waits, wait_ns
_LENDER = slice(40, 60)  # the lending pool's name
_BORROWER = struct.Struct("<i")  # the borrowing process's pid, after it
RECLAIM_SLICE_S = 0.05  # a reclaim looks whether its borrower still lives this often while it waits
RECHECK_S = 1.0  # how often a side looks whether its peer made the segment anew


class LoanError(ValueError):
    """A core cannot be lent or borrowed here (a load-time error naming it)."""


def segment_path(scope: str, core: int) -> Path:
    """The loan segment of ``core`` in the deployment ``scope`` names (``disagg.loanpath.loan_scope``)."""
    return SHM / loanpath.segment_name(scope, core)


def library() -> Any:
    """The team library, whose loan functions both sides call; LoanError where it cannot be built."""
    loaded = kernel.team()
    if loaded is None:
        raise LoanError("core loans need the kernels' thread team, which could not be built (see the log)")
    if loaded.loan_segment_bytes() != SEGMENT_BYTES:
        size = loaded.loan_segment_bytes()
        raise LoanError(f"kernels/team.c's loan segment is {size} bytes, not {SEGMENT_BYTES}")
    return loaded


@dataclass(frozen=True)
class LoanStats:
    """One lent core's counters, as one side sees them (seconds, totals since the segment was made)."""

    core: int
    lender: str
    borrowed_s: float  # borrowed helpers' time computing parts on the core
    parts: int
    lent_s: float  # time this lender had the core lent (the lender's side only)
    waits: int  # reclaims that waited for a part in flight
    wait_s: float


class Segment:
    """One core's loan segment, mapped into this process (made if absent)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SEGMENT_BYTES:
                os.ftruncate(fd, SEGMENT_BYTES)
            self.inode = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, SEGMENT_BYTES)
        finally:
            os.close(fd)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)

    def replaced(self) -> bool:
        """Whether the path now names another segment, or none (the peer made it anew, or ended)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def counters(self) -> tuple[int, float, int, int, float]:
        """(word, borrowed seconds, parts, waits, wait seconds)."""
        word, _, borrowed_ns, parts, waits, wait_ns = _COUNTERS.unpack_from(self._map, 0)
        return word, borrowed_ns / 1e9, parts, waits, wait_ns / 1e9

    @property
    def lender(self) -> str:
        return bytes(self._map[_LENDER]).split(b"\0", 1)[0].decode("utf-8", "replace")

    @lender.setter
    def lender(self, name: str) -> None:
        raw = name.encode()[: _LENDER.stop - _LENDER.start - 1]
        self._map[_LENDER] = raw.ljust(_LENDER.stop - _LENDER.start, b"\0")

    @property
    def borrower(self) -> int:
        return _BORROWER.unpack_from(self._map, _LENDER.stop)[0]

    def unlink(self) -> None:
        """Remove the path if it still names this segment."""
        if not self.replaced():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def close(self) -> None:
        self._anchor = None  # the mapping cannot close while a ctypes view exports it
        self._map.close()


class Loans:
    """What an engine loop tells its side of the loans (``disagg.pool.loop``). The base lends and
    borrows nothing; a side keeps its cores' segments in ``_segments``."""

    def __init__(self) -> None:
        self._segments: dict[int, Segment] = {}

    def idle(self) -> None:
        """The loop has nothing to do and waits."""

    def step(self) -> None:
        """The loop is about to run an engine step."""

    def stepped(self) -> None:
        """The loop ran a step and sent what it produced."""

    def stats(self) -> tuple[LoanStats, ...]:
        """Each core's counters, with the lender's name its segment holds."""
        return self._stats(lent_s=0.0)

    def _stats(self, lent_s: float, lender: str | None = None) -> tuple[LoanStats, ...]:
        out = []
        for core, segment in self._segments.items():
            _, borrowed_s, parts, waits, wait_s = segment.counters()
            name = segment.lender if lender is None else lender
            out.append(LoanStats(core, name, borrowed_s, parts, lent_s, waits, wait_s))
        return tuple(out)

    def threads(self) -> tuple[int, ...]:
        """Thread ids of this process that run on another pool's cores (never pinned with it)."""
        return ()

    def close(self) -> None:
        """End the loans (the segments' paths go with the last side)."""

    def abandon(self) -> None:
        """The process exits without closing (its server died): remove the segments' paths now."""
        for segment in self._segments.values():
            segment.unlink()


class Borrower(Loans):
    """A prefill pool's side: one borrowed helper per core of ``cores``, pinned there; it works while
    the lender lends the core and this pool has prompt work (``step`` to ``idle``).

    The helper runs at this pool's own priority (its niceness), not at ``SCHED_IDLE`` unless ``idle``:
    on SmolLM2's ``codegen`` at 0.4 req/s on the AVX2 machine, a ``SCHED_IDLE`` helper lost its core
    to every other thread there (the load generator, Triton's, the decode stub's), its parts stretched,
    and the prefill pool's own thread spun waiting for them: 6.7 s computed on the lent core saved
    2.5 s of prefill (TTFT p50 884 ms, against 1008 static); at the pool's niceness 6.4 s saved 4.9 s
    (TTFT p50 686 ms, every request within the SLOs). The helper computes only while the core is lent
    either way: the decode pool's steps never wait for it beyond the one part in flight."""

    def __init__(
        self,
        prefix: str,
        cores: tuple[int, ...],
        clock: Callable[[], float] = time.monotonic,
        idle: bool = False,
    ) -> None:
        super().__init__()
        self._lib = library()
        self._prefix, self._clock = prefix, clock
        self._helpers: dict[int, int] = {}  # core -> the team's index of its helper
        self._retired: list[Segment] = []  # replaced segments a helper may have read: unmapped at close
        self._wanting = False
        self._checked = clock()
        try:
            for core in cores:
                segment = self._segments[core] = Segment(segment_path(prefix, core))
                index = self._lib.team_borrow(segment.address, core, int(idle))
                if index < 0:
                    raise LoanError(f"core {core} cannot be borrowed: {os.strerror(-index)}")
                self._helpers[core] = index
        except BaseException:
            self.close()
            raise
        refused = [core for core, i in self._helpers.items() if idle and not self._lib.team_borrowed_idle(i)]
        if refused:
            log.warning("borrowed helpers on cores %s could not be set to SCHED_IDLE", refused)

    def threads(self) -> tuple[int, ...]:
        return tuple(int(self._lib.team_borrowed_tid(i)) for i in self._helpers.values())

    def step(self) -> None:
        if self._wanting:
            return
        self._recheck()
        self._wanting = True
        for segment in self._segments.values():
            self._lib.loan_want(segment.address, 1)

    def idle(self) -> None:
        if not self._wanting:
            return
        self._wanting = False
        for segment in self._segments.values():
            self._lib.loan_want(segment.address, 0)

    def _recheck(self) -> None:
        """Follow a lender that made its segment anew (it restarted): the helper moves to the new one."""
        now = self._clock()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        for core, segment in list(self._segments.items()):
            if segment.replaced():
                fresh = self._segments[core] = Segment(segment_path(self._prefix, core))
                self._lib.team_borrow_segment(self._helpers[core], fresh.address)
                self._retired.append(segment)

    def close(self) -> None:
        self.idle()
        for index in self._helpers.values():
            self._lib.team_unborrow(index)  # returns once the helper has ended
        self._helpers.clear()
        for segment in (*self._segments.values(), *self._retired):
            segment.unlink()
            segment.close()
        self._segments.clear()
        self._retired.clear()


class Lender(Loans):
    """A decode pool's side: lends ``cores`` while the loop is idle and, while the borrower has prompt
    work, after each step for the time ``pacing`` allows; takes them back before each step."""

    def __init__(
        self,
        prefix: str,
        cores: tuple[int, ...],
        name: str,
        pacing: Pacing,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._lib = library()
        self._prefix, self._name, self.pacing, self._clock = prefix, name, pacing, clock
        self._lent_at: float | None = None
        self._lent_s = 0.0
        self._reclaim_s = 0.0  # the last reclaims' wait, smoothed: what the next one is expected to cost
        self._since = clock()  # when the core was last taken back: this step's start
        self._checked = self._since
        try:
            for core in cores:
                self._segments[core] = self._open(core)
        except BaseException:
            self.close()
            raise

    def _open(self, core: int) -> Segment:
        segment = Segment(segment_path(self._prefix, core))
        segment.lender = self._name
        self._reclaim(segment)  # a lender that died lending left the word lent
        return segment

    def wanted(self) -> bool:
        """Whether the borrower has prompt work now."""
        return any(self._lib.loan_state(s.address) & WANT for s in self._segments.values())

    def idle(self) -> None:
        self._recheck()
        self._lend()

    def step(self) -> None:
        if self._lent_at is None:
            self._since = self._clock()
        self._take_back()

    def stepped(self) -> None:
        step_s = self._clock() - self._since
        lend_s = self.pacing.lend_s(step_s, self._reclaim_s, self.wanted())
        if lend_s <= 0:
            return
        self._lend()
        first = next(iter(self._segments.values()))  # one borrower wants them all: the loans end together
        self._lib.loan_await(first.address, int(lend_s * 1e9))
        self._take_back()

    def _lend(self) -> None:
        if self._lent_at is not None:
            return
        self._lent_at = self._clock()
        for segment in self._segments.values():
            self._lib.loan_lend(segment.address)

    def _take_back(self) -> None:
        if self._lent_at is None:
            return
        waited = max(self._reclaim(segment) for segment in self._segments.values())
        now = self._clock()
        self._lent_s += now - self._lent_at
        self._lent_at = None
        self._since = now
        self._reclaim_s = 0.75 * self._reclaim_s + 0.25 * waited

    def _reclaim(self, segment: Segment) -> float:
        """Take one core back; seconds waited for the part in flight. A borrower that died inside a
        part never ends it: the part is written off."""
        while True:
            waited = self._lib.loan_reclaim(segment.address, int(RECLAIM_SLICE_S * 1e9))
            if waited >= 0:
                return waited / 1e9
            if segment.borrower <= 0 or not owner_alive(segment.borrower):
                log.warning("%s: its borrower died inside a part; the core is taken back", segment.path)
                self._lib.loan_abandoned(segment.address)
                return RECLAIM_SLICE_S

    def _recheck(self) -> None:
        """Make the segment anew where a borrower's close removed it (a new borrower finds it)."""
        now = self._clock()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        if self._lent_at is not None:
            return
        for core, segment in list(self._segments.items()):
            if segment.replaced():
                segment.close()
                self._segments[core] = self._open(core)

    def stats(self) -> tuple[LoanStats, ...]:
        lent_s = self._lent_s + (0.0 if self._lent_at is None else self._clock() - self._lent_at)
        return self._stats(lent_s, self._name)  # its whole name (the segment holds 19 bytes of it)

    def close(self) -> None:
        self._take_back()
        for segment in self._segments.values():
            segment.unlink()
            segment.close()
        self._segments.clear()
