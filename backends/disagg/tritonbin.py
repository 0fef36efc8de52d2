"""Triton server files shipped inside the `nvidia-pytriton` wheel, and the backend directory built from them.

The wheel carries a complete CPU build of Triton Inference Server 2.51 (the `tritonserver` binary, the
Python backend and its per-Python-version stubs, and the shared libraries they link against). Only those
files are used: the `pytriton` Python package itself is never imported (its dependencies are not installed).

The backend directory handed to `tritonserver --backend-directory` holds:

- `python/`: the classic Python backend (`libtriton_python.so`, `triton_python_backend_utils.py` and the
  stub for the running interpreter's Python version), copied from the wheel. Copies, not links: for a
  Python-based backend Triton 2.51 refuses a `libtriton_python.so` whose real path "escapes backend
  directory";
- `disagg`: a link to this package's folder, so models with `backend: "disagg"` run `disagg/model.py`
  as a Python-based backend (a link is accepted there, and follows edits of the project).
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

PROJECT_BACKEND_NAME = "disagg"


class TritonFilesError(RuntimeError):
    """The Triton server files could not be found or the backend directory could not be prepared."""


@dataclass(frozen=True)
class TritonFiles:
    """Absolute paths of the Triton files inside the installed wheel."""

    server: Path
    python_backend_lib: Path
    python_backend_utils: Path
    python_stub: Path
    lib_dir: Path


def stub_python_version() -> str:
    """The `major.minor` Python version the stub must match: the interpreter running this code."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def locate_triton_files() -> TritonFiles:
    """Find the Triton binaries of the installed `nvidia-pytriton` wheel without importing `pytriton`.

    Raises `TritonFilesError` naming the missing piece (never its path) when the wheel is absent or
    incomplete, e.g. when no stub exists for this Python version.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonFilesError(
            "Triton server binaries not installed: pip install --no-deps nvidia-pytriton==0.7.0"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    root = package_dir / "tritonserver"
    files = TritonFiles(
        server=root / "bin" / "tritonserver",
        python_backend_lib=root / "backends" / "python" / "libtriton_python.so",
        python_backend_utils=root / "backends" / "python" / "triton_python_backend_utils.py",
        python_stub=root / "python_backend_stubs" / stub_python_version() / "triton_python_backend_stub",
        lib_dir=package_dir.parent / "nvidia_pytriton.libs",
    )
    for name, path in (
        ("tritonserver", files.server),
        ("libtriton_python.so", files.python_backend_lib),
        ("triton_python_backend_utils.py", files.python_backend_utils),
        (f"Python {stub_python_version()} backend stub", files.python_stub),
    ):
        if not path.is_file():
            raise TritonFilesError(f"incomplete nvidia-pytriton installation: {name} missing")
    if not files.lib_dir.is_dir():
        raise TritonFilesError("incomplete nvidia-pytriton installation: shared libraries missing")
    return files


def project_backend_source() -> Path:
    """The folder of the project's Python-based backend: this package (`backends/disagg`)."""
    return Path(__file__).resolve().parent


def _link(target: Path, link: Path) -> None:
    """Make `link` a symbolic link to `target`, replacing atomically whatever was there.

    Atomic so that several servers (tests, a developer's `make serve`) may prepare the same directory at once.
    """
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    if link.exists() and not link.is_symlink():
        raise TritonFilesError(f"backend directory entry {link.name!r} exists and is not a link")
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex}")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _copy(source: Path, destination: Path) -> None:
    """Copy `source` to `destination` (with its mode) unless identical; atomic, like `_link`."""
    if (
        destination.is_file()
        and not destination.is_symlink()
        and filecmp.cmp(source, destination, shallow=False)
    ):
        return
    tmp = destination.with_name(f".{destination.name}.{uuid.uuid4().hex}")
    shutil.copy2(source, tmp)
    os.replace(tmp, destination)


def prepare_backend_directory(directory: Path, files: TritonFiles | None = None) -> Path:
    """Create (or refresh) a Triton backend directory at `directory` and return its absolute path.

    Idempotent and safe to call concurrently; refreshes the copies after the wheel is reinstalled.
    """
    files = files or locate_triton_files()
    directory = directory.resolve()
    python_dir = directory / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    _copy(files.python_backend_lib, python_dir / "libtriton_python.so")
    _copy(files.python_backend_utils, python_dir / "triton_python_backend_utils.py")
    _copy(files.python_stub, python_dir / "triton_python_backend_stub")
    _link(project_backend_source(), directory / PROJECT_BACKEND_NAME)
    return directory
