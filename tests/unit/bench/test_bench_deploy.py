"""vLLM runner configuration: pinned command line, offline environment, binding read from its log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from perf.benchlib.deploy import DeployError, VllmConfig, VllmServer, stop_group


def test_command_pins_cores_and_serves_loopback(tiny_model_dir, tmp_path):
    config = VllmConfig(model_dir=tiny_model_dir, cpus="0,1", port=8123, log_path=tmp_path / "v.log")
    argv = config.command()
    assert argv[:3] == ["taskset", "-c", "0,1"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"  # how vLLM CPU's users run it
    fp32 = VllmConfig(model_dir=tiny_model_dir, dtype="float32", log_path=tmp_path / "v.log").command()
    assert fp32[fp32.index("--dtype") + 1] == "float32"
    env = config.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    assert config.url == "http://127.0.0.1:8123"


def test_binding_is_read_from_the_log(tiny_model_dir, tmp_path):
    log = tmp_path / "v.log"
    log.write_text(
        "x\n(EngineCore) INFO \tlocal_rank=0, core ids=[0]\n(EngineCore) INFO \treserved_cpus=[1]\n"
    )
    server = VllmServer(VllmConfig(model_dir=tiny_model_dir, log_path=log))
    assert server.binding() == "core ids=[0], reserved_cpus=[1]"


def test_validation_and_missing_venv(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError):
        VllmConfig(model_dir=tmp_path)  # no tokenizer.json
    with pytest.raises(ValueError):
        VllmConfig(model_dir=tiny_model_dir, cpus="0;rm")
    with pytest.raises(ValueError, match="dtype"):
        VllmConfig(model_dir=tiny_model_dir, dtype="int8")
    server = VllmServer(VllmConfig(model_dir=tiny_model_dir, venv=Path(tmp_path / "none")))
    with pytest.raises(DeployError, match="install it with"):
        server.start()
    assert server.stop() is None


def test_a_spec_repository_lays_the_overlay_and_pool_parameters_over_the_default(tiny_model_dir, tmp_path):
    from perf.benchlib.deploy import spec_repository

    overlay = {"pools": {"colocated": {"instances": 2}}}
    repo = spec_repository(overlay, tiny_model_dir, "float32", tmp_path, {"colocated": {"cores": "0;1"}})
    text = (repo / "colocated" / "config.pbtxt").read_text()
    assert "count: 2" in text and 'key: "cores", value: { string_value: "0;1" }' in text
    assert 'string_value: "float32"' in (repo / "decode" / "config.pbtxt").read_text()
    with pytest.raises(DeployError, match="did not validate"):
        spec_repository({"pools": {"colocated": {"instances": 0}}}, tiny_model_dir, "auto", tmp_path / "x")


def test_a_group_that_ignores_sigterm_is_killed_after_its_grace() -> None:
    """The vLLM P/D proxy, with connections open, ignored SIGTERM for over 10 s."""
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); input()"
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0
    )
    assert process.stdout.readline() == b"1\n"  # its handler is set
    assert stop_group(process, grace_s=0.2) == -9
