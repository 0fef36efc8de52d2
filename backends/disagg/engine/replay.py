"""Captured decode steps: one CUDA graph per batch bucket, captured at load and replayed each step.

NOT verified on a GPU: written against torch's documented CUDA-graph API (``torch.cuda.CUDAGraph``,
``torch.cuda.graph`` with a memory pool shared by every bucket's graph, warm-up on a side stream
before capture) and tested on CPU only, through ``Recorder``, a stand-in that records each capture
and replay and replays by running the step again. ``perf/gpu_check.sh`` (step ``graph_bench``) is
the run that would verify it.

The bookkeeping (buckets, padding, static buffers) is ``disagg.engine.graphs``; this module holds
the control flow only:

- ``DecodeGraphs.capture`` runs at engine load, before the pool reports ready: every bucket's graph,
  the largest first (smaller ones then reuse its pool's memory);
- ``DecodeGraphs.run`` loads a step's rows into the static buffers, replays its bucket's graph
  (sampling included, ``disagg.engine.sampling.draw``) and reads back the sampled ids in one copy;
  a batch above the largest bucket is the caller's to run eagerly (``fits`` says which).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from disagg.engine.graphs import BucketView, StaticBuffers, StepInputs, unpad

# a step as captured: the bucket's static rows -> (logits [b, V] float32, sampled ids [b] int64)
StepFn = Callable[[BucketView], tuple[torch.Tensor, torch.Tensor]]
Outputs = tuple[torch.Tensor, torch.Tensor]


class GraphApi(Protocol):
    """How a step becomes a replayable graph: ``CudaGraphs`` on a GPU, ``Recorder`` in tests."""

    def capture(self, run: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """Capture ``run`` (after warming it up); returns the replay and the static outputs a replay
        rewrites in place."""
        ...


class CudaGraphs:
    """torch's CUDA graphs on one device, every graph in one shared memory pool. NOT verified on a
    GPU (see the module docstring)."""

    WARMUP = 2  # eager runs before a capture: library handles, allocator state, kernels compiled

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for CUDA graphs, got {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(self.WARMUP):
                run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # one pool for every bucket: a later capture may place its tensors, outputs included, in
        # memory an earlier graph uses for its intermediates, so a replay may overwrite another
        # bucket's outputs. Safe here: replays never overlap (one engine loop) and a step's outputs
        # are read (``DecodeGraphs.run``'s caller) before the next replay of any bucket
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = run()
        return graph.replay, outputs


@dataclass
class Recorder:
    """A stand-in for CUDA graphs on CPU: ``capture`` runs the step once and records it; a replay runs
    it again and copies its results into the captured outputs, as a graph rewrites its static
    outputs. ``events`` lists ("capture", bucket) and ("replay", bucket) in order."""

    events: list[tuple[str, int]] = field(default_factory=list)

    def capture(self, run: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        outputs = run()
        size = int(outputs[1].shape[0])
        self.events.append(("capture", size))

        def replay() -> None:
            self.events.append(("replay", size))
            with torch.inference_mode():  # the outputs may be inference tensors, as the step made them
                for static, fresh in zip(outputs, run(), strict=True):
                    static.copy_(fresh)

        return replay, outputs


@dataclass(frozen=True)
class Sampled:
    """A replayed step's real rows: logits [n, V] float32 (on the device, for rows sampled on the
    host) and the ids sampled in the graph, read back in one copy. ``logits`` is a view of the
    graph's static output: valid until the next ``run``, which may overwrite it (read what is needed
    before then)."""

    logits: torch.Tensor
    ids: list[int]
    bucket: int


class DecodeGraphs:
    """One captured decode step per bucket of ``config``, over ``buffers``."""

    def __init__(self, buffers: StaticBuffers, step: StepFn, api: GraphApi) -> None:
        self.config = buffers.config  # the buckets are the ones the buffers are sized by
        self.buffers = buffers
        self._step = step
        self._api = api
        self._graphs: dict[int, tuple[Callable[[], None], Outputs]] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        self.eager_steps = 0  # steps the caller ran eagerly because no bucket held them (``fits``)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self) -> float:
        """Capture every bucket's graph, the largest first; returns the seconds it took. The buffers
        hold padding rows only, so a capture writes KV to the scratch block alone."""
        start = time.perf_counter()
        for size in sorted(self.config.sizes, reverse=True):
            view = self.buffers.view(size)
            self._graphs[size] = self._api.capture(lambda view=view: self._step(view))
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def fits(self, rows: int) -> bool:
        """Whether a batch of ``rows`` has a captured bucket (else the caller runs it eagerly)."""
        fits = self.config.bucket_for(rows) is not None
        if not fits:
            self.eager_steps += 1
        return fits

    def run(self, inputs: StepInputs) -> Sampled:
        """Replay the step for ``inputs``' rows, padded to their bucket; padding rows dropped."""
        if not self._graphs:
            raise RuntimeError("decode graphs used before capture")
        size = self.buffers.load(inputs)
        replay, (logits, ids) = self._graphs[size]
        replay()
        self.replays += 1
        rows = inputs.rows
        return Sampled(unpad(logits, rows), unpad(ids, rows).tolist(), size)
