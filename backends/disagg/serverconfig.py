"""Configuration of a Triton server: `ServerConfig`, the admin key, the exact command line and environment.

- `ServerConfig` is the one frozen, validated description of a server: repository, backend directory,
  ports and bind addresses, the admin key guarding the restricted APIs, exit timeout, log verbosity, the
  Python backend's shared-memory prefix and extra flags. Unknown keys and invalid values raise
  `ValueError`; the key never appears in `repr` or in error messages.
- `server_config(...)` builds it from the environment (`HTTP_PORT`, `GRPC_PORT`, `METRICS_PORT`,
  `METRICS_ADDRESS`, `DISAGG_ADMIN_KEY`) plus explicit values.
- `build_command` / `build_environment` are pure: the `tritonserver` argv and environment.

Secure defaults (RELIABILITY.md G1): strict readiness, exit on initialization error, explicit model
control, the model-repository, shared-memory, trace and logging APIs answer only requests carrying the
admin key header on both HTTP and gRPC, GPU metrics off. Triton takes the key only on its command line, so
local users who can read `/proc/<pid>/cmdline` can see it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import stat
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from disagg.tls import GrpcTls
from disagg.tritonbin import TritonFiles

LOOPBACK = "127.0.0.1"
"""Every port is bound here unless an address is given: exposing a server is a decision."""
ENV_HTTP_PORT = "HTTP_PORT"
ENV_GRPC_PORT = "GRPC_PORT"
ENV_METRICS_PORT = "METRICS_PORT"
ENV_METRICS_ADDRESS = "METRICS_ADDRESS"
ENV_ADMIN_KEY = "DISAGG_ADMIN_KEY"
ENV_API_KEY = "DISAGG_API_KEY"  # disagg.openai.auth's: dropped from tritonserver's environment
ENV_SERVER_HTTP = "DISAGG_SERVER_HTTP"
"""Set for the server's processes: host:port of its own HTTP endpoint (the orchestrators read model
readiness there, see ``disagg.triton.readiness``)."""

MODEL_LOAD_THREADS = 16  # models Triton loads at once (more than a repository of this project holds)
ADMIN_HEADER = "disagg-admin-key"
"""HTTP header that must carry the admin key for the restricted APIs."""
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
"""gRPC metadata key for the same: Triton 2.51 prefixes the configured key with `triton-grpc-protocol-`."""
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
"""Control-plane APIs behind the admin key: load/unload, client shared memory, and the two that make the
server write files or change its logging."""
SECRET_OPTIONS = ("--http-restricted-api=", "--grpc-restricted-protocol=")
"""The options of tritonserver's argv that carry the admin key: masked in its /proc/PID/cmdline before
its main runs (disagg.launch.scrubber)."""

STATE_DIR = Path(".triton")
ADMIN_KEY_FILE = "admin-key"
DEFAULT_REPOSITORY = Path("model_repository")
DEFAULT_EXIT_TIMEOUT_S = 15
"""Long enough to drain a typical stream on SIGTERM; short enough to fit Kubernetes' default 30 s grace."""
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_]{8,40}")
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
    address: str = LOOPBACK
    """gRPC's bind address, and HTTP's and the metrics' unless they are given: loopback unless asked."""
    http_address: str = ""
    metrics_address: str = ""
    exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S
    log_verbose: int = 0
    shm_prefix: str = field(default_factory=_new_shm_prefix)
    extra_args: tuple[str, ...] = ()
    # CPUs of tritonserver's own threads (HTTP, gRPC, ensemble scheduling); empty: unpinned. Its
    # stubs start there too; the pools and orchestrators then pin themselves to their `cores`.
    cpus: tuple[int, ...] = ()
    # The checkpoint the models load (their MODEL_DIR); None: the launching environment's, if any.
    model_dir: Path | None = None
    # A folder of ca.pem, cert.pem and key.pem (disagg.tls): gRPC over mutual TLS; None: plain gRPC.
    grpc_tls: Path | None = None

    def __post_init__(self) -> None:
        for name in ("model_repository", "backend_directory"):
            value = getattr(self, name)
            if not isinstance(value, Path) or not value.is_absolute():
                raise ValueError(f"{name} must be an absolute path")
        if self.model_dir is not None and (
            not isinstance(self.model_dir, Path) or not self.model_dir.is_absolute()
        ):
            raise ValueError("model_dir must be an absolute path or None")
        if self.grpc_tls is not None:
            GrpcTls(self.grpc_tls)  # ValueError naming a missing file
        if not isinstance(self.admin_key, str) or not _KEY_RE.fullmatch(self.admin_key):
            raise ValueError("admin_key must be 16-256 characters of [A-Za-z0-9_-]")
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        for name, value in zip(("http_port", "grpc_port", "metrics_port"), ports, strict=True):
            _check_port(name, value)
        if len(set(ports)) != 3:
            raise ValueError("http_port, grpc_port and metrics_port must differ")
        _check_address("address", self.address)
        for name in ("http_address", "metrics_address"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, self.address)  # frozen: set once, while built
        _check_address("http_address", self.http_address)
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
        if not isinstance(self.cpus, tuple) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.cpus
        ):
            raise ValueError("cpus must be a tuple of CPU numbers")
        if len(set(self.cpus)) != len(self.cpus):
            raise ValueError("cpus must not repeat a CPU")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerConfig:
        """Build from a mapping (e.g. parsed YAML). Unknown keys are errors; paths may be strings."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown server config keys: {', '.join(unknown)}")
        kwargs = dict(values)
        for name in ("model_repository", "backend_directory", "model_dir", "grpc_tls"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = Path(kwargs[name])
        if isinstance(kwargs.get("extra_args"), list):
            kwargs["extra_args"] = tuple(kwargs["extra_args"])
        if isinstance(kwargs.get("cpus"), str):
            kwargs["cpus"] = parse_cpus(kwargs["cpus"])
        elif isinstance(kwargs.get("cpus"), list):
            kwargs["cpus"] = tuple(kwargs["cpus"])
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
        return f"{self.client_host(self.http_address)}:{self.http_port}"

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


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0"``, ``"0,1"`` or ``"0-3"`` (ranges and lists mix); empty: ``()``."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"cpus {text!r} is not a list of CPU numbers or ranges") from None
        if first > last:
            raise ValueError(f"cpus range {part!r} runs backwards")
        cpus.extend(range(first, last + 1))
    return tuple(cpus)


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


def exposure(config: ServerConfig) -> str:
    """Who can reach the server, as its banner says it, with how to change it."""
    bound = {config.address, config.http_address, config.metrics_address}
    if all(ipaddress.ip_address(a).is_loopback for a in bound):
        return "bound to loopback only (--address 0.0.0.0, or make serve HOST=0.0.0.0, exposes it)"
    return (
        f"bound to gRPC {config.address}, HTTP {config.http_address}, metrics {config.metrics_address} "
        "(other machines reach every address that is not loopback)"
    )


def build_command(config: ServerConfig, files: TritonFiles) -> list[str]:
    """The `tritonserver` argv for `config`. It contains the admin key, in the SECRET_OPTIONS: start it
    with disagg.launch.scrubber's environment, and never log it unredacted."""
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={config.admin_key}"
    return [
        str(files.server),
        f"--model-repository={config.model_repository}",
        f"--backend-directory={config.backend_directory}",
        f"--backend-config=python,shm-region-prefix-name={config.shm_prefix}",
        "--model-control-mode=explicit",
        "--load-model=*",
        # every model of a repository loads at once (Triton's default, 4, initialised the pools one
        # after another): the default repository on 2 cores is ready in 6.6 s instead of 7.8-8.4
        f"--model-load-thread-count={MODEL_LOAD_THREADS}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        f"--http-address={config.http_address}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        *(f"{option}{restricted}" for option in SECRET_OPTIONS),
        # a frontend's remote pool client pings every 2 s to find a partitioned server (triton.remote)
        "--grpc-keepalive-permit-without-calls=true",
        "--grpc-http2-min-recv-ping-interval-without-data=1000",
        "--grpc-http2-max-ping-strikes=0",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        f"--metrics-address={config.metrics_address}",
        f"--metrics-port={config.metrics_port}",
        f"--log-verbose={config.log_verbose}",
        *(GrpcTls(config.grpc_tls).server_args() if config.grpc_tls is not None else ()),
        *config.extra_args,
    ]


def build_environment(
    files: TritonFiles,
    base: Mapping[str, str] | None = None,
    model_dir: Path | None = None,
    http_url: str | None = None,
) -> dict[str, str]:
    """Environment for `tritonserver`: this interpreter's `bin/` first on PATH (the Python backend stub
    runs models with the first `python` there), the wheel's libraries on LD_LIBRARY_PATH, the admin
    key variable removed so that model processes never inherit it, `MODEL_DIR` set to `model_dir`
    when one is given (the models read it when they load), and `DISAGG_SERVER_HTTP` to `http_url`
    (host:port of the server's own HTTP endpoint) when one is given."""
    env = dict(os.environ if base is None else base)
    env.pop(ENV_ADMIN_KEY, None)
    env.pop(ENV_API_KEY, None)  # the OpenAI front end's, never Triton's
    if http_url is not None:
        env[ENV_SERVER_HTTP] = http_url
    if model_dir is not None:
        env["MODEL_DIR"] = str(model_dir)
    bin_dir = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(files.lib_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env


def redact(text: str, secret: str) -> str:
    """`text` with every occurrence of `secret` replaced."""
    return text.replace(secret, "<redacted>") if secret else text
