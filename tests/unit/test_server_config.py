"""ServerConfig validation, the tritonserver command line and environment, key handling (no Triton run)."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.server import (
    ADMIN_HEADER,
    ENV_ADMIN_KEY,
    GRPC_ADMIN_HEADER,
    ServerConfig,
    ServerError,
    TritonServer,
    build_command,
    build_environment,
    load_or_create_admin_key,
    remove_shm_regions,
    server_config,
)
from disagg.serverconfig import (
    ENV_SERVER_HTTP,
    LOOPBACK,
    SECRET_OPTIONS,
    exposure,
    parse_cpus,
)
from disagg.tritonbin import TritonFiles, TritonFilesError, prepare_backend_directory, project_backend_source
from disagg_tools.cli import serve_main

KEY = "k" * 32


@pytest.fixture
def files(tmp_path: Path) -> TritonFiles:
    """Stand-ins for the wheel's files (only their paths matter here)."""
    root = tmp_path / "wheel"
    paths = {
        "server": root / "bin" / "tritonserver",
        "python_backend_lib": root / "python" / "libtriton_python.so",
        "python_backend_utils": root / "python" / "triton_python_backend_utils.py",
        "python_stub": root / "stubs" / "triton_python_backend_stub",
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (root / "libs").mkdir()
    return TritonFiles(lib_dir=root / "libs", **paths)


def make_config(**overrides: object) -> ServerConfig:
    values: dict[str, object] = {
        "model_repository": Path("/srv/models"),
        "backend_directory": Path("/srv/backends"),
        "admin_key": KEY,
    }
    values.update(overrides)
    return ServerConfig.from_mapping(values)


def test_defaults_are_triton_ports_and_deliberate_exit_timeout() -> None:
    config = make_config()
    assert (config.http_port, config.grpc_port, config.metrics_port) == (8000, 8001, 8002)
    assert config.exit_timeout_s == 15
    assert config.http_url == "127.0.0.1:8000" and config.grpc_url == "127.0.0.1:8001"
    assert config.metrics_url == "http://127.0.0.1:8002/metrics"


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown server config keys: http_prot"):
        make_config(http_prot=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_repository": Path("models")}, "model_repository must be an absolute path"),
        ({"backend_directory": "relative/backends"}, "backend_directory must be an absolute path"),
        ({"admin_key": "short"}, "admin_key must be"),
        ({"admin_key": "x" * 20 + ",shared-memory"}, "admin_key must be"),
        ({"http_port": 0}, "http_port must be"),
        ({"grpc_port": 70000}, "grpc_port must be"),
        ({"metrics_port": True}, "metrics_port must be"),
        ({"metrics_port": "8002"}, "metrics_port must be"),
        ({"grpc_port": 8000}, "must differ"),
        ({"address": "localhost"}, "address must be an IP address"),
        ({"metrics_address": "0.0.0.0; rm"}, "metrics_address must be an IP address"),
        ({"exit_timeout_s": 0}, "exit_timeout_s must be"),
        ({"exit_timeout_s": 2.5}, "exit_timeout_s must be"),
        ({"log_verbose": -1}, "log_verbose must be"),
        ({"shm_prefix": "a"}, "shm_prefix must be"),
        ({"shm_prefix": "../../etc/x"}, "shm_prefix must be"),
        ({"extra_args": ("-v",)}, "extra_args must be"),
        ({"extra_args": ("--exit-timeout-secs=1",)}, "must not set --exit-timeout-secs"),
        ({"extra_args": ("--http-restricted-api=health:k=v",)}, "must not set --http-restricted-api"),
        ({"extra_args": "--log-info=true"}, "extra_args must be a tuple"),
        ({"cpus": (0, 0)}, "cpus must not repeat"),
        ({"cpus": (-1,)}, "cpus must be a tuple of CPU numbers"),
        ({"cpus": "0-x"}, "not a list of CPU numbers"),
        ({"cpus": "3-1"}, "runs backwards"),
    ],
)
def test_invalid_values_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_is_frozen_and_never_shows_the_key() -> None:
    config = make_config()
    with pytest.raises(AttributeError):
        config.http_port = 1  # type: ignore[misc]
    assert KEY not in repr(config)
    with pytest.raises(ValueError) as info:
        make_config(admin_key="bad key with spaces, not allowed")
    assert "spaces" not in str(info.value)


def test_admin_headers_per_protocol() -> None:
    config = make_config()
    assert config.admin_headers("http") == {ADMIN_HEADER: KEY}
    assert config.admin_headers("grpc") == {GRPC_ADMIN_HEADER: KEY}
    assert GRPC_ADMIN_HEADER == "triton-grpc-protocol-disagg-admin-key"
    with pytest.raises(ValueError):
        config.admin_headers("sagemaker")


def test_client_urls_follow_the_bind_address() -> None:
    config = make_config(address="::", metrics_address="10.0.0.7")
    assert config.http_url == "[::1]:8000"
    assert config.metrics_url == "http://10.0.0.7:8002/metrics"


def test_command_line(files: TritonFiles) -> None:
    config = make_config(
        http_port=9000,
        grpc_port=9001,
        metrics_port=9002,
        address="127.0.0.3",
        http_address="127.0.0.1",
        metrics_address="127.0.0.2",
        exit_timeout_s=7,
        log_verbose=1,
        shm_prefix="disagg_test_",
        extra_args=("--log-info=false",),
    )
    restricted = f"model-repository,shared-memory,trace,logging:disagg-admin-key={KEY}"
    assert build_command(config, files) == [
        str(files.server),
        "--model-repository=/srv/models",
        "--backend-directory=/srv/backends",
        "--backend-config=python,shm-region-prefix-name=disagg_test_",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--model-load-thread-count=16",
        "--strict-readiness=true",
        "--exit-on-error=true",
        "--exit-timeout-secs=7",
        "--http-address=127.0.0.1",
        "--http-port=9000",
        "--grpc-address=127.0.0.3",
        "--grpc-port=9001",
        f"--http-restricted-api={restricted}",
        f"--grpc-restricted-protocol={restricted}",
        "--grpc-keepalive-permit-without-calls=true",
        "--grpc-http2-min-recv-ping-interval-without-data=1000",
        "--grpc-http2-max-ping-strikes=0",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--metrics-address=127.0.0.2",
        "--metrics-port=9002",
        "--log-verbose=1",
        "--log-info=false",
    ]


def test_the_admin_key_is_only_in_options_the_scrubber_masks(files: TritonFiles) -> None:
    """tritonserver takes the key only in its argv: every argument holding it must be one that
    disagg.launch.scrubber masks in /proc/PID/cmdline before the server's main runs (a new option
    carrying it would show in `ps`)."""
    holding = [arg for arg in build_command(make_config(), files) if KEY in arg]
    assert len(holding) == len(SECRET_OPTIONS)
    assert all(arg.startswith(SECRET_OPTIONS) for arg in holding), holding


def test_every_port_is_bound_to_loopback_unless_an_address_is_given(tmp_path: Path) -> None:
    config = server_config(tmp_path, state_dir=tmp_path, env={})
    assert {config.address, config.http_address, config.metrics_address} == {LOOPBACK}
    assert "loopback only" in exposure(config)
    exposed = server_config(tmp_path, state_dir=tmp_path, env={}, address="0.0.0.0")
    assert {exposed.address, exposed.http_address, exposed.metrics_address} == {"0.0.0.0"}
    assert "other machines" in exposure(exposed)
    pool = server_config(tmp_path, state_dir=tmp_path, env={}, address="0.0.0.0", http_address=LOOPBACK)
    assert (pool.address, pool.http_address) == ("0.0.0.0", LOOPBACK)
    assert pool.http_url == f"{LOOPBACK}:8000" and pool.grpc_url == "127.0.0.1:8001"
    metrics = server_config(tmp_path, state_dir=tmp_path, env={"METRICS_ADDRESS": "0.0.0.0"})
    assert (metrics.address, metrics.metrics_address) == (LOOPBACK, "0.0.0.0")


def test_each_config_gets_its_own_shm_prefix() -> None:
    assert make_config().shm_prefix != make_config().shm_prefix
    assert make_config().shm_prefix.startswith("disagg_")


def test_environment_puts_this_venv_first_and_drops_the_key(files: TritonFiles) -> None:
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", ENV_ADMIN_KEY: KEY, "OTHER": "1"}
    env = build_environment(files, base)
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.prefix) / "bin"), "/usr/bin"]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [str(files.lib_dir), "/opt/lib"]
    assert ENV_ADMIN_KEY not in env and env["OTHER"] == "1"
    assert base[ENV_ADMIN_KEY] == KEY, "the caller's mapping is not modified"


def test_environment_names_the_configured_model(files: TritonFiles, tmp_path: Path) -> None:
    base = {"PATH": "/usr/bin", "MODEL_DIR": "/elsewhere"}
    assert build_environment(files, base)["MODEL_DIR"] == "/elsewhere"  # none configured: inherited
    assert build_environment(files, base, model_dir=tmp_path)["MODEL_DIR"] == str(tmp_path)
    assert make_config(model_dir=str(tmp_path / "m")).model_dir == tmp_path / "m"
    with pytest.raises(ValueError, match="model_dir"):
        make_config(model_dir="relative/m")


def test_server_config_reads_ports_from_the_environment(tmp_path: Path) -> None:
    env = {
        "HTTP_PORT": "18000",
        "GRPC_PORT": "18001",
        "METRICS_PORT": "18002",
        "METRICS_ADDRESS": "127.0.0.1",
    }
    config = server_config(tmp_path / "repo", state_dir=tmp_path / "state", env=env)
    assert (config.http_port, config.grpc_port, config.metrics_port) == (18000, 18001, 18002)
    assert config.metrics_address == "127.0.0.1"
    assert config.model_repository == (tmp_path / "repo").resolve()
    assert config.backend_directory == (tmp_path / "state" / "backends").resolve()
    with pytest.raises(ValueError, match="HTTP_PORT must be an integer"):
        server_config(tmp_path, state_dir=tmp_path / "state", env={"HTTP_PORT": "80a"})
    overridden = server_config(tmp_path, state_dir=tmp_path / "state", env=env, http_port=19000)
    assert overridden.http_port == 19000


def test_admin_key_is_generated_once_with_mode_0600(tmp_path: Path) -> None:
    state = tmp_path / "state"
    key = load_or_create_admin_key(state, env={})
    path = state / "admin-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert len(key) >= 32
    assert load_or_create_admin_key(state, env={}) == key


def test_admin_key_from_the_environment_wins_and_is_validated(tmp_path: Path) -> None:
    assert load_or_create_admin_key(tmp_path, env={ENV_ADMIN_KEY: KEY}) == KEY
    assert not (tmp_path / "admin-key").exists()
    with pytest.raises(ValueError) as info:
        load_or_create_admin_key(tmp_path, env={ENV_ADMIN_KEY: "secret,with=separators"})
    assert "secret" not in str(info.value).replace(ENV_ADMIN_KEY, "")


def test_admin_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    load_or_create_admin_key(tmp_path, env={})
    (tmp_path / "admin-key").chmod(0o644)
    with pytest.raises(ServerError, match="mode 0600"):
        load_or_create_admin_key(tmp_path, env={})


def test_malformed_admin_key_file_is_refused_without_echo(tmp_path: Path) -> None:
    (tmp_path / "admin-key").write_text("not a valid key at all\n")
    (tmp_path / "admin-key").chmod(0o600)
    with pytest.raises(ServerError) as info:
        load_or_create_admin_key(tmp_path, env={})
    assert "valid key" not in str(info.value)


def test_remove_shm_regions_only_touches_the_prefix(tmp_path: Path) -> None:
    for name in ("disagg_abc_1", "disagg_abc_2", "disagg_abd_1", "other"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_shm_regions("disagg_abc_", tmp_path)) == ["disagg_abc_1", "disagg_abc_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disagg_abd_1", "other"]


def test_backend_directory_copies_wheel_files_and_links_project_backend(
    tmp_path: Path, files: TritonFiles
) -> None:
    files.python_stub.write_text("stub v1")
    files.python_stub.chmod(0o755)
    directory = prepare_backend_directory(tmp_path / "backends", files)
    python = directory / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        assert (python / name).is_file() and not (python / name).is_symlink(), "Triton refuses escaping links"
    assert (python / "triton_python_backend_stub").read_text() == "stub v1"
    assert os.access(python / "triton_python_backend_stub", os.X_OK)
    assert (directory / "disagg").is_symlink()
    assert (directory / "disagg").resolve() == project_backend_source()
    assert prepare_backend_directory(tmp_path / "backends", files) == directory  # idempotent
    files.python_stub.write_text("stub v2")  # wheel reinstalled
    prepare_backend_directory(tmp_path / "backends", files)
    assert (python / "triton_python_backend_stub").read_text() == "stub v2"
    assert sorted(p.name for p in python.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]


def test_backend_directory_refuses_to_replace_a_real_entry(tmp_path: Path, files: TritonFiles) -> None:
    (tmp_path / "backends" / "disagg").mkdir(parents=True)
    with pytest.raises(TritonFilesError, match="not a link"):
        prepare_backend_directory(tmp_path / "backends", files)


def test_serve_main_reports_a_missing_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_ADMIN_KEY, KEY)
    assert serve_main(["--model-repository", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "model repository not found" in err
    assert str(tmp_path) not in err and KEY not in err


def test_cpus_parse_lists_and_ranges() -> None:
    assert parse_cpus("") == ()
    assert parse_cpus("0") == (0,)
    assert parse_cpus("0,2-4") == (0, 2, 3, 4)
    assert make_config(cpus="1").cpus == (1,)
    assert make_config(cpus=[0, 1]).cpus == (0, 1)


def test_server_process_starts_on_its_cpus(tmp_path: Path, files: TritonFiles) -> None:
    """The pinning is applied in the child before exec: a stand-in 'tritonserver' reports its own."""
    report = tmp_path / "affinity"
    files.server.write_text(f"#!/bin/sh\ngrep Cpus_allowed_list /proc/self/status > {report}\n")
    files.server.chmod(0o755)
    (tmp_path / "models").mkdir()
    core = min(os.sched_getaffinity(0))
    config = make_config(model_repository=tmp_path / "models", backend_directory=tmp_path / "b", cpus=(core,))
    server = TritonServer(config).start(files)
    assert server.wait(30) == 0
    assert report.read_text().split() == ["Cpus_allowed_list:", str(core)]


def test_server_leads_its_own_group_in_the_callers_session(tmp_path: Path, files: TritonFiles) -> None:
    """The server is stopped by its process group, and stays in the caller's session: a session of its
    own would be a scheduler autogroup of its own, and a client beside it (a benchmark, a test) would
    then wait hundreds of milliseconds to run under load (docs/degradation.md, "Measuring on one machine")."""
    report = tmp_path / "ids"
    files.server.write_text(f"#!/bin/sh\necho $$ $(cut -d' ' -f5,6 /proc/$$/stat) > {report}\n")
    files.server.chmod(0o755)
    (tmp_path / "models").mkdir()
    config = make_config(model_repository=tmp_path / "models", backend_directory=tmp_path / "b")
    server = TritonServer(config).start(files)
    assert server.wait(30) == 0
    pid, group, session = (int(x) for x in report.read_text().split())
    assert pid == server.pid
    assert group == server.pid != os.getpgid(0)
    assert session == os.getsid(0)


def test_server_refuses_cpus_it_cannot_have(tmp_path: Path, files: TritonFiles) -> None:
    (tmp_path / "models").mkdir()
    config = make_config(
        model_repository=tmp_path / "models", backend_directory=tmp_path / "b", cpus=(10_000,)
    )
    with pytest.raises(ServerError, match="could not start tritonserver on cpus"):
        TritonServer(config).start(files)


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def answering_200() -> Iterator[int]:
    """A loopback HTTP server answering 200 to every GET; yields its port."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_not_ready_until_the_metrics_endpoint_answers_too() -> None:
    """Triton opens its metrics service after HTTP: health 200 with metrics not yet listening is not
    ready (a first scrape right after wait_ready would be refused)."""
    with contextlib.ExitStack() as stack:
        health, metrics = (stack.enter_context(answering_200()) for _ in range(2))
        # Bound, never listening: a connection to either is refused, and nothing else can take them.
        grpc, quiet = (stack.enter_context(contextlib.closing(socket.socket())) for _ in range(2))
        for sock in (grpc, quiet):
            sock.bind(("127.0.0.1", 0))

        def server(metrics_port: int) -> TritonServer:
            ports = {"http_port": health, "grpc_port": grpc.getsockname()[1], "metrics_port": metrics_port}
            return TritonServer(make_config(address="127.0.0.1", metrics_address="127.0.0.1", **ports))

        assert not server(quiet.getsockname()[1]).is_ready()
        assert server(metrics).is_ready()


def test_environment_tells_the_models_where_the_server_listens(files: TritonFiles) -> None:
    """The orchestrators read pool readiness from the server's own HTTP endpoint (readiness)."""
    config = make_config()
    env = build_environment(files, {"PATH": "/usr/bin"}, http_url=config.http_url)
    assert env[ENV_SERVER_HTTP] == config.http_url
    assert ENV_SERVER_HTTP not in build_environment(files, {"PATH": "/usr/bin"})


def test_a_stop_signal_marks_the_server_draining_until_it_is_gone(tmp_path: Path, monkeypatch) -> None:
    """`signal(SIGTERM)` (as `disagg serve` forwards Ctrl-C / SIGTERM) writes the draining marker the
    entry points read before it signals the process group, so no request that arrives after the signal
    is served; other signals do not; the marker goes once the server is seen exited."""
    import signal
    import subprocess

    from disagg.control import ModelControl

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    server = TritonServer(make_config(http_port=9123))
    marker = ModelControl(server.config.http_url).draining_path
    # a stand-in for tritonserver, in a group of its own as start() makes it
    server._process = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        server.signal(signal.SIGCONT)
        assert not marker.exists()
        server.signal(signal.SIGTERM)
        assert marker.exists()
        assert server.wait(10) == -signal.SIGTERM
        assert not marker.exists()
        # stop() signals (marking it draining) and, once the server is gone, clears the mark too
        server._process = subprocess.Popen(["sleep", "30"], process_group=0)
        assert server.stop(grace_s=1) == -signal.SIGTERM
        assert not marker.exists()
    finally:
        server._process.kill()
        server._process.wait()
