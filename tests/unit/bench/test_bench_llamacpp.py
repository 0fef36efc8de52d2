"""llama.cpp's server as a peer: its build options named for the CPU at hand, the GGUF it serves
checked against the converted model, and its command line built from a grid configuration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from perf import run_all
from perf.benchlib import llamacpp
from perf.benchlib.deploy import DeployError

AVX2 = frozenset(["fpu", "avx", "avx2", "fma", "f16c", "bmi2"])
AMX = AVX2 | {"avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_the_isa_options_follow_the_cpu_and_never_build_native() -> None:
    amx, avx2 = llamacpp.cmake_options(AMX), llamacpp.cmake_options(AVX2)
    assert amx["GGML_NATIVE"] == avx2["GGML_NATIVE"] == "OFF"
    amx_on = {k for k, v in amx.items() if v == "ON"}
    assert amx_on >= {"GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16", "GGML_AVX512", "GGML_AVX512_BF16"}
    assert {k for k, v in avx2.items() if v == "ON"} == {
        "GGML_AVX",
        "GGML_AVX2",
        "GGML_FMA",
        "GGML_F16C",
        "GGML_BMI2",
    }
    assert avx2["GGML_AVX512"] == avx2["GGML_AMX_TILE"] == "OFF"
    line = llamacpp.configure_command(Path("/src"), Path("/b"), avx2)
    assert line[:7] == ["cmake", "-S", "/src", "-B", "/b", "-G", "Ninja"]
    assert "-DGGML_NATIVE=OFF" in line and "-DLLAMA_BUILD_SERVER=ON" in line and "-DGGML_AVX512=OFF" in line


def test_a_build_is_reused_only_with_the_same_options(tmp_path: Path, monkeypatch) -> None:
    binary = llamacpp.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    options = llamacpp.cmake_options(llamacpp.cpu_flags(Path("/proc/cpuinfo").read_text()))
    record = {"sdist": llamacpp.SDIST, "options": options, "system_info": "system_info: AVX2 = 1"}
    (tmp_path / "build.json").write_text(json.dumps(record))

    class Rebuilt(Exception):
        pass

    def run(*args, **kwargs):
        raise Rebuilt(args[0][0])

    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    assert llamacpp.build(tmp_path) == record
    (tmp_path / "build.json").write_text(json.dumps({**record, "options": {"GGML_AVX512": "ON"}}))
    with pytest.raises(Rebuilt, match="cmake"):  # other options: configured and built again
        llamacpp.build(tmp_path, source=tmp_path)


def test_the_command_line_comes_from_the_grid(tmp_path: Path, smollm2_dir: Path) -> None:
    args = run_all.parse_args(["--quick", "--model-dir", str(smollm2_dir), "--llamacpp-grid", "8:1:2,16:2:2"])
    grid = run_all.llamacpp_grid(args.llamacpp_grid)
    assert [c.label for c in grid] == ["8 slots, -t 1 -tb 2", "16 slots, -t 2 -tb 2"]
    config = run_all.llamacpp_config(args, tmp_path, grid[0])
    line = config.command()
    assert line[:3] == ["taskset", "-c", "0,1"] and line[3] == str(llamacpp.server_binary())
    assert line[line.index("-m") + 1] == str(config.gguf)
    assert config.gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the very file the model came from
    server = line[3:]
    assert server[server.index("-np") + 1] == "8"
    assert server[server.index("-c") + 1] == str(8 * llamacpp.CONTEXT_PER_SLOT)
    assert line[line.index("-t") + 1] == "1" and line[line.index("-tb") + 1] == "2"
    assert line[line.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(SystemExit, match="SLOTS:THREADS:BATCH_THREADS"):
        run_all.llamacpp_grid("16:2")
    with pytest.raises(ValueError, match="slots"):
        llamacpp.LlamaCppConfig(gguf=config.gguf, slots=0)


def test_only_the_source_gguf_is_served(tmp_path: Path, smollm2_dir: Path, tiny_model_dir: Path) -> None:
    assert llamacpp.gguf_of(smollm2_dir).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(DeployError, match="not converted from a catalog GGUF"):
        llamacpp.gguf_of(tiny_model_dir)
    forged = tmp_path / "model"
    shutil.copytree(smollm2_dir, forged, ignore=shutil.ignore_patterns("*.safetensors"))
    stamp = json.loads((forged / "disagg_checkpoint.json").read_text())
    stamp["source"]["sha256"] = "0" * 64
    (forged / "disagg_checkpoint.json").write_text(json.dumps(stamp))
    with pytest.raises(DeployError, match="SHA-256"):
        llamacpp.gguf_of(forged)


def test_a_missing_build_is_reported_with_how_to_build_it(tmp_path: Path, smollm2_dir: Path) -> None:
    gguf = llamacpp.gguf_of(smollm2_dir)
    server = llamacpp.LlamaCppServer(llamacpp.LlamaCppConfig(gguf=gguf, binary=tmp_path / "none"))
    with pytest.raises(DeployError, match="make llamacpp"):
        server.start()


def test_amx_options_are_kept_only_if_the_server_built_with_them_serves(tmp_path: Path, monkeypatch) -> None:
    builds: list[dict[str, str]] = []

    def run(argv, **kwargs):
        if argv[0] == "cmake" and argv[1] == "-S":
            builds.append(dict(a.removeprefix("-D").split("=", 1) for a in argv if a.startswith("-D")))
        elif argv[0] == "cmake":
            binary = llamacpp.server_binary(tmp_path)
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.write_text("")
        return llamacpp.subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    monkeypatch.setattr(llamacpp, "system_info", lambda binary: "system_info: AMX_INT8 = 1")
    amx_cpu = "flags\t\t: " + " ".join(sorted(AMX)) + "\n"
    record = llamacpp.build(tmp_path, source=tmp_path, cpuinfo=amx_cpu, check=lambda b: "")
    assert [b["GGML_AMX_INT8"] for b in builds] == ["ON"] and record["note"] == ""
    builds.clear()
    (tmp_path / "build.json").unlink()
    record = llamacpp.build(tmp_path, source=tmp_path, cpuinfo=amx_cpu, check=lambda b: "exited with -4")
    assert [b["GGML_AMX_INT8"] for b in builds] == ["ON", "OFF"]  # tried, then built again without
    assert record["options"]["GGML_AMX_TILE"] == "OFF" and record["wanted"]["GGML_AMX_TILE"] == "ON"
    assert "AMX options dropped" in record["note"] and "exited with -4" in record["note"]
    builds.clear()
    assert llamacpp.build(tmp_path, source=tmp_path, cpuinfo=amx_cpu) == record  # not tried again
    assert builds == []
    avx2_cpu = "flags\t\t: " + " ".join(sorted(AVX2)) + "\n"
    llamacpp.build(
        tmp_path, source=tmp_path, cpuinfo=avx2_cpu, check=lambda b: pytest.fail("no AMX to check")
    )
    assert [b["GGML_AMX_INT8"] for b in builds] == ["OFF"]
