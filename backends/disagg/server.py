"""Run NVIDIA Triton Inference Server (2.51, from the `nvidia-pytriton` wheel) on a model repository.

Contract:

- `TritonServer(config, log_path).start()` launches `tritonserver` in its own process group with the
  command line and environment of `disagg.serverconfig`; `wait_ready` polls `/v2/health/ready` and the
  metrics endpoint until a deadline, failing fast with the log's error lines if the process exits; `stop`
  sends SIGTERM to the group, waits for the exit timeout plus a grace period, then SIGKILLs the group and
  removes the Python backend's shared memory left behind.

The foreground launcher that supervises a server (`disagg serve`: signals, restarts) is in `disagg_tools.cli`;
this module is the library it and the tests use.

The configuration names (`ServerConfig`, `server_config`, ...) are re-exported from `disagg.serverconfig`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from disagg import loanpath
from disagg.broker import Broker
from disagg.control import ModelControl
from disagg.kv.stale import DEFAULT_DIRECTORY as KV_DIRECTORY
from disagg.kv.stale import DEFAULT_PREFIX as KV_PREFIX
from disagg.kv.stale import clean_stale_regions
from disagg.launch import scrubber
from disagg.procfs import PROC, read_stat
from disagg.serverconfig import (
    ADMIN_HEADER,
    ENV_ADMIN_KEY,
    ENV_GRPC_PORT,
    ENV_HTTP_PORT,
    ENV_METRICS_ADDRESS,
    ENV_METRICS_PORT,
    GRPC_ADMIN_HEADER,
    RESTRICTED_APIS,
    SECRET_OPTIONS,
    ServerConfig,
    ServerError,
    build_command,
    build_environment,
    load_or_create_admin_key,
    redact,
    server_config,
)
from disagg.serving.routing import RoutingFile
from disagg.tritonbin import TritonFiles, locate_triton_files, prepare_backend_directory

log = logging.getLogger(__name__)

__all__ = [
    "ADMIN_HEADER",
    "ENV_ADMIN_KEY",
    "ENV_GRPC_PORT",
    "ENV_HTTP_PORT",
    "ENV_METRICS_ADDRESS",
    "ENV_METRICS_PORT",
    "GRPC_ADMIN_HEADER",
    "KILL_GRACE_S",
    "RESTRICTED_APIS",
    "ServerConfig",
    "ServerError",
    "ServerTimeout",
    "TritonServer",
    "build_command",
    "build_environment",
    "load_or_create_admin_key",
    "process_group_members",
    "redact",
    "remove_shm_regions",
    "server_config",
]

KILL_GRACE_S = 15.0
"""After the exit timeout, how long `stop` waits for model finalizers before SIGKILL."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a server: `signal` marks it draining before it sends one."""

_TRITON_ERROR_RE = re.compile(r"E\d{4} ")  # glog: severity letter, then MMDD
_BENIGN = "CudaDriverHelper has not been initialized"  # logged by every CPU-only start


class ServerTimeout(ServerError, TimeoutError):
    """The server did not exit in time. Unlike `subprocess.TimeoutExpired`, it never carries the argv
    (which holds the admin key)."""


def process_group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid`, read from /proc."""
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_stat(entry.name)
        if stat is not None and stat.pgrp == pgid and not stat.exited:
            members.append(int(entry.name))
    return members


def remove_shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the Python backend's shared-memory regions named `prefix*`; returns the names removed.

    Triton removes them on a clean exit; after a crash or SIGKILL they would stay behind. Only call this
    when no process of that server is left. The prefix is random per `ServerConfig`.
    """
    removed = []
    for entry in shm_dir.glob(f"{prefix}*"):
        try:
            entry.unlink()
            removed.append(entry.name)
        except FileNotFoundError:
            pass
    return removed


def _pinning(cpus: tuple[int, ...]) -> Callable[[], None] | None:
    """A pre-exec step pinning the child to `cpus` (one system call: safe between fork and exec)."""
    if not cpus:
        return None
    chosen = set(cpus)

    def pin() -> None:
        os.sched_setaffinity(0, chosen)

    return pin


def answers_200(url: str, timeout_s: float = 1.0) -> bool:
    """True when a GET of `url` answers 200; False when it answers otherwise or nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class TritonServer:
    """A `tritonserver` process started from a `ServerConfig`, in its own process group."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None) -> None:
        """`log_path`: file receiving the server's stdout and stderr; None inherits this process's."""
        self.config = config
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._broker: Broker | None = None
        self._control = ModelControl(config.http_url)  # the files beside its model-control journal

    @property
    def pid(self) -> int:
        """Process id (also the process group id) of the running server."""
        if self._process is None:
            raise ServerError("server not started")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once exited (negative: killed by that signal), else None. Seen exited, the
        server's model-control broker is stopped too."""
        status = None if self._process is None else self._process.poll()
        if status is not None:
            self._exited()
        return status

    def start(self, files: TritonFiles | None = None) -> TritonServer:
        """Prepare the backend directory and launch the server; returns at once (see `wait_ready`)."""
        if self._process is not None:
            raise ServerError("server already started")
        if not self.config.model_repository.is_dir():
            raise ServerError("model repository not found")
        files = files or locate_triton_files()
        prepare_backend_directory(self.config.backend_directory, files)
        # a new server loads the versions its repository names: an earlier one's rollout routing
        # (disagg.serving.routing) on this address would pin requests to versions not loaded
        RoutingFile(self._control.routing_path).clear()
        self._control.draining_path.unlink(missing_ok=True)  # an earlier server's stop on this address
        output = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            # the admin key in its argv is masked before its main runs: `ps` never shows it
            env = scrubber.environment(
                build_environment(files, model_dir=self.config.model_dir, http_url=self.config.http_url),
                SECRET_OPTIONS,
            )
        except scrubber.ScrubberError as exc:
            if output is not None:
                output.close()
            raise ServerError(str(exc)) from exc
        try:
            self._process = subprocess.Popen(
                build_command(self.config, files),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                # a process group of its own (stopped with killpg) in the caller's session: a new
                # session is a new scheduler autogroup (sched_autogroup_enabled, on by default), and
                # the kernel then shares the cores between groups, not tasks: a client beside the
                # server (a benchmark, a test, a co-located front end) waited up to 0.3-0.9 s to run
                # under load while its cores had idle time (docs/degradation.md, "Measuring on one
                # machine")
                process_group=0,
                preexec_fn=_pinning(self.config.cpus),
            )
        except subprocess.SubprocessError as exc:  # the child could not pin itself: cpus not available
            raise ServerError(
                f"could not start tritonserver on cpus {list(self.config.cpus)} ({exc})"
            ) from None
        except OSError as exc:
            raise ServerError(f"could not execute tritonserver ({type(exc).__name__})") from None
        finally:
            if output is not None:
                output.close()
        try:  # the one holder of the admin key that rollouts and the actuator ask (disagg.broker)
            self._broker = Broker(self.config.http_url, self.config.admin_key).start()
        except OSError as exc:
            log.warning("no model-control broker for this server (%s): rollouts need one", exc)
        return self

    def is_ready(self) -> bool:
        """True when `/v2/health/ready` answers 200 (all models loaded, given strict readiness) and the
        metrics endpoint answers too.

        Triton opens its endpoints one after another once the models are loaded, the metrics service
        last (tens of milliseconds after HTTP), so HTTP readiness alone does not mean a scrape works.
        """
        return answers_200(f"http://{self.config.http_url}/v2/health/ready") and answers_200(
            self.config.metrics_url
        )

    def log_tail(self, max_lines: int = 40) -> str:
        """The last lines of the server log (admin key redacted); empty when logging to the terminal."""
        return "\n".join(self._log_lines()[-max_lines:])

    def log_errors(self, max_lines: int = 10) -> str:
        """The last error lines of the server log (e.g. why a model failed to load), admin key redacted."""
        errors = [line for line in self._log_lines() if _TRITON_ERROR_RE.match(line) and _BENIGN not in line]
        return "\n".join(errors[-max_lines:])

    def _log_lines(self) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return redact(text, self.config.admin_key).splitlines()

    def _failure(self, what: str) -> ServerError:
        return ServerError(f"{what}\nerrors:\n{self.log_errors()}\nlog tail:\n{self.log_tail(15)}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll readiness until `timeout_s`. Raises `ServerError` (with the log tail) if the server exits
        first or the deadline passes; in the latter case the server is stopped."""
        process = self._process
        if process is None:
            raise ServerError("server not started")
        deadline = time.monotonic() + timeout_s
        while True:
            if self.is_ready():
                return
            if process.poll() is not None:
                raise self._failure(f"tritonserver exited with {process.returncode}")
            if time.monotonic() >= deadline:
                self.stop()
                raise self._failure(f"tritonserver not ready after {timeout_s:.0f} s")
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)

    def signal(self, signum: int) -> None:
        """Send `signum` to the server's process group (no-op once it has exited). A stop signal
        (SIGINT, SIGTERM, SIGHUP) first marks the server draining, so that its entry points refuse
        the requests that arrive from then on (``ModelControl.draining_path``)."""
        if self._process is None or self._process.poll() is not None:
            return
        if signum in STOP_SIGNALS:
            self._control.draining_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._control.draining_path.touch()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for exit and return the status; raises `ServerTimeout` after `timeout_s`."""
        if self._process is None:
            raise ServerError("server not started")
        try:
            status = self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ServerTimeout(f"tritonserver still running after {timeout_s} s") from None
        self._exited()
        return status

    def _exited(self) -> None:
        """The server is gone: its broker stops, and its draining mark goes."""
        self._retire_broker()
        self._control.draining_path.unlink(missing_ok=True)

    def _retire_broker(self) -> None:
        """The server is gone or going: nothing is left for its broker to control."""
        if self._broker is not None:
            self._broker.stop()
            self._broker = None

    def stop(self, grace_s: float = KILL_GRACE_S) -> int:
        """SIGTERM the process group, wait up to the exit timeout plus `grace_s`, then SIGKILL the group.

        Returns the exit status (0 for a clean shutdown, negative if it had to be killed). Idempotent.
        """
        if self._process is None:
            raise ServerError("server not started")
        self._retire_broker()
        if self._process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=self.config.exit_timeout_s + grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self._process.wait()
        # Children outliving the server (e.g. a wedged stub) share its process group.
        self.signal_group_members(signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # orphaned stubs are reaped by init, not by us: nothing to wait on
        if not self._group_alive():
            remove_shm_regions(self.config.shm_prefix)
            # KV regions of pool processes that died without closing them (kill -9, a crash); a live
            # owner's regions, another server's included, are left alone
            clean_stale_regions(KV_DIRECTORY, KV_PREFIX)
            loanpath.sweep(KV_PREFIX, self.config.http_url)  # core loans of pools that never closed
        self._exited()  # the SIGTERM above marked it draining
        return self._process.returncode

    def signal_group_members(self, signum: int) -> None:
        """Send `signum` to whatever remains of the server's process group, even after the server exited."""
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signum)

    def _group_alive(self) -> bool:
        return bool(process_group_members(self.pid))

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self.stop()
