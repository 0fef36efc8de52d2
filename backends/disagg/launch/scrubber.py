"""Secret options kept out of a child's command line (``argscrub.c``, preloaded into the child).

Triton 2.51 takes the restricted APIs' key only as a command-line argument, and every local user reads
``/proc/PID/cmdline``. The child is started with ``LD_PRELOAD`` naming the scrubber and
``DISAGG_SCRUB_PREFIXES`` naming the options to mask; before its ``main`` runs, the values of those
options are moved to the heap and their original bytes overwritten with ``*``. Between ``execve`` and
that moment (the dynamic loader's work, about a millisecond) the value is still readable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from disagg.compiler import cache_dir, compile_shared

SOURCE = Path(__file__).resolve().parent / "argscrub.c"
PREFIXES_ENV = "DISAGG_SCRUB_PREFIXES"


class ScrubberError(RuntimeError):
    """The scrubber cannot be built: a child started now would show its secret in ``ps``."""


@functools.cache
def library() -> Path:
    """The scrubber's shared library, compiled once into the kernel cache."""
    try:
        return compile_shared(SOURCE, cache_dir())
    except (RuntimeError, OSError) as exc:
        raise ScrubberError(
            f"cannot build the argument scrubber ({exc}); without it the admin key would show in `ps`. "
            "Install a C compiler (gcc or cc, or set CC)"
        ) from exc


def environment(env: Mapping[str, str], prefixes: Sequence[str]) -> dict[str, str]:
    """`env` for a child whose arguments starting with one of `prefixes` are masked (ScrubberError
    where the scrubber cannot be built)."""
    if not prefixes or any(not p or "\n" in p for p in prefixes):
        raise ValueError("prefixes must be non-empty strings without newlines")
    out = dict(env)
    preload = [str(library()), *(p for p in out.get("LD_PRELOAD", "").split(os.pathsep) if p)]
    out["LD_PRELOAD"] = os.pathsep.join(preload)
    out[PREFIXES_ENV] = "\n".join(prefixes)
    return out
