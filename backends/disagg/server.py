"""Run NVIDIA Triton Inference Server (2.51, from the `nvidia-pytriton` wheel) on a model repository.

Contract:

- `TritonServer(config, log_path).start()` launches `tritonserver` in its own process group with the
  command line and environment of `disagg.serverconfig`; `wait_ready` polls `/v2/health/ready` until a
  deadline, failing fast with the log's error lines if the process exits; `stop` sends SIGTERM to the
  group, waits for the exit timeout plus a grace period, then SIGKILLs the group and removes the Python
  backend's shared memory left behind.
- `serve_main(argv)` runs a server in the foreground until SIGINT/SIGTERM/SIGHUP (`disagg serve`), and
  starts it again if it dies on its own after it was ready (`disagg.restart`).

The configuration names (`ServerConfig`, `server_config`, ...) are re-exported from `disagg.serverconfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from disagg.procfs import PROC, read_stat
from disagg.regions import DEFAULT_DIRECTORY as KV_DIRECTORY
from disagg.regions import DEFAULT_PREFIX as KV_PREFIX
from disagg.regions import clean_stale_regions
from disagg.restart import RestartPolicy
from disagg.serverconfig import (
    ADMIN_HEADER,
    ADMIN_KEY_FILE,
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_REPOSITORY,
    ENV_ADMIN_KEY,
    ENV_GRPC_PORT,
    ENV_HTTP_PORT,
    ENV_METRICS_ADDRESS,
    ENV_METRICS_PORT,
    GRPC_ADMIN_HEADER,
    RESTRICTED_APIS,
    STATE_DIR,
    ServerConfig,
    ServerError,
    build_command,
    build_environment,
    load_or_create_admin_key,
    parse_cpus,
    redact,
    server_config,
)
from disagg.tritonbin import TritonFiles, locate_triton_files, prepare_backend_directory

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
    "serve_main",
    "server_config",
]

KILL_GRACE_S = 15.0
"""After the exit timeout, how long `stop` waits for model finalizers before SIGKILL."""

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


class TritonServer:
    """A `tritonserver` process started from a `ServerConfig`, in its own process group."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None) -> None:
        """`log_path`: file receiving the server's stdout and stderr; None inherits this process's."""
        self.config = config
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """Process id (also the process group id) of the running server."""
        if self._process is None:
            raise ServerError("server not started")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once exited (negative: killed by that signal), else None."""
        return None if self._process is None else self._process.poll()

    def start(self, files: TritonFiles | None = None) -> TritonServer:
        """Prepare the backend directory and launch the server; returns at once (see `wait_ready`)."""
        if self._process is not None:
            raise ServerError("server already started")
        if not self.config.model_repository.is_dir():
            raise ServerError("model repository not found")
        files = files or locate_triton_files()
        prepare_backend_directory(self.config.backend_directory, files)
        output = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._process = subprocess.Popen(
                build_command(self.config, files),
                env=build_environment(files, model_dir=self.config.model_dir),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                start_new_session=True,
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
        return self

    def is_ready(self) -> bool:
        """True when `/v2/health/ready` answers 200 (all models loaded, given strict readiness)."""
        url = f"http://{self.config.http_url}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

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
        """Send `signum` to the server's process group (no-op once it has exited)."""
        if self._process is None or self._process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signum)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for exit and return the status; raises `ServerTimeout` after `timeout_s`."""
        if self._process is None:
            raise ServerError("server not started")
        try:
            return self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ServerTimeout(f"tritonserver still running after {timeout_s} s") from None

    def stop(self, grace_s: float = KILL_GRACE_S) -> int:
        """SIGTERM the process group, wait up to the exit timeout plus `grace_s`, then SIGKILL the group.

        Returns the exit status (0 for a clean shutdown, negative if it had to be killed). Idempotent.
        """
        if self._process is None:
            raise ServerError("server not started")
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


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Run Triton in the foreground on a model repository until SIGINT, SIGTERM or SIGHUP.

    The signal is forwarded to the server's process group; Triton drains in-flight requests up to the
    exit timeout. Returns the server's exit status (128 + signal number if it had to be killed).
    """
    parser = argparse.ArgumentParser(prog="disagg serve", description=serve_main.__doc__)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--exit-timeout", type=int, default=DEFAULT_EXIT_TIMEOUT_S, metavar="SECONDS")
    parser.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL")
    parser.add_argument("--address", default="0.0.0.0", help="bind address of HTTP and gRPC")
    parser.add_argument(
        "--cpus",
        default="",
        help="pin tritonserver's own threads, e.g. '0' to keep them off a decode core (pools and "
        "orchestrators still pin themselves to their `cores`); default: unpinned",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart tritonserver when it dies on its own after it was ready, at most N times in 10 "
        "minutes (0: never); see disagg.restart for why",
    )
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    policy = RestartPolicy(max_restarts=args.max_restarts)
    stopping: list[int] = []
    holder: list[TritonServer] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for server in holder:
            server.signal(signum)

    def fail(exc: Exception) -> int:
        print(f"disagg serve: {redact(str(exc), os.environ.get(ENV_ADMIN_KEY, ''))}", file=sys.stderr)
        return 2

    # Installed before the start, so that no signal can leave an orphaned server behind.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            config = server_config(
                args.model_repository,
                exit_timeout_s=args.exit_timeout,
                log_verbose=args.log_verbose,
                address=args.address,
                cpus=parse_cpus(args.cpus),
            )
        except (ValueError, ServerError, OSError) as exc:
            return fail(exc)
        print(
            f"disagg serve: HTTP {config.http_url}, gRPC {config.grpc_url}, metrics {config.metrics_url}; "
            f"admin APIs need header {ADMIN_HEADER!r} (key in {STATE_DIR / ADMIN_KEY_FILE} or "
            f"${ENV_ADMIN_KEY})",
            file=sys.stderr,
            flush=True,
        )
        while True:
            server = TritonServer(config)
            holder[:] = [server]
            try:
                server.start()
            except (ValueError, ServerError, OSError) as exc:
                return fail(exc)
            if stopping:
                server.signal(stopping[0])
            status, was_ready = _supervise(server, stopping)
            clean = bool(stopping) or status == 0
            if not policy.should_restart(now=time.monotonic(), was_ready=was_ready, stopping=clean):
                break
            print(
                f"disagg serve: tritonserver exited with {_describe(status)} while serving; restarting it "
                f"({policy.recent} of at most {policy.max_restarts} restarts in {policy.window_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            server.stop(grace_s=5)  # its stubs and shared memory, before the next one starts
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    server.stop(grace_s=5)  # already exited: only kills leftover stubs and removes their shared memory
    return 128 - status if status < 0 else status


def _describe(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
    return f"status {status}"


def _supervise(server: TritonServer, stopping: list[int]) -> tuple[int, bool]:
    """Wait for the server to exit; announce readiness once; after a stop signal, SIGKILL the group if it
    outlives the exit timeout plus `KILL_GRACE_S`. Returns the exit status and whether it was ready."""
    deadline: float | None = None
    announced = False
    while True:
        if stopping and deadline is None:
            deadline = time.monotonic() + server.config.exit_timeout_s + KILL_GRACE_S
        try:
            return server.wait(0.5), announced
        except ServerTimeout:
            if deadline is not None and time.monotonic() >= deadline:
                server.signal(signal.SIGKILL)
        if not announced and not stopping and server.is_ready():
            announced = True
            print("disagg serve: ready", file=sys.stderr, flush=True)
