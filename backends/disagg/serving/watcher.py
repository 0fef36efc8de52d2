"""The pool watcher: probes each pool for its health and load, and restarts the pools that are gone.

Every ``health.probe_interval_s`` each deployed pool gets one ``ping`` (never two in flight to one pool); the
answer, or its absence within ``health.probe_timeout_s``, goes to that pool's ``PoolHealth`` (and the load it
answers to admission and to the adaptive hot-group cap, ``Orchestrator.observe_load``). A pool that
misses ``DEAD_AFTER`` probes in a row is gone, and why matters: a model Triton still reports ready whose
instance does not answer is ``DEAD`` (on Triton 2.51 a dead stub is neither restarted nor marked
unready); one that is not ready is being unloaded (a shutdown, an operator, a reload) or was never
loaded, and is left alone. One missed probe alone says nothing: a ping can land on an instance the
autoscaler is removing. A request's call can say more, at once: Triton answers a call to an instance
whose stub died "Stub process '...' is not healthy" (``errors.STUB_DEAD``), and the orchestrator finds
that pool ``DEAD`` then; this watcher hears of it (``Orchestrator.listen``) as of its own probes.
Only a dead pool's open calls are given up (the caller's ``on_change`` sees the reason), and only a dead
pool is restarted through model control, after it stayed silent for a probe round plus this watcher's
own random delay (under one probe interval), waiting ``health.recovery_backoff_s`` after each failed attempt
(doubling, at most ``MAX_BACKOFF_S``). Every orchestrator's watcher may restart (``health.recovery``);
the delays spread them, and a restart begins by checking the model is still ready (the one that came
first is unloading it): so one restart happens, by whichever watcher saw the death first. A watcher
starts with its orchestrator's first request. The pool is back in use once its probes say so; the
time from gone to healthy is what ``recovered`` reports.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from disagg.protocol.errors import ServingError
from disagg.serving.health import DEAD, NOT_READY, Change, PoolState
from disagg.serving.orchestrator import Orchestrator

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
DEAD_AFTER = 2  # probes missed in a row that find a pool gone


class PoolWatcher:
    def __init__(
        self,
        orchestrator: Orchestrator,
        restart: Callable[[str], Awaitable[bool | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_restart: Callable[[str], None] | None = None,
        on_recovered: Callable[[str, float], None] | None = None,
        is_ready: Callable[[str], Awaitable[bool]] | None = None,
        restart_delay_s: float | None = None,
        restartable: Callable[[str], bool] = lambda pool: True,
        stub_dead: Callable[[str], bool] = lambda pool: False,
    ) -> None:
        """``restart(pool)`` reloads a pool's model (None: this watcher only probes), and returns False
        when it left the pool alone (another entry point restarted it first); ``on_restart`` and
        ``on_recovered(pool, seconds)`` are told of each restart and each recovery (metrics);
        ``is_ready(pool)``: whether the server still reports the pool's model ready (None: it does);
        ``restart_delay_s``: this watcher's delay before a first restart, beyond one probe round (None:
        random, under one probe interval); ``restartable(pool)``: whether this watcher may restart the
        pool at all (a pool of another server is restarted by that server); ``stub_dead(pool)``: a
        process of the pool is known to have died (``DEAD`` at once, no probe needed)."""
        self.orchestrator = orchestrator
        self.restart = restart
        self._restartable = restartable
        self._stub_dead = stub_dead
        self._is_ready = is_ready
        interval = orchestrator.config.health.probe_interval_s
        self._delay = random.uniform(0, interval) if restart_delay_s is None else restart_delay_s
        self._on_restart = on_restart
        self._on_recovered = on_recovered
        self._clock = clock
        self._probing: set[str] = set()
        self._missed: dict[str, int] = {}  # probes missed in a row, per pool
        self._gone_at: dict[str, float] = {}
        self._next_restart: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self.restarts = 0  # restart attempts so far
        self.recovered: list[tuple[str, float]] = []  # (pool, seconds from gone to healthy), in order
        self._restarting: asyncio.Task[None] | None = None
        self.stopped = False
        orchestrator.listen(self._noticed)  # a call that found a stub dead counts as this watcher's own

    async def run(self) -> None:
        """Probe until cancelled."""
        interval = self.orchestrator.config.health.probe_interval_s
        while True:
            await self.probe_all()
            await asyncio.sleep(interval)

    def stop(self) -> None:
        """Start no probe or restart any more (the entry point is unloading)."""
        self.stopped = True

    async def probe_all(self) -> None:
        """One round: a probe of every pool not already being probed, then any restart that is due.

        The round waits for its probes at most one probe interval: a ping to a dead stub can hang for
        its whole timeout, and a restart found due meanwhile must not wait for it (the probe goes on,
        and the pool gets no other until it ends)."""
        if self.stopped:
            return
        pools = [p for p in self.orchestrator.health if p not in self._probing]
        probes = [asyncio.ensure_future(self._probe(pool)) for pool in pools]
        if probes:
            await asyncio.wait(probes, timeout=self.orchestrator.config.health.probe_interval_s)
        self._maybe_restart()

    async def _probe(self, pool: str) -> None:
        orchestrator = self.orchestrator
        health = orchestrator.health[pool]
        timeout = orchestrator.config.health.probe_timeout_s
        if self._stub_dead(pool):
            self._note(health.failed(DEAD))
            return
        self._probing.add(pool)
        try:
            # never ping a model Triton is unloading: on 2.51 a request reaching a stub in its
            # finalize can abort tritonserver (boost::interprocess::lock_exception)
            if not await self._ready(pool):
                self._miss(pool, NOT_READY)
                return
            started = self._clock()
            try:
                load = await asyncio.wait_for(orchestrator.pools.ping(pool), timeout)
            except (ServingError, TimeoutError):
                self._miss(pool, DEAD if await self._ready(pool) else NOT_READY)
                return
        finally:
            self._probing.discard(pool)
        self._missed[pool] = 0
        now = self._clock()
        self._note(health.probed(load, now - started))
        orchestrator.admission.observe(pool, load)
        orchestrator.observe_load(pool, load, now)  # the adaptive hot-group cap's measurement

    def _miss(self, pool: str, reason: str) -> None:
        missed = self._missed[pool] = self._missed.get(pool, 0) + 1
        if missed >= DEAD_AFTER:
            self._note(self.orchestrator.health[pool].failed(reason))

    def gone_for(self, pool: str) -> float | None:
        """Seconds since this watcher found ``pool`` dead, while it is; else None."""
        gone_at = self._gone_at.get(pool)
        return None if gone_at is None else self._clock() - gone_at

    async def _ready(self, pool: str) -> bool:
        if self._is_ready is None:
            return True
        try:
            return await self._is_ready(pool)
        except Exception:  # the server is going away: not ready
            return False

    def _note(self, change: Change | None) -> None:
        self.orchestrator.observe(change)  # which tells ``_noticed``

    def _noticed(self, change: Change) -> None:
        """Any state change of a pool, found by this watcher's probes or by a request's call."""
        now = self._clock()
        if change.new is PoolState.GONE:
            if change.reason == DEAD:
                self._gone(change.pool, now)
        elif change.old is PoolState.GONE:
            gone_at = self._gone_at.pop(change.pool, now)
            self._next_restart.pop(change.pool, None)
            self._backoff.pop(change.pool, None)
            self.recovered.append((change.pool, now - gone_at))
            log.warning("pool %s is back after %.1f s", change.pool, now - gone_at)
            if self._on_recovered is not None:
                self._on_recovered(change.pool, now - gone_at)

    def _gone(self, pool: str, now: float) -> None:
        # the first restart waits one probe round: a pool found gone by one slow answer that
        # answers the next probe is not restarted (a restart drops everything it was running)
        self._gone_at.setdefault(pool, now)
        interval = self.orchestrator.config.health.probe_interval_s
        self._next_restart.setdefault(pool, now + interval + self._delay)

    def _maybe_restart(self) -> None:
        """Start the next due restart; one at a time (model control calls are serialised)."""
        busy = self._restarting is not None and not self._restarting.done()
        if self.stopped or self.restart is None or busy:
            return
        now = self._clock()
        for pool, due in sorted(self._next_restart.items(), key=lambda item: item[1]):
            health = self.orchestrator.health[pool]
            if health.state is not PoolState.GONE or health.reason != DEAD or not self._restartable(pool):
                del self._next_restart[pool]  # it answered, is being unloaded, or is not ours to restart
                continue
            if due <= now and health.answered == 0:
                backoff = self._backoff.get(pool, self.orchestrator.config.health.recovery_backoff_s)
                self._next_restart[pool] = now + backoff
                self._backoff[pool] = min(backoff * 2, MAX_BACKOFF_S)
                self._restarting = asyncio.ensure_future(self._restart(pool))
                return

    async def _restart(self, pool: str) -> None:
        restart = self.restart
        if restart is None:
            return
        self.restarts += 1
        log.warning("restarting the %s pool (attempt %d)", pool, self.restarts)
        try:
            done = await restart(pool)
        except Exception:
            log.warning("restart of the %s pool failed", pool, exc_info=True)
            done = True  # it was attempted: a load that failed half-way may still have dropped work
        if done is not False and self._on_restart is not None:
            self._on_restart(pool)
