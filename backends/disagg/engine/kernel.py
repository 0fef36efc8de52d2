"""The engine's native bf16 CPU kernels (``kernels/bf16.c``): small-batch projections and paged
decode attention.

Built with the system C compiler into a cache folder this project owns (``$DISAGG_KERNEL_DIR``, else
``~/.cache/triton-disagg/kernels``), named by the source's hash, at ``make`` (``python -m
disagg.engine.kernel``) or on first use; loaded with ctypes. No torch headers, no build step at
install: the file compiles in about a second. ``gemv()`` and ``decode_attention()`` are None, and
callers use oneDNN / PyTorch, when the CPU has no AVX-512-BF16, no compiler is found, or the build
fails; the reason is logged once. Both are single-threaded: the engine uses them on one compute
thread only.

``gemv``, measured on SmolLM2's 121 decode-step projections (one core, AVX-512-BF16 without AMX):
batch 1 in 12.9 ms against oneDNN's prepacked 27.4 ms, batch 2 in 13.6 against 26.8; at batch 4
they are even and at 8 oneDNN is faster, so the engine uses it up to ``MAX_ROWS``.
``decode_attention``: ``perf/attention_bench.py``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "bf16.c"
MAX_ROWS = 2  # input rows up to which the kernel beats oneDNN (see above); the C code takes 1..8
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")

Gemv = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cache_dir() -> Path:
    configured = os.environ.get("DISAGG_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "triton-disagg" / "kernels"


def cpu_supports() -> bool:
    """AVX-512-BF16 (and BW, for masked 16-bit loads) in /proc/cpuinfo."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512_bf16"} <= flags


def build(directory: Path | None = None) -> Path:
    """Compile the kernel unless a build of this very source exists; returns the library's path.

    Raises RuntimeError naming what failed (no compiler, compiler error). Safe to call from several
    processes at once: each compiles to a temporary name and renames it into place."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"bf16-{digest}.so"
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot run or be built."""
    if not cpu_supports():
        log.info("bf16 CPU kernels off: this CPU has no AVX-512-BF16")
        return None
    try:
        loaded = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        log.warning("bf16 CPU kernels off: %s", exc)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.gemv_bf16.argtypes = [pointer, pointer, pointer, pointer, size, size, size]
    loaded.gemv_bf16.restype = None
    loaded.decode_attention_bf16.argtypes = [pointer] * 6 + [size] * 8 + [ctypes.c_float]
    loaded.decode_attention_bf16.restype = None
    return loaded


def gemv() -> Gemv | None:
    """``gemv(x [M, K] bf16, w [N, K] bf16 contiguous, bias [N] | None) -> y [M, N]``, or None."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.gemv_bf16

    def call(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, width = x.shape
        if not 1 <= rows <= 8 or w.shape[1] != width or x.dtype != torch.bfloat16:
            raise ValueError("gemv takes 1 to 8 bf16 rows of the weight's input width")
        x = x.contiguous()
        out = torch.empty(rows, w.shape[0], dtype=torch.bfloat16)
        bias_at = None if bias is None else bias.data_ptr()
        function(x.data_ptr(), w.data_ptr(), bias_at, out.data_ptr(), rows, w.shape[0], width)
        return out

    return call


def attention_covers(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``decode_attention`` takes this head layout: head_dim a multiple of 32 up to 256, and
    at most 8 query heads per kv head."""
    return head_dim % 32 == 0 and head_dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 8


DecodeAttention = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_attention() -> DecodeAttention | None:
    """``attend(q [B, heads, hd] bf16, cache [NB, layers, 2, bs, kv_heads, hd] bf16, layer,
    block_table [B, MB] int64, positions [B] int64) -> [B, heads, hd]``: each sequence's query over
    positions 0..position of its own blocks, in one call. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.decode_attention_bf16

    def call(
        q: torch.Tensor, cache: torch.Tensor, layer: int, block_table: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        _, layers, _, block_size, kv_heads, _ = cache.shape
        if (
            q.dtype != torch.bfloat16
            or cache.dtype != torch.bfloat16
            or not cache.is_contiguous()
            or not attention_covers(heads, kv_heads, head_dim)
        ):
            raise ValueError(
                "decode_attention takes bf16, head_dim a multiple of 32 up to 256, groups up to 8"
            )
        q = q.contiguous()
        table = block_table.to(torch.int64).contiguous()
        where = positions.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        scratch = torch.empty((heads // kv_heads) * (int(where.max()) + 1), dtype=torch.float32)
        function(
            q.data_ptr(),
            cache.data_ptr(),
            table.data_ptr(),
            where.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            batch,
            table.shape[1],
            layer,
            layers,
            block_size,
            kv_heads,
            heads // kv_heads,
            head_dim,
            head_dim**-0.5,
        )
        return out

    return call


if __name__ == "__main__":  # `make`: build now rather than at the first engine start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cpu_supports():
        print("bf16 CPU kernels: not built, this CPU has no AVX-512-BF16")
        sys.exit(0)
    try:
        print(f"bf16 CPU kernels: {build()}")
    except RuntimeError as exc:  # the engine falls back to oneDNN; make goes on
        print(f"bf16 CPU kernels: not built ({exc})")
