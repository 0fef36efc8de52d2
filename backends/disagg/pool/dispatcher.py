"""The response and cancellation thread of a pool instance.

Responses and cancellation checks are round trips to the server (Triton's response sender): this
thread does them, in order, so the engine thread never waits on one between steps. Between
deliveries it polls every watched job's sink for cancellation (every ``poll_s``) and reports a
cancelled one through ``on_cancelled``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from disagg.protocol.messages import Event, Job

log = logging.getLogger(__name__)

Delivery = tuple[Job, Event, bool, Callable[[], None] | None]


class Dispatcher:
    def __init__(self, name: str, on_cancelled: Callable[[str], None], poll_s: float = 0.02) -> None:
        self._on_cancelled = on_cancelled
        self._poll_s = poll_s
        self._outbox: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._watched: dict[str, Job] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, job: Job) -> None:
        with self._lock:
            self._watched[job.handle] = job

    def send(
        self, job: Job, event: Event, final: bool, on_undelivered: Callable[[], None] | None = None
    ) -> None:
        """Queue an event; ``on_undelivered`` runs (on this thread) if it cannot reach the client."""
        if final:
            with self._lock:
                self._watched.pop(job.handle, None)
        self._outbox.put((job, event, final, on_undelivered))

    def close(self, timeout_s: float) -> None:
        """Deliver what was sent so far, then stop the thread."""
        self._outbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        last_poll = 0.0
        while True:
            try:
                item = self._outbox.get(timeout=self._poll_s)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._deliver(*item)
            now = time.monotonic()
            if now - last_poll >= self._poll_s:
                last_poll = now
                self._poll()

    def _deliver(
        self, job: Job, event: Event, final: bool, on_undelivered: Callable[[], None] | None
    ) -> None:
        try:
            job.sink.emit(event, final)
        except Exception:  # a client that went away must not stop the others
            log.warning("could not deliver a response for %s", job.handle, exc_info=True)
            if on_undelivered is not None:
                on_undelivered()

    def _poll(self) -> None:
        with self._lock:
            jobs = list(self._watched.values())
        for job in jobs:
            try:
                cancelled = job.sink.is_cancelled()
            except Exception:
                cancelled = True  # its request is gone
            if cancelled:
                with self._lock:
                    if self._watched.pop(job.handle, None) is None:
                        continue  # it ended meanwhile
                self._on_cancelled(job.handle)
