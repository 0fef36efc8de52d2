"""The reference engine: prefill, batched decode steps, and KV export / import.

Not thread-safe: one thread (the pool's engine loop) drives an Engine. Blocks for a sequence's whole
life (prompt + max_tokens) are taken when it is admitted, so a running sequence never fails for lack
of KV memory; admission raises OutOfBlocks instead, which the caller can queue on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from disagg.config import build
from disagg.engine.backend import BlockUsage, EngineLimits, Exported, Imported
from disagg.engine.checkpoint import ModelConfig, load_config, load_weights
from disagg.engine.device import AUTO, DTYPES, auto_dtype, kernel_threads, pin_cpu, resolve_device
from disagg.engine.errors import BatchFull, InvalidRequest, UnknownSequence
from disagg.engine.fingerprint import checkpoint_id, kv_fingerprint
from disagg.engine.fusion import PLAIN, Pointwise
from disagg.engine.graphs import DEFAULT_BUCKETS, BucketView, GraphConfig, StaticBuffers, StepInputs
from disagg.engine.kvcache import KVCache
from disagg.engine.nullmodel import NullModel
from disagg.engine.paged import reference as paged_reference
from disagg.engine.paged import triton_attention
from disagg.engine.prefix import block_keys
from disagg.engine.replay import CudaGraphs, DecodeGraphs, GraphApi
from disagg.engine.sampling import draw, row_key, sample
from disagg.engine.sequence import (
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    Sequence,
    SequenceState,
    StepOutput,
)
from disagg.engine.transformer import DecodeRows, PromptChunk, Transformer
from disagg.kv.descriptor import Descriptor
from disagg.kv.errors import IncompatibleKV
from disagg.kv.layout import KVLayout

if TYPE_CHECKING:
    from disagg.kv.transport import Transport

log = logging.getLogger(__name__)

# Fills the importer's blocks: called with the pool's [num_blocks, block_bytes] uint8 memory and the
# destination block ids, in sequence order.
BlockFill = Callable[[torch.Tensor, list[int]], None]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance, validated at construction."""

    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"  # or "auto": resolved here, once, by ``disagg.engine.device.auto_dtype``
    # the KV cache's dtype, one per prefill/decode pair (a hand-off refuses any other): unset, the
    # compute dtype; "auto", the same rule as ``dtype`` (so two "auto" pools on one machine agree)
    kv_dtype: str | None = None
    block_size: int = 16
    num_blocks: int | None = None  # default: as many as kv_cache_mb holds
    kv_cache_mb: int = 256
    max_batch_size: int = 64
    max_tokens_cap: int | None = None  # default: the model's context length
    cores: tuple[int, ...] | None = None
    num_threads: int | None = None
    # bf16 on a CPU with AVX-512-BF16: the engine's own kernels for the projections and the paged
    # decode attention (disagg.engine.kernel); fp32 on block-coded weights (a checkpoint converted
    # from a Q4_1 / Q8_0 GGUF) with AVX2: the decode rows' projections read the codes
    # (disagg.engine.blockcode), and norms, rotary and decode attention run as one call each
    # (disagg.engine.fp32kernel). Either way a sequence's output does not depend on its batch
    native_kernels: bool = True
    pack_weights: bool = True  # bf16 on CPU without the kernels: prepack for oneDNN (same bits, faster)
    # reuse the KV of full prompt blocks another prompt computed (``disagg.engine.kvcache``): a prompt
    # sharing a prefix of whole blocks with an earlier one is prefilled from the first block after it
    prefix_cache: bool = False
    # device cuda only: capture the decode step as one CUDA graph per batch bucket at load, replayed
    # each step (disagg.engine.replay); a batch above the largest bucket, or with prompt chunks, runs
    # eagerly. NOT verified on a GPU, so off by default. One KV block is kept aside for padding rows
    cuda_graphs: bool = False
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    # with cuda_graphs: the captured step's pointwise work (norms and residual adds, rotary and the KV
    # write, SiLU x up) compiled by torch.compile into fused kernels (disagg.engine.fusion), compiled
    # while the graphs are captured. NOT verified on a GPU, so off by default
    fuse_pointwise: bool = False
    # benchmarks only: no forward pass, no weights loaded; each step repeats every row's own token
    # (disagg.engine.nullmodel), so a stream's TPOT through Triton is the relay's floor (perf.relay_floor)
    null_compute: bool = False

    def __post_init__(self) -> None:
        """Ranges, and ``auto`` resolved; the types are ``config.build``'s (a config built by hand in
        code is trusted to be typed; ``model_dir`` may be given as text, ``cores`` as a list)."""
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.dtype == AUTO:
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or {AUTO!r}, got {self.dtype!r}")
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)
        elif self.kv_dtype == AUTO:
            object.__setattr__(self, "kv_dtype", auto_dtype(self.device))
        if self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(DTYPES)} or {AUTO!r}, got {self.kv_dtype!r}")
        for name in ("block_size", "kv_cache_mb", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("num_blocks", "max_tokens_cap", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive or unset")
        if self.cores is not None:
            object.__setattr__(self, "cores", tuple(self.cores))
            if not self.cores or any(c < 0 for c in self.cores):
                raise ValueError("cores must be a non-empty list of core numbers")
        object.__setattr__(self, "graph_buckets", tuple(self.graph_buckets))
        try:  # the buckets' own rules (positive, increasing), checked once here
            GraphConfig(self.max_batch_size, 1, self.block_size, 0, self.graph_buckets)
        except ValueError as e:
            raise ValueError(f"graph_buckets: {e}") from None
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, got device {self.device!r}")
        if self.null_compute and self.cuda_graphs:
            raise ValueError("null_compute runs no model: it has no step to capture (cuda_graphs)")
        if self.fuse_pointwise and not self.cuda_graphs:
            raise ValueError("fuse_pointwise fuses the captured decode step's work: it needs cuda_graphs")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strings: bool = False, where: str = "") -> EngineConfig:
        """Build from e.g. JSON or (``strings``) config.pbtxt parameters with :func:`disagg.config.build`:
        typed, unknown keys are errors (``ConfigError``, a ``ValueError``)."""
        return build(cls, data, strings=strings, where=where)


def plan_kv(config: EngineConfig, model: ModelConfig | None = None) -> tuple[KVLayout, int]:
    """The KV block layout and block count an engine with ``config`` will use.

    Callers that supply the pool's memory (a transport) size it with this before building the engine.
    """
    mc = model or load_config(config.model_dir)
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.kv_dtype, config.block_size)
    num_blocks = config.num_blocks or max(1, config.kv_cache_mb * (1 << 20) // layout.block_bytes)
    return layout, num_blocks


class Engine:
    """One model, one KV block pool, any number of sequences."""

    def __init__(
        self,
        config: EngineConfig,
        kv_memory: torch.Tensor | None = None,
        *,
        graph_api: GraphApi | None = None,
    ) -> None:
        """``graph_api``: a test's stand-in for CUDA graphs (``disagg.engine.replay.Recorder``), which
        turns captured decode steps on whatever the device; unset, ``config.cuda_graphs`` decides."""
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            pin_cpu(config.cores, config.num_threads)
        self.model_config: ModelConfig = load_config(config.model_dir)
        self.model = self._model(config)
        mc = self.model_config
        self.kv_layout, num_blocks = plan_kv(config, mc)
        # what this engine's KV means: an importer refuses KV stamped otherwise (engine.fingerprint)
        self.kv_layout = replace(
            self.kv_layout, fingerprint=kv_fingerprint(checkpoint_id(config.model_dir), self.kv_layout)
        )
        if kv_memory is not None and kv_memory.device != self.device:
            raise ValueError("supplied KV memory is not on the engine's device")
        if kv_memory is None and self.device.type != "cpu":
            kv_memory = torch.zeros(
                num_blocks, self.kv_layout.block_bytes, dtype=torch.uint8, device=self.device
            )
        self.kv = KVCache(self.kv_layout, num_blocks, kv_memory, prefix_cache=config.prefix_cache)
        graphs = config.cuda_graphs or graph_api is not None
        if graphs and num_blocks < 2:
            raise ValueError("cuda_graphs needs at least 2 KV blocks (one is kept for padding rows)")
        # padding rows of a captured step write their KV here, a block no sequence ever holds
        scratch = self.kv.allocate(1)[0] if graphs else None
        self._reserved = 0 if scratch is None else 1
        self.max_tokens_cap = min(config.max_tokens_cap or mc.max_context, mc.max_context)
        self._sequences: dict[int, Sequence] = {}
        self._ids = itertools.count(1)
        self._limits = EngineLimits(
            num_blocks - self._reserved,
            config.block_size,
            config.max_batch_size,
            mc.max_context,
            mc.vocab_size,
            fused_steps=True,
        )
        paths = self.describe()
        # a step whose heavy work is the engine's own kernels runs them on the threads, torch on one
        native = self.device.type == "cpu" and self.native_step(paths)
        self._threads: Callable[[], AbstractContextManager[None]] = kernel_threads if native else nullcontext
        # captured at load, so before the pool that builds this engine reports ready
        self._graphs = None if scratch is None else self._capture_graphs(scratch, graph_api)
        log.info(
            "engine ready: %s %s, KV %s (projections: %s, attention: %s) on %s, %d KV blocks of %d tokens"
            ", prefix cache %s",
            mc.model_type,
            config.dtype,
            config.kv_dtype,
            paths["projections"],
            paths["attention"],
            self.device,
            num_blocks,
            config.block_size,
            "on" if config.prefix_cache else "off",
        )

    def _model(self, config: EngineConfig) -> Transformer | NullModel:
        if config.null_compute:
            return NullModel(self.model_config.vocab_size, self.device)
        dtype = DTYPES[config.dtype]
        # a native bf16 CPU engine reads the stored values: block codes are found in fp32 ones
        stored = config.native_kernels and self.device.type == "cpu" and dtype == torch.bfloat16
        weights = load_weights(config.model_dir, self.model_config, None if stored else dtype)
        return Transformer(
            self.model_config,
            weights,
            dtype,
            self.device,
            config.pack_weights,
            config.native_kernels,
            kv_dtype=DTYPES[config.kv_dtype],
        )

    def _capture_graphs(self, scratch: int, api: GraphApi | None) -> DecodeGraphs:
        """Capture the decode step once per batch bucket (``disagg.engine.replay``). NOT verified on
        a GPU. Attention: the Triton-lang paged kernel on CUDA where ``triton`` imports, else the
        torch reference, which reads the whole block table's width every step (slow, but right)."""
        config = GraphConfig(
            self.config.max_batch_size,
            self.kv.blocks_for(self.model_config.max_context),
            self.config.block_size,
            scratch,
            self.config.graph_buckets,
        )
        buffers = StaticBuffers(config, self.device)
        attention = triton_attention() if self.device.type == "cuda" else None
        if attention is None:
            if self.device.type == "cuda":
                log.warning("captured decode steps: no triton package, attention by the torch reference")
            attention = paged_reference
        model, cache = self.model, self.kv.cache
        pointwise = Pointwise.compiled() if self.config.fuse_pointwise else PLAIN

        def step(rows: BucketView) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.inference_mode():
                # [b, V] float32
                logits = model.decode_static(
                    rows.tokens, rows.positions, rows.block_table, rows.seq_lens, cache, attention, pointwise
                )
                # every row sampled on the device; padding rows are greedy
                return logits, draw(logits, rows.temperature, rows.top_k, rows.top_p, rows.keys)

        graphs = DecodeGraphs(buffers, step, api or CudaGraphs(self.device))
        seconds = graphs.capture()
        log.info("captured decode steps for batches %s in %.2f s", graphs.captured, seconds)
        return graphs

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode steps (``cuda_graphs``), or None."""
        return self._graphs

    # ----------------------------------------------------------------- queries

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def close(self) -> None:
        """Nothing to release: the model and the KV memory go with the object."""

    @staticmethod
    def native_step(paths: dict[str, str]) -> bool:
        """Whether the engine's own kernels compute a step's projections and attention (``describe``'s
        ``paths``): torch then has only the small operations between them."""
        return paths["projections"] not in ("torch", "onednn-packed") and paths["attention"] == "kernel"

    def describe(self) -> dict[str, str]:
        plain = {"dtype": self.config.dtype, "kv_dtype": self.config.kv_dtype}
        if isinstance(self.model, NullModel):
            return {**plain, "projections": "null", "attention": "null"}
        head = self.model.lm_head
        layer = self.model.layers[0].gate_up if self.model.layers else head
        if head.native is not None:  # bf16: the kernel, with decode rows on the layers' codes if any
            projections = "kernel" if layer.blocks is None else f"kernel+blocks-{layer.blocks.name}"
        elif layer.blocks is not None:  # the head's code may differ from the layers' (Q8_0 vs Q4_1)
            projections = f"blocks-{layer.blocks.name}"
        elif layer.tiles is not None:
            projections = "fp32-kernel"
        else:
            projections = "onednn-packed" if head.packed else "torch"
        attention = "kernel" if self.model.paged_attention else "torch"
        return {**plain, "projections": projections, "attention": attention}

    def usage(self) -> BlockUsage:
        available, counters = self.kv.available_blocks, self.kv.counters()
        return BlockUsage(
            self.kv.num_blocks - self._reserved - available,
            available,
            self.kv.cached_blocks,
            counters.hits,
            counters.misses,
            counters.evictions,
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_context(self) -> int:
        return self.model_config.max_context

    def active_sequences(self) -> list[int]:
        """Ids of the sequences that decode_step() advances."""
        return [s.seq_id for s in self._sequences.values() if s.decoding]

    def held_sequences(self) -> list[int]:
        return list(self._sequences)

    def sequence_state(self, seq_id: int) -> SequenceState:
        return self._get(seq_id).state()

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest naming the first problem; nothing is allocated."""
        request.validate(self.vocab_size, self.max_tokens_cap, self.max_context)

    def blocks_needed(self, request: Request, *, decode: bool = True) -> int:
        return self._limits.blocks_needed(request, decode=decode)

    # ----------------------------------------------------------------- phases

    def prefill(self, requests: Iterable[Request], *, decode: bool = True) -> list[StepOutput]:
        """Run each prompt whole, sample its first token; outputs in request order.

        With ``decode=False`` (a prefill pool) the sequences are held for export and never join
        decode_step(); their blocks cover only the prompt. All-or-nothing: on InvalidRequest,
        OutOfBlocks or BatchFull nothing is allocated.
        """
        requests = list(requests)
        for request in requests:
            self.validate(request)
        if decode and self._batch_size() + len(requests) > self.config.max_batch_size:
            raise BatchFull(self.config.max_batch_size)
        seqs: list[Sequence] = []
        try:
            for request in requests:
                seqs.append(self._add(request, decode))
        except BaseException:
            for seq in seqs:  # all or nothing
                self.free(seq.seq_id)
            raise
        try:
            outputs = [self.prefill_chunk(seq.seq_id, len(seq.context)) for seq in seqs]
            return [out for out in outputs if out is not None]  # each chunk is a whole prompt: all there
        except BaseException:
            for seq in seqs:  # an engine fault: give everything of this call back
                self.free(seq.seq_id)
            raise

    def start(self, request: Request, *, decode: bool = True) -> int:
        """Admit a request for chunked prefill (``prefill_chunk``): its blocks are taken now, it joins
        the decode batch (``decode=True``) once its whole prompt is prefilled."""
        self.validate(request)
        if decode and self._batch_size() >= self.config.max_batch_size:
            raise BatchFull(self.config.max_batch_size)
        return self._add(request, decode).seq_id

    def prefill_chunk(self, seq_id: int, max_tokens: int) -> StepOutput | None:
        """Prefill the next ``max_tokens`` (at most) prompt tokens of a started sequence, attending to
        the chunks already cached; the first token's output once the prompt is complete, else None.
        On an engine fault the sequence is freed."""
        _, (output,) = self.step([(seq_id, max_tokens)], decode=False)
        return output

    def _add(self, request: Request, decode: bool) -> Sequence:
        """Admit a validated request: take the cached blocks of its prefix (with the prefix cache on),
        then new blocks for the rest of its life; OutOfBlocks leaves nothing taken."""
        context = request.context_token_ids
        keys: list[bytes] = []
        shared: list[int] = []
        if self.config.prefix_cache:
            keys = block_keys(context, self.config.block_size)
            # at least the prompt's last token is computed: it gives the first token's logits
            shared = self.kv.match(keys[: (len(context) - 1) // self.config.block_size])
        try:
            blocks = shared + self.kv.allocate(self.blocks_needed(request, decode=decode) - len(shared))
        except BaseException:
            self.kv.free(shared)
            raise
        resumed = request.generated_token_ids
        seq = Sequence(next(self._ids), request.prompt_token_ids, request.params, blocks, list(resumed))
        seq.resumed = len(resumed)
        seq.prefix_keys, seq.published = keys, len(shared)
        seq.num_cached = len(shared) * self.config.block_size
        seq.decoding = False  # joins decode_step() when its prompt is complete
        seq.joins_decode = decode
        self._sequences[seq.seq_id] = seq
        return seq

    def _batch_size(self) -> int:
        """Sequences in the decode batch or on their way into it."""
        return sum(1 for s in self._sequences.values() if s.decoding or s.joins_decode)

    def decode_step(self) -> list[StepOutput]:
        """Advance every active sequence by one token (one batched forward pass)."""
        outputs, _ = self.step([], decode=True)
        return outputs

    def step(
        self, chunks: list[tuple[int, int]], *, decode: bool = True
    ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        """One forward pass over the decode batch (``decode``) and prompt chunks of started sequences
        (``(seq_id, max_tokens)`` each) together, so the weights are read once for both. Returns the
        decode outputs, and per chunk what ``prefill_chunk`` would (a sequence completing its prompt
        here joins the batch from the next step)."""
        with self._threads():  # sampling included: torch's workers stay off the kernels' cores
            return self._step(chunks, decode)

    def _step(
        self, chunks: list[tuple[int, int]], decode: bool
    ) -> tuple[list[StepOutput], list[StepOutput | None]]:
        batch = [s for s in self._sequences.values() if s.decoding] if decode else []
        seqs = [self._get(seq_id) for seq_id, _ in chunks]
        if len({s.seq_id for s in seqs}) != len(seqs):
            raise InvalidRequest("a sequence appears twice in one step")
        parts = []
        for seq, (_, max_tokens) in zip(seqs, chunks, strict=True):
            context = seq.context
            if seq.decoding or seq.num_cached >= len(context) or max_tokens < 1:
                raise InvalidRequest("sequence has no prompt tokens left to prefill, or the chunk is empty")
            end = min(len(context), seq.num_cached + max_tokens)
            tokens = torch.tensor(context[seq.num_cached : end], dtype=torch.long, device=self.device)
            table = torch.tensor(seq.blocks, dtype=torch.long, device=self.device)
            parts.append(PromptChunk(tokens, seq.num_cached, table, end == len(context)))
        if not batch and not parts:
            return [], []
        if self._graphs is not None and batch and not parts and self._graphs.fits(len(batch)):
            return self._graph_step(batch), []
        try:
            logits, chunk_logits = self.model.step(self._decode_rows(batch), parts, self.kv.cache)
        except BaseException:
            for seq in seqs:  # an engine fault: these sequences cannot continue
                self.free(seq.seq_id)
            raise
        outputs = []
        for row, seq in enumerate(batch):
            seq.num_cached += 1
            outputs.append(self._append(seq, logits[row]))  # type: ignore[index]
        results: list[StepOutput | None] = []
        for seq, part, last in zip(seqs, parts, chunk_logits, strict=True):
            seq.num_cached += part.tokens.shape[0]
            self._publish(seq)
            if last is None:
                results.append(None)
                continue
            seq.decoding = seq.joins_decode
            results.append(self._append(seq, last))
        return outputs, results

    def _publish(self, seq: Sequence) -> None:
        """Offer the prompt blocks a chunk has just completed to the prefix cache."""
        done = min(len(seq.prefix_keys), seq.num_cached // self.config.block_size)
        for index in range(seq.published, done):
            self.kv.publish(seq.blocks[index], seq.prefix_keys[index])
        seq.published = max(seq.published, done)

    def _decode_rows(self, batch: list[Sequence]) -> DecodeRows | None:
        if not batch:
            return None
        tokens, positions, table = self._host_rows(batch)
        return DecodeRows(tokens.to(self.device), positions.to(self.device), table.to(self.device))

    def _host_rows(self, batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode batch's tokens and positions [B] and block table [B, MB] on the host, MB the
        most blocks any row needs this step."""
        width = max(self.kv.blocks_for(s.num_cached + 1) for s in batch)
        table = torch.zeros(len(batch), width, dtype=torch.long)
        for row, seq in enumerate(batch):
            used = seq.blocks[:width]
            table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        tokens = torch.tensor([s.last_token for s in batch], dtype=torch.long)
        positions = torch.tensor([s.num_cached for s in batch], dtype=torch.long)
        return tokens, positions, table

    def _graph_step(self, batch: list[Sequence]) -> list[StepOutput]:
        """The decode batch's step as a replayed graph: a row takes the id sampled in the graph, which
        is what ``sample`` would pick from its logits; a row whose end tokens its min_length still
        bars is sampled here from its logits, those tokens masked."""
        tokens, positions, table = self._host_rows(batch)
        params = [s.params for s in batch]
        inputs = StepInputs(
            tokens,
            positions,
            table,
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([row_key(s.params.seed, len(s.generated)) for s in batch], dtype=torch.long),
        )
        sampled = self._graphs.run(inputs)  # type: ignore[union-attr]
        outputs = []
        for row, seq in enumerate(batch):
            seq.num_cached += 1
            barred = len(seq.generated) < seq.params.min_length and self._stop_ids(seq)
            token = None if barred else sampled.ids[row]
            outputs.append(self._append(seq, sampled.logits[row], token))
        return outputs

    def _stop_ids(self, seq: Sequence) -> set[int]:
        params = seq.params
        ends = {params.end_id} if params.end_id is not None else set(self.model_config.eos_token_ids)
        return ends | set(params.stop_token_ids)

    def _append(self, seq: Sequence, logits: torch.Tensor, token: int | None = None) -> StepOutput:
        """Sample the next token from logits [V] (or take ``token``, sampled already); finish and free
        the sequence when it is done."""
        stops = self._stop_ids(seq)
        step = len(seq.generated)
        if token is None:
            if step < seq.params.min_length and stops:
                logits = logits.clone()
                logits[list(stops)] = float("-inf")
            token = sample(logits.cpu(), seq.params, step)
        seq.generated.append(token)
        reason = None
        if token in stops:
            reason = FINISH_STOP
        elif len(seq.generated) >= seq.params.max_tokens:
            reason = FINISH_LENGTH
        if reason is not None:
            self.free(seq.seq_id)
        return StepOutput(seq.seq_id, token, reason is not None, reason)

    # ----------------------------------------------------------------- lifetime

    def _get(self, seq_id: int) -> Sequence:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence {seq_id}") from None

    def free(self, seq_id: int) -> bool:
        """Drop a sequence and return its blocks; False when it was already gone (idempotent)."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return False
        self.kv.free(seq.blocks)
        return True

    abort = free

    # ----------------------------------------------------------------- KV hand-off

    def export_kv(self, seq_id: int) -> tuple[SequenceState, KVLayout, list[int]]:
        """Describe a held sequence's KV: its state, the layout, and the pool blocks holding it.

        The blocks stay allocated (and must not be written) until ``free(seq_id)``: a transport copies
        them straight out of ``self.kv.memory``. They are the sequence's own: a block it shares with
        another (a cached prefix) is first copied into a private one, since a block is in one live
        lease at most and two hand-offs of one prefix may be in flight at once.
        """
        seq = self._get(seq_id)
        layout = self.kv_layout.with_tokens(seq.num_cached)
        count = layout.num_blocks
        seq.blocks[:count] = self.kv.privatize(seq.blocks[:count])
        return seq.state(), layout, seq.blocks[:count]

    def import_kv(self, state: SequenceState, layout: KVLayout, fill: BlockFill | torch.Tensor) -> int:
        """Admit a sequence prefilled elsewhere; its KV arrives through ``fill``.

        ``fill`` is either a [blocks, block_bytes] uint8 tensor holding the exported blocks in order, or
        a callable that writes them into the given destination blocks of this pool (one copy). On any
        error the blocks are returned and nothing stays admitted.
        """
        mine = self.kv_layout
        if layout.fingerprint != mine.fingerprint:
            raise IncompatibleKV("KV fingerprint is not this engine's (another checkpoint or layout)")
        if layout.with_tokens(0) != mine:
            raise InvalidRequest(
                "KV layout does not match this engine's (layers, heads, dtype or block size)"
            )
        request = Request(state.prompt_token_ids, state.params)
        self.validate(request)
        if layout.num_tokens != len(state.prompt_token_ids) + max(0, len(state.generated_token_ids) - 1):
            raise InvalidRequest("KV token count does not match the sequence state")
        if not state.generated_token_ids or len(state.generated_token_ids) >= state.params.max_tokens:
            raise InvalidRequest("sequence state has no token to continue from, or is already complete")
        if self._batch_size() >= self.config.max_batch_size:
            raise BatchFull(self.config.max_batch_size)
        blocks = self.kv.allocate(self.blocks_needed(request))
        try:
            dest = blocks[: layout.num_blocks]
            if isinstance(fill, torch.Tensor):
                if tuple(fill.shape) != (layout.num_blocks, mine.block_bytes) or fill.dtype != torch.uint8:
                    raise InvalidRequest("KV payload does not match its layout")
                self.kv.memory[torch.tensor(dest, dtype=torch.long)] = fill.to(self.device)
            else:
                fill(self.kv.memory, dest)
        except BaseException:
            self.kv.free(blocks)
            raise
        seq = Sequence(next(self._ids), state.prompt_token_ids, state.params, blocks)
        seq.generated = list(state.generated_token_ids)
        seq.num_cached = layout.num_tokens
        self._sequences[seq.seq_id] = seq
        return seq.seq_id

    # ----------------------------------------------------------------- EngineBackend hand-off

    def export_sequence(self, seq_id: int, transport: Transport) -> Exported:
        """Offer a held sequence's blocks through ``transport`` (they are copied straight out of
        ``self.kv.memory``, so they stay allocated until ``free``)."""
        state, layout, blocks = self.export_kv(seq_id)
        token = transport.export_blocks(self.kv.memory, blocks, layout)
        return Exported(token, transport.verify(token).lease_id, state)

    def import_sequence(
        self, state: SequenceState, descriptor: bytes | Descriptor, transport: Transport
    ) -> Imported:
        """Pull a sequence's KV through ``transport`` into free blocks (one copy), then decode it.
        ``descriptor``: as the pool verified it on submission, or a token still to verify."""
        if not isinstance(descriptor, Descriptor):
            descriptor = transport.verify(descriptor)
        layout = descriptor.layout
        seconds: list[float] = []

        def fill(memory: torch.Tensor, dest: list[int]) -> None:
            seconds.append(transport.import_blocks(descriptor, memory, dest).seconds)

        seq_id = self.import_kv(state, layout, fill)
        return Imported(seq_id, seconds[0] if seconds else 0.0)
