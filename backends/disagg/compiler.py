"""The C compiler: shared libraries built once per source and flags, cached on disk (torch-free).

The engine's kernels and the launcher's argument scrubber are compiled with the machine's own compiler
(``$CC``, else ``gcc``, else ``cc``) the first time they are needed; a library whose source, headers,
flags and links are unchanged is reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SHARED_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-pthread")


def cache_dir() -> Path:
    """Where the libraries go: ``$DISAGG_KERNEL_DIR``, else ``~/.cache/triton-disagg/kernels``."""
    configured = os.environ.get("DISAGG_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "triton-disagg" / "kernels"


def compile_shared(
    source_path: Path,
    directory: Path,
    flags: Sequence[str] = SHARED_FLAGS,
    linked: Sequence[str] = (),
) -> Path:
    """Compile `source_path` (with the ``*.h`` beside it) into a shared library in `directory`, unless
    a build of this very source and these flags exists; returns the library's path.

    Raises RuntimeError naming what failed (no compiler, compiler error). Safe to call from several
    processes at once: each compiles to a temporary name and renames it into place."""
    headers = b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    source = source_path.read_bytes()
    digest = hashlib.sha256(source + headers + " ".join((*flags, *linked)).encode()).hexdigest()[:16]
    target = directory / f"{source_path.stem}-{digest}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / target.name
        done = subprocess.run(
            [compiler, *flags, "-o", str(partial), str(source_path), *linked],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"compiling {source_path.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    return target
