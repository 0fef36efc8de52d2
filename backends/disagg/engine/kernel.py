"""The engine's native bf16 CPU kernels (``kernels/bf16.c``): projections and paged decode attention.

Built with the system C compiler into a cache folder this project owns (``$DISAGG_KERNEL_DIR``, else
``~/.cache/triton-disagg/kernels``), named by the source's hash, at ``make`` (``python -m
disagg.engine.kernel``) or on first use; loaded with ctypes. No torch headers, no build step at
install: the file compiles in about a second. ``gemm()`` and ``decode_attention()`` are None, and
callers use oneDNN / PyTorch, when the CPU has no AVX-512-BF16, no compiler is found, or the build
fails; the reason is logged once.

- ``gemm``: every bf16 projection, on a weight laid out for it (``pack``); against oneDNN's prepacked
  kernel: ``perf/projection_bench.py``.
- ``decode_attention`` / ``prompt_attention``: a decode batch's rows, and a prompt chunk's, over the
  paged cache (``perf/attention_bench.py`` for decode; prefill through ``perf/engine_bench.py``).
- ``rms_norm`` / ``silu_mul``: the pointwise work between projections, one pass each.
- ``rope_cache``: a layer's rotary embedding and its KV cache writes, in one pass.

All of them split their work in parts over one thread team (``kernels/team.c``, a library of its own
every kernel library links), on ``team_threads()`` threads: torch's intra-op count unless
``use_threads`` set one. The caller claims parts itself and waits only for parts a helper has
claimed, never for a helper the OS has not run yet, which an OpenMP barrier does: on a pool's cores
shared with the token relay, that wait added about 60 % to a colocated pool's decode step. An engine
step runs torch on one thread meanwhile (``disagg.engine.device.kernel_threads``), so its OpenMP
workers do not spin on the cores the team needs. No result depends on the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.compiler import SHARED_FLAGS, cache_dir, compile_shared

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "kernels" / "bf16.c"
TEAM = Path(__file__).resolve().parent / "kernels" / "team.c"  # the thread team they share
TILE = 64  # outputs per tile of the gemm layout; kernels/bf16.c's COLS
CODE_TILE = 16  # outputs per tile of block codes (disagg.engine.blockcode.TILE); kernels/bf16.c's QCOLS
FLAGS = SHARED_FLAGS

Gemm = Callable[..., torch.Tensor]

_threads = 0  # the team's threads per call; 0: as many as torch's intra-op pool


def team_threads() -> int:
    """Threads a kernel call runs on (``kernels/team.c``): what ``use_threads`` set, else torch's
    intra-op thread count."""
    return _threads or torch.get_num_threads()


def use_threads(count: int) -> int:
    """Run every kernel call of this process on ``count`` threads (0: follow torch's pool again);
    returns the setting it replaces."""
    global _threads
    if count < 0:
        raise ValueError("a thread count is at least 0")
    previous, _threads = _threads, count
    return previous


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_supports() -> bool:
    """AVX-512-BF16 (and BW and VL, for masked 16-bit loads and stores): what the kernels need."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def cpu_has_amx() -> bool:
    """AMX with bf16 tiles, where oneDNN's prompt (compute-bound) projections outrun ``gemm``."""
    return "amx_bf16" in cpu_flags()


def build(directory: Path | None = None, source_path: Path = SOURCE, defines: tuple[str, ...] = ()) -> Path:
    """Compile a kernel source (``kernels/bf16.c`` unless told, with ``-D`` of each of ``defines``)
    unless a build of this very source exists; returns the library's path (disagg.compiler:
    RuntimeError naming what failed)."""
    directory = directory or cache_dir()
    linked: list[str] = []
    if source_path != TEAM:  # every kernel library runs its parts on the one team library
        team = build(directory, TEAM)
        linked = [str(team), f"-Wl,-rpath,{team.parent}"]
    flags = (*FLAGS, *(f"-D{name}" for name in defines))
    return compile_shared(source_path, directory, flags, linked)


def load(
    name: str,
    source_path: Path,
    supported: bool,
    missing: str,
    declare: Callable[[ctypes.CDLL], str | None],
    defines: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """The library built from ``source_path`` (with ``defines``), or None (logged once by the caller's
    cache) where this CPU lacks ``missing`` (``supported`` false), where it cannot be built or loaded,
    or where ``declare`` (which types its functions) returns why this build does not fit the Python
    side."""
    if not supported:
        log.info("%s off: this CPU has no %s", name, missing)
        return None
    try:
        loaded = ctypes.CDLL(str(build(source_path=source_path, defines=defines)))
    except (RuntimeError, OSError) as exc:
        log.warning("%s off: %s", name, exc)
        return None
    refused = declare(loaded)
    if refused is not None:
        log.warning("%s off: %s", name, refused)
        return None
    return loaded


# kernels/team.c's loan functions, each returning an int64 (``loan_state`` a uint32)
LOAN_SIGNATURES: dict[str, list[type]] = {
    "loan_segment_bytes": [],
    "team_borrow": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64],
    "team_borrowed_tid": [ctypes.c_int64],
    "team_borrowed_idle": [ctypes.c_int64],
    "team_borrowed": [],
    "team_borrow_segment": [ctypes.c_int64, ctypes.c_void_p],
    "loan_want": [ctypes.c_void_p, ctypes.c_int64],
    "loan_lend": [ctypes.c_void_p],
    "loan_reclaim": [ctypes.c_void_p, ctypes.c_int64],
    "loan_abandoned": [ctypes.c_void_p],
    "team_unborrow": [ctypes.c_int64],
    "loan_await": [ctypes.c_void_p, ctypes.c_int64],
    "loan_state": [ctypes.c_void_p],
}


@functools.cache
def team() -> ctypes.CDLL | None:
    """The thread team every kernel library is linked with (``kernels/team.c``), or None where it
    cannot be built; for its counters (the kernels load it themselves)."""
    try:
        loaded = ctypes.CDLL(str(build(source_path=TEAM)))
    except (RuntimeError, OSError) as exc:
        log.warning("kernel thread team unavailable: %s", exc)
        return None
    size = ctypes.c_int64
    loaded.team_helpers.restype = size
    for name, args in LOAN_SIGNATURES.items():  # loans of another pool's core (disagg.engine.loan)
        getattr(loaded, name).argtypes = args
        getattr(loaded, name).restype = size
    loaded.loan_state.restype = ctypes.c_uint32
    return loaded


def team_helpers() -> int:
    """Helper threads the team has started in this process (0 before any call split over threads)."""
    loaded = team()
    return int(loaded.team_helpers()) if loaded is not None else 0


# the paged decode attention's C signature, the same in bf16 and fp32 (``kernels/fp32.c``)
DECODE_ATTENTION_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float] + [ctypes.c_int64] * 2


def _declare(loaded: ctypes.CDLL) -> str | None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.gemm_bf16.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, size]
    loaded.gemm_bf16.restype = None
    loaded.prompt_attention_bf16.argtypes = [pointer] * 5 + [size] * 8 + [ctypes.c_float, size]
    loaded.prompt_attention_bf16.restype = None
    loaded.prompt_scratch_floats.argtypes = [size, size]
    loaded.prompt_scratch_floats.restype = size
    loaded.rms_norm_bf16.argtypes = [pointer] * 3 + [size, size, ctypes.c_float, size]
    loaded.rms_norm_bf16.restype = None
    loaded.silu_mul_bf16.argtypes = [pointer] * 2 + [size, size, size]
    loaded.silu_mul_bf16.restype = None
    loaded.rope_cache_bf16.argtypes = [pointer] * 8 + [size] * 8
    loaded.rope_cache_bf16.restype = None
    loaded.decode_attention_bf16.argtypes = DECODE_ATTENTION_ARGS
    loaded.decode_attention_bf16.restype = None
    loaded.gemm_codes_bf16.argtypes = [pointer] * 7 + [size] * 5
    loaded.gemm_codes_bf16.restype = None
    loaded.gemm_tile_cols.restype = size
    loaded.codes_tile_cols.restype = size
    if loaded.gemm_tile_cols() != TILE:
        return f"{SOURCE.name} tiles {loaded.gemm_tile_cols()} outputs, this module {TILE}"
    if loaded.codes_tile_cols() != CODE_TILE:
        return f"{SOURCE.name} tiles block codes by {loaded.codes_tile_cols()}, blockcode by {CODE_TILE}"
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot run or be built."""
    return load("bf16 CPU kernels", SOURCE, cpu_supports(), "AVX-512-BF16", _declare)


@dataclass(frozen=True)
class PackedWeight:
    """A projection weight [N, K] laid out for a kernel: here, the layout ``gemm`` reads, [ceil(N /
    TILE), K / 2, TILE, 2] (per tile of TILE outputs, each input pair's TILE weight pairs), outputs
    zero-padded to whole tiles (``kernels/bf16.c``); ``fp32kernel.pack`` makes the fp32 kernel's."""

    tiles: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()


def pack(weight: torch.Tensor) -> PackedWeight:
    """``weight`` [N, K] bf16 laid out for ``gemm``."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError("pack takes a 2-D bf16 weight")
    n, k = weight.shape
    if k % 2:
        raise ValueError("pack takes an even number of inputs (the layout holds pairs)")
    padded = F.pad(weight, (0, 0, 0, -n % TILE))
    tiles = padded.view(padded.shape[0] // TILE, TILE, k // 2, 2).transpose(1, 2)
    return PackedWeight(tiles.contiguous(), n, k)


def bf16_operands(
    name: str, x: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None, wide: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 projection's checked inputs (``x`` [M, in_features] bf16, made contiguous; ``bias``
    [out_features] bf16 or None) and its output, [M, out_features], fp32 with ``wide``, else bf16;
    ValueError naming ``name`` for anything else."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{name} takes bf16 rows of width {in_features}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
        raise ValueError(f"{name} takes a bf16 bias of {out_features}")
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32 if wide else torch.bfloat16)
    return x.contiguous(), out


def gemm() -> Gemm | None:
    """``gemm(x [M, K] bf16, weight: PackedWeight, bias [N] | None, wide=False) -> y [M, N]``, bf16, or
    fp32 with ``wide`` (the sums unrounded: an output head's logits), any M: a row's bits do not
    depend on M or on the other rows. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    return packed_gemm("gemm", loaded.gemm_bf16)


def packed_gemm(name: str, function: Callable[..., int | None]) -> Gemm:
    """The ``gemm`` of a C projection ``function(x, packed, bias, y, M, N, K, threads, wide)`` on a
    ``PackedWeight``; a nonzero return is its failure to allocate (MemoryError naming ``name``)."""

    def call(
        x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, wide: bool = False
    ) -> torch.Tensor:
        x, out = bf16_operands(name, x, weight.in_features, weight.out_features, bias, wide)
        rows, width = x.shape
        if rows:
            bias_at = None if bias is None else bias.contiguous().data_ptr()
            failed = function(
                x.data_ptr(),
                weight.tiles.data_ptr(),
                bias_at,
                out.data_ptr(),
                rows,
                weight.out_features,
                width,
                team_threads(),
                int(wide),
            )
            if failed:
                raise MemoryError(f"{name}: no memory for its scratch")
        return out

    return call


def attention_covers(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``decode_attention`` takes this head layout: head_dim a multiple of 32 up to 256, and
    at most 8 query heads per kv head."""
    return head_dim % 32 == 0 and head_dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 8


DecodeAttention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class DecodePlan:
    """A decode batch's block table and positions as the attention kernel reads them, and the scratch
    it works in: made once per step (``decode_plan``) and used by every layer, rather than converted
    and allocated again in each."""

    table: torch.Tensor  # [B, MB] int64
    where: torch.Tensor  # [B] int64
    scratch: torch.Tensor  # threads * per_thread floats
    threads: int
    per_thread: int


def decode_plan(block_table: torch.Tensor, positions: torch.Tensor, group: int) -> DecodePlan:
    """The plan of a decode batch whose kv heads each serve ``group`` query heads."""
    table = block_table.to(torch.int64).contiguous()
    where = positions.to(torch.int64).contiguous()
    threads = min(team_threads(), table.shape[0])
    per_thread = group * (int(where.max()) + 1)
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    return DecodePlan(table, where, scratch, threads, per_thread)


def decode_attention() -> DecodeAttention | None:
    """``attend(q [B, heads, hd] bf16, cache [NB, layers, 2, bs, kv_heads, hd] bf16, layer,
    block_table [B, MB] int64, positions [B] int64, plan=None) -> [B, heads, hd]``: each sequence's
    query over positions 0..position of its own blocks, in one call. ``plan``: the batch's
    ``decode_plan``, made once for all the layers of a step. None where the kernels are off."""
    loaded = library()
    return None if loaded is None else paged_decode_attention(loaded.decode_attention_bf16, _check_attention)


AttentionCheck = Callable[[torch.Tensor, torch.Tensor, int, int, int], None]


def paged_decode_attention(function: Callable[..., None], check: AttentionCheck) -> DecodeAttention:
    """The ``attend`` of ``decode_attention`` over a C function of ``DECODE_ATTENTION_ARGS`` (bf16
    here, fp32 in ``disagg.engine.fp32kernel``); ``check(q, cache, heads, kv_heads, head_dim)`` raises
    ValueError on what that function does not take."""

    def call(
        q: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        plan: DecodePlan | None = None,
    ) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        _, layers, _, block_size, kv_heads, _ = cache.shape
        check(q, cache, heads, kv_heads, head_dim)
        plan = plan or decode_plan(block_table, positions, heads // kv_heads)
        if plan.table.shape[0] != batch:  # a plan is made from the very tensors of its step
            raise ValueError("the decode plan is not this batch's")
        q = q.contiguous()
        out = torch.empty_like(q)
        function(
            q.data_ptr(),
            cache.data_ptr(),
            plan.table.data_ptr(),
            plan.where.data_ptr(),
            out.data_ptr(),
            plan.scratch.data_ptr(),
            batch,
            plan.table.shape[1],
            layer,
            layers,
            block_size,
            kv_heads,
            heads // kv_heads,
            head_dim,
            head_dim**-0.5,
            plan.threads,
            plan.per_thread,
        )
        return out

    return call


PromptAttention = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, int], torch.Tensor]


def prompt_attention() -> PromptAttention | None:
    """``attend(q [T, heads, hd] bf16, cache [NB, layers, 2, bs, kv_heads, hd] bf16, layer, blocks [MB]
    int64, start) -> [T, heads, hd]``: a prompt chunk's rows, at positions start .. start + T - 1,
    each over positions 0 .. its own of its sequence's blocks (causal), the chunk's KV already in the
    cache. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.prompt_attention_bf16

    def call(
        q: torch.Tensor, cache: torch.Tensor, layer: int, blocks: torch.Tensor, start: int
    ) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        _, layers, _, block_size, kv_heads, _ = cache.shape
        _check_attention(q, cache, heads, kv_heads, head_dim)
        if -(-(start + rows) // block_size) > blocks.shape[0]:
            raise ValueError("the chunk reaches past its sequence's blocks")
        q = q.contiguous()
        table = blocks.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        group = heads // kv_heads
        threads = team_threads()
        scratch = torch.empty(threads * loaded.prompt_scratch_floats(head_dim, group), dtype=torch.float32)
        function(
            q.data_ptr(),
            cache.data_ptr(),
            table.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            rows,
            start,
            layer,
            layers,
            block_size,
            kv_heads,
            group,
            head_dim,
            head_dim**-0.5,
            threads,
        )
        return out

    return call


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rms_norm() -> RmsNorm | None:
    """``norm(x [T, H] bf16, weight [H] bf16, eps) -> weight * bf16(x * rsqrt(mean(x^2) + eps))``, the
    statistics in fp32, H a multiple of 16. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    return row_norm(loaded.rms_norm_bf16, torch.bfloat16, width_multiple=16, threads=True)


def row_norm(
    function: Callable[..., None], dtype: torch.dtype, width_multiple: int, threads: bool
) -> RmsNorm:
    """The ``norm`` of ``rms_norm`` over a C function taking ``dtype`` rows (bf16 here, fp32 in
    ``disagg.engine.fp32kernel``) and, when ``threads``, the thread count last."""
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]

    def call(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, width = x.shape
        if (
            any(t.dtype != dtype or t.device.type != "cpu" for t in (x, weight))
            or weight.shape != (width,)
            or width % width_multiple
        ):
            raise ValueError(
                f"rms_norm takes {name} rows of a width that is a multiple of {width_multiple}, and a "
                "weight of their width"
            )
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        function(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, eps,
            *([team_threads()] if threads else []),
        )  # fmt: skip
        return out

    return call


SiluMul = Callable[[torch.Tensor], torch.Tensor]


def silu_mul() -> SiluMul | None:
    """``act(gate_up [T, 2 I] bf16) -> silu(gate) * up`` [T, I] in fp32, rounded once; I a multiple of
    16. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.silu_mul_bf16

    def call(gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        if gate_up.dtype != torch.bfloat16 or width % 32:
            raise ValueError("silu_mul takes bf16 rows of gate and up halves, each a multiple of 16 wide")
        gate_up = gate_up.contiguous()
        out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
        function(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, team_threads())
        return out

    return call


RopeCache = Callable[..., torch.Tensor]


def rope_cache() -> RopeCache | None:
    """``rope(qkv [T, (heads + 2 kv_heads) * hd] bf16, cache, layer, positions, slot_block, slot_offset,
    cos, sin, heads, kv_heads) -> q [T, heads, hd]``: a layer's queries rotated, and its keys (rotated)
    and values written into the bf16 cache [blocks, layers, 2, bs, kv_heads, hd] at each row's slot
    (block ``slot_block[t]``, offset ``slot_offset[t]``, int64). ``cos`` / ``sin``: bf16 [positions, hd],
    indexed by ``positions`` (int64). The same bits as ``RotaryTable.apply`` and the cache writes it
    replaces; hd a multiple of 32. None where the kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    return rotary_cache_writer(loaded.rope_cache_bf16, torch.bfloat16, head_dim_multiple=32, threads=True)


def rotary_cache_writer(
    function: Callable[..., None], dtype: torch.dtype, head_dim_multiple: int, threads: bool
) -> RopeCache:
    """The ``rope`` of ``rope_cache`` over a C function taking ``dtype`` tensors (bf16 here, fp32 in
    ``disagg.engine.fp32kernel``) and, when ``threads``, the thread count last."""
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]

    def call(
        qkv: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        positions: torch.Tensor,
        slot_block: torch.Tensor,
        slot_offset: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        rows, width = qkv.shape
        layers, block_size, head_dim = cache.shape[1], cache.shape[3], cache.shape[5]
        if (
            any(t.dtype != dtype or t.device.type != "cpu" for t in (qkv, cache, cos, sin))
            or not cache.is_contiguous()
            or head_dim % head_dim_multiple
            or width != (heads + 2 * kv_heads) * head_dim
            or cache.shape[4] != kv_heads
            or cos.shape[1] != head_dim
            or not 0 <= layer < layers
        ):
            raise ValueError(
                f"rope_cache takes {name} qkv rows, cache and tables of one head layout, head_dim a "
                f"multiple of {head_dim_multiple}"
            )
        for index in (positions, slot_block, slot_offset):
            if index.dtype != torch.int64 or index.shape != (rows,) or not index.is_contiguous():
                raise ValueError("rope_cache takes contiguous int64 positions and slots, one per row")
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(rows, heads, head_dim, dtype=dtype)
        sizes = [rows, heads, kv_heads, head_dim, layers, layer, block_size]
        pointers = [qkv, q, cache, positions, slot_block, slot_offset, cos, sin]
        function(*(t.data_ptr() for t in pointers), *sizes, *([team_threads()] if threads else []))
        return q

    return call


def _check_attention(q: torch.Tensor, cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> None:
    if (
        q.dtype != torch.bfloat16
        or cache.dtype != torch.bfloat16
        or not cache.is_contiguous()
        or not attention_covers(heads, kv_heads, head_dim)
    ):
        raise ValueError("attention kernels take bf16, head_dim a multiple of 32 up to 256, groups up to 8")


def _build_for_make(name: str, supported: bool, why_not: str, source_path: Path) -> None:
    if not supported:
        print(f"{name}: not built, this CPU has no {why_not}")
        return
    try:
        print(f"{name}: {build(source_path=source_path)}")
    except RuntimeError as exc:  # the engine falls back to oneDNN / MKL; make goes on
        print(f"{name}: not built ({exc})")


if __name__ == "__main__":  # `make`: build now rather than at the first engine start
    from disagg.engine import blockcode, fp32kernel

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _build_for_make("bf16 CPU kernels", cpu_supports(), "AVX-512-BF16", SOURCE)
    _build_for_make("block-code kernel", blockcode.cpu_supports(), "AVX2, FMA and F16C", blockcode.SOURCE)
    _build_for_make("fp32 CPU kernels", fp32kernel.cpu_supports(), "AVX2 and FMA", fp32kernel.SOURCE)
    sys.exit(0)
