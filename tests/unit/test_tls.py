"""Mutual TLS on the pools' gRPC links (disagg.tls), from the spec's remote.tls folder: the pool roles'
tritonserver flags, the frontend's orchestrator parameter and client options, and the checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from disagg.config import build
from disagg.serverconfig import ServerConfig, build_command
from disagg.serving.orchestrator import OrchestratorConfig
from disagg.serving.settings import RemoteSettings
from disagg.tls import GrpcTls, grpc_tls
from disagg.tritonbin import TritonFiles
from disagg_tools.cli import pool_tls
from disagg_tools.repository import write_owned

SPEC = "remote:\n  prefill: 10.0.0.2:8001\n  decode: 10.0.0.3:8001\n  tls: certs\n"


def tls_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (folder / name).write_text(f"-----BEGIN {name}-----\n")
    return folder


def test_a_folder_needs_its_three_files(tmp_path: Path) -> None:
    folder = tls_folder(tmp_path / "certs")
    tls = GrpcTls(folder)
    assert tls.client_options() == {
        "ssl": True,
        "root_certificates": str(folder / "ca.pem"),
        "private_key": str(folder / "key.pem"),
        "certificate_chain": str(folder / "cert.pem"),
    }
    assert grpc_tls("") is None and grpc_tls(str(folder)) == tls
    (folder / "key.pem").unlink()
    with pytest.raises(ValueError, match=r"key\.pem is missing"):
        GrpcTls(folder)
    with pytest.raises(ValueError, match="absolute"):
        GrpcTls(Path("certs"))


def test_a_pool_server_serves_grpc_over_mutual_tls(tmp_path: Path) -> None:
    folder = tls_folder(tmp_path / "certs")
    files = TritonFiles(*(tmp_path / n for n in ("server", "lib.so", "utils.py", "stub", "lib")))
    config = ServerConfig(Path("/srv/models"), Path("/srv/backends"), admin_key="k" * 32, grpc_tls=folder)
    args = build_command(config, files)
    assert {
        "--grpc-use-ssl=true",
        "--grpc-use-ssl-mutual=true",
        f"--grpc-server-cert={folder / 'cert.pem'}",
        f"--grpc-server-key={folder / 'key.pem'}",
        f"--grpc-root-cert={folder / 'ca.pem'}",
    } <= set(args)
    plain = ServerConfig(Path("/srv/models"), Path("/srv/backends"), admin_key="k" * 32)
    assert not any("ssl" in a for a in build_command(plain, files))


def test_the_spec_switches_tls_on_for_every_role(tmp_path: Path) -> None:
    """remote.tls, relative to the spec's folder: the pool roles serve with it, the frontend's
    orchestrators dial with it; a spec without it (or another role) stays on plain gRPC."""
    folder = tls_folder(tmp_path / "certs")
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    assert pool_tls(spec, "prefill") == folder and pool_tls(spec, "decode") == folder
    assert pool_tls(spec, "frontend") is None
    front = write_owned(spec, tmp_path / "front", "frontend")
    for name in ("llm", "orchestrator"):
        body = (front / name / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "([\w.]+)", value: \{ string_value: "([^"]*)" \}', body))
        assert params["remote.tls"] == str(folder)
        config = build(OrchestratorConfig, {k: v for k, v in params.items() if k != "role"}, strings=True)
        assert grpc_tls(config.remote.tls) == GrpcTls(folder)
    plain = tmp_path / "plain.yaml"
    plain.write_text(SPEC.replace("  tls: certs\n", ""))
    assert pool_tls(plain, "prefill") is None
    body = (write_owned(plain, tmp_path / "front-plain", "frontend") / "llm" / "config.pbtxt").read_text()
    assert "remote.tls" not in body


def test_a_missing_folder_or_tls_without_remote_pools_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    with pytest.raises(ValueError, match="missing"):
        pool_tls(spec, "decode")  # no certs folder beside the spec
    with pytest.raises(ValueError, match="tls: goes with pools"):
        RemoteSettings(tls=str(tls_folder(tmp_path / "certs")))


def test_the_old_flat_tls_parameters_still_work_for_a_release(tmp_path: Path, caplog) -> None:
    folder = str(tls_folder(tmp_path / "certs"))
    old = {"remote_pools": "prefill=10.0.0.2:8001", "remote_tls": folder}
    with caplog.at_level("WARNING", logger="disagg.config"):
        config = build(OrchestratorConfig, old, strings=True)
    assert "remote_tls is deprecated and goes in the next release: it is now remote.tls" in caplog.text
    assert config.remote == RemoteSettings(pools="prefill=10.0.0.2:8001", tls=folder)
    assert config == build(
        OrchestratorConfig, {"remote.pools": old["remote_pools"], "remote.tls": folder}, strings=True
    )
