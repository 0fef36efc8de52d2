"""Finished BLS response iterators, kept until the Python backend has let go of its own reference.

Why (Triton 2.51, python_backend r24.10): a decoupled BLS call's ``ResponseIterator`` keeps every
response it delivered, and the stub keeps a second reference to it in a map. When the last response
arrives, the iterator queues a cleanup message; the stub's stub-to-parent thread erases the map entry
when it reaches that message, without holding the GIL. If Python dropped its reference first, the
erase destroys the iterator there, and with it every response's numpy arrays: reference counts
decremented and Python memory freed without the GIL, racing the interpreter. That corrupts the stub's
heap and crashes it later at a random place (seen here once under load: a segfault in numpy freeing
an object array, then Triton aborting). python_backend r24.12 fixed the tensor side (the GIL is taken
to free a tensor's arrays); r24.10 has no fix.

What this does: a finished iterator is buried here instead of dropped, and released (by Python, with
the GIL) only once the stub-to-parent thread is known to be past its cleanup message. That thread
serves one queue in order, and ``is_cancelled()`` on a live request goes through the same queue and
waits for its answer: a check that started after an iterator was buried and answered ``False`` (a
``True`` may be a cached answer that never went through the queue) proves the map entry is gone.
The orchestrator checks cancellation after every token, so iterators are released within a token
of finishing while requests are in flight; between bursts of traffic the last few wait for the next
request.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Graveyard:
    """Thread-safe: iterators are buried from executor threads and released from the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buried: list[tuple[float, Any]] = []  # (monotonic time of burial, iterator), oldest first

    def bury(self, iterator: Any) -> None:
        """Keep a response iterator that has delivered its last response (or was drained)."""
        with self._lock:
            self._buried.append((time.monotonic(), iterator))

    def barrier(self, started_at: float) -> int:
        """A queue round trip that started at ``started_at`` completed: release what was buried
        before it. Returns how many iterators were released."""
        with self._lock:
            cut = 0
            while cut < len(self._buried) and self._buried[cut][0] < started_at:
                cut += 1
            released, self._buried = self._buried[:cut], self._buried[cut:]
        count = len(released)
        released.clear()  # the last references go here, on a Python thread holding the GIL
        return count

    def checked(self, is_cancelled: Any) -> bool:
        """Run a request's ``is_cancelled`` (the queue round trip) and release what it proves safe."""
        started = time.monotonic()
        cancelled = bool(is_cancelled())
        if not cancelled:
            self.barrier(started)
        return cancelled

    def release_all(self) -> int:
        """At finalize: no request is left to prove anything, and the stub is about to go."""
        return self.barrier(float("inf"))

    def __len__(self) -> int:
        with self._lock:
            return len(self._buried)
