"""The one owner of model control for a Triton server, shared by every process of one host.

Three kinds of caller change which model instances a server runs: each entry point's pool watcher
(restarting a dead pool: an unload, then a load), the autoscaler's ``triton`` actuator (a load whose
config override changes a pool's instance count) and an operator. Triton orders none of them, so
two watchers that both saw a pool die could restart it twice (the second killing the first's new
instance), and an actuator's load could land in the middle of a restart.

``ModelControl`` serialises them with an advisory lock (``flock``) on one file per server, in this
project's state folder (``$XDG_STATE_HOME/triton-disagg/control``): the kernel drops the lock when its
holder dies, so a crashed caller never leaves it held. Beside the lock, a small journal (JSON,
replaced atomically) says when each model was last restarted, so a watcher that waited for the lock
sees that the pool it found dead has been restarted since, and leaves it alone. Callers on other hosts
(a Kubernetes actuator) do not call model control and need no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from disagg.kv.secret import default_secret_path
from disagg.statefile import read_json_object, write_private

WAIT_STEP_S = 0.05
PYTHON_BASED_RUNTIME = "model.py"


class ControlBusy(TimeoutError):
    """Another caller held model control for longer than this one would wait."""


def default_control_dir() -> Path:
    """``$XDG_STATE_HOME/triton-disagg/control`` (``~/.local/state`` when unset)."""
    return default_secret_path().parent / "control"


def server_key(url: str) -> str:
    """A file-name-safe key for the server at ``url`` (``host:port``, with or without ``http://``)."""
    bare = re.sub(r"^[a-z]+://", "", url.strip()).rstrip("/")
    if not bare:
        raise ValueError("model control needs the server's HTTP address")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", bare)


def loadable_config(live: dict[str, Any]) -> dict[str, Any]:
    """A model's live config (``GET /v2/models/<name>/config``) as a load's config override.

    ``runtime: "model.py"`` is left out: Triton fills it in when it creates a model of a Python-based
    backend, so the live config carries it while the config the model was loaded from does not; posted
    back, that one field makes Triton 2.51 (``ConfigChangeRequiresReload``, which ignores only
    ``instance_group`` and ``version_policy``) reload the whole model instead of updating its instance
    count in place. Left out, Triton fills it in again."""
    config = dict(live)
    if config.get("runtime") == PYTHON_BASED_RUNTIME:
        del config["runtime"]
    return config


class ModelControl:
    def __init__(self, server_url: str, directory: Path | None = None, timeout_s: float = 120.0) -> None:
        if not 0 < timeout_s <= 3600:
            raise ValueError("ModelControl.timeout_s must be in (0, 3600]")
        folder = directory if directory is not None else default_control_dir()
        key = server_key(server_url)
        self.lock_path = folder / f"{key}.lock"
        self.journal_path = folder / f"{key}.json"
        # which pool versions new requests take (disagg.serving.routing), written by rollouts
        self.routing_path = folder / f"{key}.routing.json"
        # present from the launcher's stop signal on: the entry points refuse new requests (Triton 2.51
        # still schedules inferences while it exits, until each model is unloaded)
        self.draining_path = folder / f"{key}.draining"
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def owner(self) -> Iterator[ModelControl]:
        """Hold model control of this server; ControlBusy after ``timeout_s`` of waiting for it."""
        self.lock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ControlBusy(f"model control busy for {self.timeout_s:g} s") from None
                    time.sleep(WAIT_STEP_S)  # flock has no timeout: poll it, bounded by the deadline
            try:
                yield self
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def restart_once(self, model: str, found_dead_at: float, restart: Callable[[], bool]) -> bool:
        """As the owner, call ``restart()`` for ``model``, found dead at ``found_dead_at`` (wall
        clock), unless someone restarted it since; a restart that reports True is recorded.
        True when this call restarted it."""
        with self.owner():
            done = self.last_restart(model)
            if done is not None and done >= found_dead_at:
                return False  # another watcher got there first: its new instance is not touched
            if not restart():
                return False
            self.record_restart(model)
            return True

    def last_restart(self, model: str) -> float | None:
        """Wall-clock time of ``model``'s last recorded restart, or None."""
        value = self._journal().get(model, {}).get("restarted_at")
        return float(value) if isinstance(value, int | float) else None

    def record_restart(self, model: str, at: float | None = None) -> None:
        """Note a restart of ``model`` (call while holding ``owner``)."""
        journal = self._journal()
        journal[model] = {**journal.get(model, {}), "restarted_at": time.time() if at is None else at}
        write_private(self.journal_path, json.dumps(journal, sort_keys=True))

    def _journal(self) -> dict[str, dict[str, float]]:
        return read_json_object(self.journal_path)  # none yet, or unreadable: no past restarts known
