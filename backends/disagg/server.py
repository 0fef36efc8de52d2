"""Run NVIDIA Triton Inference Server (2.51, from the `nvidia-pytriton` wheel) on a model repository.

Contract:

- `ServerConfig` is the one frozen, validated description of a server: repository, backend directory,
  ports and bind addresses, the admin key guarding the restricted APIs, exit timeout, log verbosity and
  extra flags. `server_config(...)` builds it from the environment (`HTTP_PORT`, `GRPC_PORT`,
  `METRICS_PORT`, `METRICS_ADDRESS`, `DISAGG_ADMIN_KEY`) plus explicit values.
- `build_command` / `build_environment` are pure: the exact `tritonserver` argv and environment.
- `TritonServer.start` launches it in its own process group and `wait_ready` polls `/v2/health/ready`
  until a deadline, failing fast with the log tail if the process exits; `stop` sends SIGTERM to the
  group, waits for the exit timeout plus a grace period, then SIGKILLs the group.
- `serve_main(argv)` runs a server in the foreground until SIGINT/SIGTERM/SIGHUP.

Secure defaults (RELIABILITY.md G1): strict readiness, exit on initialization error, explicit model
control, the model-repository, shared-memory, trace and logging APIs answer only requests carrying the
admin key header on both HTTP and gRPC, GPU metrics off. The key never appears in `repr`, errors or logs
written by this module; note that Triton only takes it on its command line, so local users who can read
`/proc/<pid>/cmdline` can see it.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from disagg.tritonbin import TritonFiles, locate_triton_files, prepare_backend_directory

ENV_HTTP_PORT = "HTTP_PORT"
ENV_GRPC_PORT = "GRPC_PORT"
ENV_METRICS_PORT = "METRICS_PORT"
ENV_METRICS_ADDRESS = "METRICS_ADDRESS"
ENV_ADMIN_KEY = "DISAGG_ADMIN_KEY"

ADMIN_HEADER = "disagg-admin-key"
"""HTTP header that must carry the admin key for the restricted APIs."""
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
"""gRPC metadata key for the same: Triton 2.51 prefixes the configured key with `triton-grpc-protocol-`."""
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
"""Control-plane APIs behind the admin key: load/unload, client shared memory, and the two that make the
server write files or change its logging."""

STATE_DIR = Path(".triton")
ADMIN_KEY_FILE = "admin-key"
DEFAULT_REPOSITORY = Path("model_repository")
DEFAULT_EXIT_TIMEOUT_S = 15
"""Long enough to drain a typical stream on SIGTERM; short enough to fit Kubernetes' default 30 s grace."""
KILL_GRACE_S = 15.0
"""After the exit timeout, how long `stop` waits for model finalizers before SIGKILL."""

_KEY_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_]{8,40}")
_TRITON_ERROR_RE = re.compile(r"E\d{4} ")  # glog: severity letter, then MMDD
_BENIGN = "CudaDriverHelper has not been initialized"  # logged by every CPU-only start
_MANAGED_FLAGS = (
    "--model-repository",
    "--backend-directory",
    "--http-port",
    "--grpc-port",
    "--metrics-port",
    "--http-address",
    "--grpc-address",
    "--metrics-address",
    "--model-control-mode",
    "--load-model",
    "--strict-readiness",
    "--exit-on-error",
    "--exit-timeout-secs",
    "--http-restricted-api",
    "--grpc-restricted-protocol",
    "--log-verbose",
)


class ServerError(RuntimeError):
    """The server could not be configured, started or stopped."""


class ServerTimeout(ServerError, TimeoutError):
    """The server did not exit in time. Unlike `subprocess.TimeoutExpired`, it never carries the argv
    (which holds the admin key)."""


def _new_shm_prefix() -> str:
    return f"disagg_{uuid.uuid4().hex[:12]}_"


def _check_port(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{name} must be an integer port in 1..65535")


def _check_address(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be an IP address")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{name} must be an IP address") from None


@dataclass(frozen=True)
class ServerConfig:
    """Everything that determines how `tritonserver` is launched. Invalid values raise `ValueError`."""

    model_repository: Path
    backend_directory: Path
    admin_key: str = field(repr=False)
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "0.0.0.0"
    metrics_address: str = "0.0.0.0"
    exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S
    log_verbose: int = 0
    shm_prefix: str = field(default_factory=_new_shm_prefix)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("model_repository", "backend_directory"):
            value = getattr(self, name)
            if not isinstance(value, Path) or not value.is_absolute():
                raise ValueError(f"{name} must be an absolute path")
        if not isinstance(self.admin_key, str) or not _KEY_RE.fullmatch(self.admin_key):
            raise ValueError("admin_key must be 16-256 characters of [A-Za-z0-9_-]")
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        for name, value in zip(("http_port", "grpc_port", "metrics_port"), ports, strict=True):
            _check_port(name, value)
        if len(set(ports)) != 3:
            raise ValueError("http_port, grpc_port and metrics_port must differ")
        _check_address("address", self.address)
        _check_address("metrics_address", self.metrics_address)
        timeout = self.exit_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= 3600:
            raise ValueError("exit_timeout_s must be an integer in 1..3600")
        verbose = self.log_verbose
        if isinstance(verbose, bool) or not isinstance(verbose, int) or not 0 <= verbose <= 3:
            raise ValueError("log_verbose must be an integer in 0..3")
        if not isinstance(self.shm_prefix, str) or not _PREFIX_RE.fullmatch(self.shm_prefix):
            raise ValueError("shm_prefix must be 8-40 characters of [A-Za-z0-9_]")
        if not isinstance(self.extra_args, tuple):
            raise ValueError("extra_args must be a tuple of strings")
        for arg in self.extra_args:
            if not isinstance(arg, str) or not arg.startswith("--"):
                raise ValueError("extra_args must be '--flag=value' strings")
            flag = arg.split("=", 1)[0]
            if flag in _MANAGED_FLAGS:
                raise ValueError(f"extra_args must not set {flag}: it is a ServerConfig field")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerConfig:
        """Build from a mapping (e.g. parsed YAML). Unknown keys are errors; paths may be strings."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown server config keys: {', '.join(unknown)}")
        kwargs = dict(values)
        for name in ("model_repository", "backend_directory"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = Path(kwargs[name])
        if isinstance(kwargs.get("extra_args"), list):
            kwargs["extra_args"] = tuple(kwargs["extra_args"])
        return cls(**kwargs)

    def client_host(self, address: str) -> str:
        """Where a local client reaches a server bound to `address` (wildcards mean loopback)."""
        if address == "0.0.0.0":
            return "127.0.0.1"
        if address == "::":
            return "[::1]"
        return f"[{address}]" if ":" in address else address

    @property
    def http_url(self) -> str:
        """`host:port` of the HTTP endpoint, for `tritonclient.http`."""
        return f"{self.client_host(self.address)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` of the gRPC endpoint, for `tritonclient.grpc`."""
        return f"{self.client_host(self.address)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus endpoint."""
        return f"http://{self.client_host(self.metrics_address)}:{self.metrics_port}/metrics"

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """Headers for a `tritonclient` call of a restricted API over `protocol` ("http" or "grpc")."""
        if protocol == "http":
            return {ADMIN_HEADER: self.admin_key}
        if protocol == "grpc":
            return {GRPC_ADMIN_HEADER: self.admin_key}
        raise ValueError("protocol must be 'http' or 'grpc'")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw, 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer") from None


def load_or_create_admin_key(state_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """The admin key: `DISAGG_ADMIN_KEY` if set, else `<state_dir>/admin-key`, created (mode 0600) if absent.

    Refuses a key file that other users can read or write.
    """
    env = os.environ if env is None else env
    given = env.get(ENV_ADMIN_KEY)
    if given:
        if not _KEY_RE.fullmatch(given):
            raise ValueError(f"{ENV_ADMIN_KEY} must be 16-256 characters of [A-Za-z0-9_-]")
        return given
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_dir / ADMIN_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        info = path.stat()
        if stat.S_IMODE(info.st_mode) & 0o077 or info.st_uid != os.getuid():
            raise ServerError("admin key file must be owned by this user with mode 0600") from None
        key = path.read_text(encoding="ascii").strip()
        if not _KEY_RE.fullmatch(key):
            raise ServerError("admin key file is malformed; delete it to generate a new key") from None
        return key
    key = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key + "\n")
    return key


def server_config(
    model_repository: Path,
    *,
    state_dir: Path = STATE_DIR,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Config for `model_repository` with ports/addresses/key from `env` (default: `os.environ`).

    The backend directory defaults to `<state_dir>/backends`; `overrides` are `ServerConfig` fields and
    win over the environment.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {
        "model_repository": Path(model_repository).resolve(),
        "backend_directory": (state_dir / "backends").resolve(),
        "http_port": _env_int(env, ENV_HTTP_PORT, 8000),
        "grpc_port": _env_int(env, ENV_GRPC_PORT, 8001),
        "metrics_port": _env_int(env, ENV_METRICS_PORT, 8002),
    }
    if env.get(ENV_METRICS_ADDRESS):
        values["metrics_address"] = env[ENV_METRICS_ADDRESS]
    values.update(overrides)
    if "admin_key" not in values:
        values["admin_key"] = load_or_create_admin_key(state_dir, env)
    return ServerConfig.from_mapping(values)


def build_command(config: ServerConfig, files: TritonFiles) -> list[str]:
    """The `tritonserver` argv for `config` (it contains the admin key: never log it unredacted)."""
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={config.admin_key}"
    return [
        str(files.server),
        f"--model-repository={config.model_repository}",
        f"--backend-directory={config.backend_directory}",
        f"--backend-config=python,shm-region-prefix-name={config.shm_prefix}",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--strict-readiness=true",
        "--exit-on-error=true",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        f"--http-address={config.address}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        f"--metrics-address={config.metrics_address}",
        f"--metrics-port={config.metrics_port}",
        f"--log-verbose={config.log_verbose}",
        *config.extra_args,
    ]


def build_environment(files: TritonFiles, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for `tritonserver`: this interpreter's `bin/` first on PATH (the Python backend stub
    runs models with the first `python` there), the wheel's libraries on LD_LIBRARY_PATH, and the admin
    key variable removed so that model processes never inherit it."""
    env = dict(os.environ if base is None else base)
    env.pop(ENV_ADMIN_KEY, None)
    bin_dir = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(files.lib_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env


def process_group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid`, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        state, _ppid, pgrp = stat_line.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
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


def redact(text: str, secret: str) -> str:
    """`text` with every occurrence of `secret` replaced."""
    return text.replace(secret, "<redacted>") if secret else text


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
                env=build_environment(files),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                start_new_session=True,
            )
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
    args = parser.parse_args(argv)
    try:
        config = server_config(
            args.model_repository,
            exit_timeout_s=args.exit_timeout,
            log_verbose=args.log_verbose,
            address=args.address,
        )
        server = TritonServer(config).start()
    except (ValueError, ServerError, OSError) as exc:
        print(f"disagg serve: {redact(str(exc), os.environ.get(ENV_ADMIN_KEY, ''))}", file=sys.stderr)
        return 2
    print(
        f"disagg serve: HTTP {config.http_url}, gRPC {config.grpc_url}, metrics {config.metrics_url}; "
        f"admin APIs need header {ADMIN_HEADER!r} (key in {STATE_DIR / ADMIN_KEY_FILE} or ${ENV_ADMIN_KEY})",
        file=sys.stderr,
        flush=True,
    )
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        server.signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    deadline: float | None = None
    try:
        while True:
            if stopping and deadline is None:
                deadline = time.monotonic() + config.exit_timeout_s + KILL_GRACE_S
            try:
                status = server.wait(0.5)
                break
            except ServerTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    server.signal(signal.SIGKILL)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    server.stop(grace_s=5)  # already exited: only kills leftover stubs and removes their shared memory
    return 128 - status if status < 0 else status
