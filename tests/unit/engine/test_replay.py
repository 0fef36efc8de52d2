"""Captured decode steps (disagg.engine.replay) on CPU, through ``Recorder``, the stand-in for CUDA
graphs that records each capture and replay and replays by running the step again: the control flow
(every bucket captured at load, a replay per decode step, eager steps above the largest bucket or with
prompt chunks) and the tokens, which equal the eager engine's. NOT a test of CUDA graphs themselves:
those run only on a GPU (perf/gpu_check.sh, step graph_bench)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.graphs import GraphConfig, StaticBuffers, StepInputs
from disagg.engine.paged import reference
from disagg.engine.params import SamplingParams
from disagg.engine.replay import CudaGraphs, DecodeGraphs, Recorder
from disagg.engine.sequence import Request
from disagg.pool.offline import OfflineRun

# ----------------------------------------------------------------- the runner alone


def _runner(max_batch: int = 8, buckets: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[DecodeGraphs, Recorder]:
    config = GraphConfig(max_batch, max_blocks=4, block_size=4, scratch_block=0, buckets=buckets)
    buffers = StaticBuffers(config)

    def step(rows):  # "logits": each row's token one-hot, scaled by its length; ids: argmax
        logits = torch.nn.functional.one_hot(rows.tokens, 32).float() * rows.seq_lens[:, None]
        return logits, logits.argmax(-1)

    recorder = Recorder()
    return DecodeGraphs(buffers, step, recorder), recorder


def _rows(tokens: list[int]) -> StepInputs:
    n = len(tokens)
    return StepInputs(
        torch.tensor(tokens),
        torch.full((n,), 2),
        torch.ones(n, 1, dtype=torch.long),
        torch.zeros(n),
        torch.zeros(n, dtype=torch.long),
        torch.ones(n),
        torch.zeros(n, dtype=torch.long),
    )


def test_every_bucket_is_captured_the_largest_first_before_any_replay():
    graphs, recorder = _runner()
    assert graphs.captured == ()
    seconds = graphs.capture()
    assert seconds >= 0 and graphs.capture_seconds == seconds
    assert recorder.events == [("capture", 8), ("capture", 4), ("capture", 2), ("capture", 1)]
    assert graphs.captured == (1, 2, 4, 8)


def test_a_step_replays_its_buckets_graph_and_drops_the_padding_rows():
    graphs, recorder = _runner()
    graphs.capture()
    recorder.events.clear()
    out = graphs.run(_rows([5, 9, 17]))
    assert recorder.events == [("replay", 4)]
    assert out.bucket == 4 and out.ids == [5, 9, 17]  # the padding row's id 0 is dropped
    assert out.logits.shape == (3, 32) and out.logits[1, 9] == 3  # seq_len = position + 1
    out = graphs.run(_rows([3]))
    assert recorder.events[-1] == ("replay", 1) and out.ids == [3]
    assert graphs.replays == 2


def test_a_batch_above_the_largest_bucket_is_left_to_run_eagerly():
    graphs, _ = _runner(max_batch=16, buckets=(1, 2, 4))
    graphs.capture()
    assert graphs.fits(4) and graphs.eager_steps == 0
    assert not graphs.fits(5) and graphs.eager_steps == 1
    with pytest.raises(ValueError, match="rows"):
        graphs.run(_rows(list(range(5))))


def test_a_replay_before_capture_is_refused():
    graphs, _ = _runner()
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.run(_rows([1]))


def test_cuda_graphs_are_refused_off_a_cuda_device():
    with pytest.raises(ValueError, match="device"):
        CudaGraphs(torch.device("cpu"))


# ----------------------------------------------------------------- the engine with captured steps


@pytest.fixture
def graph_engine(checkpoint: Callable[[str], Path]) -> Callable[..., Engine]:
    """An engine whose decode steps are captured through a Recorder (``recorder``, or a new one)."""

    def make(recorder: Recorder | None = None, **settings: object) -> Engine:
        settings.setdefault("num_blocks", 256)
        settings.setdefault("block_size", 4)
        settings.setdefault("native_kernels", False)
        config = EngineConfig(model_dir=checkpoint("llama-gqa"), **settings)
        return Engine(config, graph_api=recorder or Recorder())

    return make


def _requests(n: int, seed: int = 0) -> list[Request]:
    """Greedy, sampled, and greedy with a min_length (sampled on the host while it masks stops)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple([1] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))])
        kind = i % 3
        params = SamplingParams(
            max_tokens=rng.randrange(6, 20),
            temperature=0.8 if kind == 1 else 0.0,
            top_k=40 if kind == 1 else 0,
            top_p=0.9 if kind == 1 else 1.0,
            seed=100 + i,
            min_length=4 if kind == 2 else 0,
        )
        out.append(Request(prompt, params))
    return out


def _staggered(engine, requests: list[Request]) -> list[list[int]]:
    """One request joins every other step, so steps mix prompt chunks with decode rows, and the
    batch grows and shrinks across buckets."""
    run = OfflineRun(engine)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    pending = list(enumerate(requests))
    step = 0
    while pending or not run.idle:
        if pending and step % 2 == 0:
            run.submit(*pending.pop(0))
        for event in run.step():
            tokens[event.key].append(event.token_id)
        step += 1
    return [tokens[i] for i in range(len(requests))]


def test_captured_steps_give_the_eager_engines_tokens(make_engine, graph_engine):
    requests = _requests(9)
    eager = _staggered(make_engine(native_kernels=False, max_batch_size=8), requests)
    recorder = Recorder()
    engine = graph_engine(recorder, max_batch_size=8)
    captures = [e for e in recorder.events if e[0] == "capture"]
    assert captures == [("capture", b) for b in (8, 4, 2, 1)], "every bucket is captured at load"
    assert len(recorder.events) == 4
    got = _staggered(engine, requests)
    assert got == eager
    replayed = {size for kind, size in recorder.events if kind == "replay"}
    assert len(replayed) >= 3, f"the batch should cross buckets, replayed only {replayed}"
    assert engine.graphs is not None and engine.graphs.replays == sum(
        e[0] == "replay" for e in recorder.events
    )
    assert engine.usage().used == 0 and engine.usage().free == engine.limits.num_blocks


def test_a_batch_above_the_largest_bucket_runs_eagerly_with_the_same_tokens(make_engine, graph_engine):
    requests = [Request((1, 7 + i, 30 + i), SamplingParams(max_tokens=6)) for i in range(5)]

    def decode_all(engine) -> list[list[int]]:
        outs = engine.prefill(requests)
        tokens = {o.seq_id: [o.token_id] for o in outs}
        while engine.active_sequences():
            for out in engine.decode_step():
                tokens[out.seq_id].append(out.token_id)
        return [tokens[o.seq_id] for o in outs]

    eager = decode_all(make_engine(native_kernels=False))
    recorder = Recorder()
    engine = graph_engine(recorder, graph_buckets=(1, 2, 4))
    assert decode_all(engine) == eager
    assert engine.graphs.eager_steps == 5  # five rows fit no bucket: every decode step ran eagerly
    assert not any(kind == "replay" for kind, _ in recorder.events)


def test_padding_rows_write_only_the_scratch_block(graph_engine):
    engine = graph_engine()
    graphs = engine.graphs
    scratch = graphs.config.scratch_block
    outs = engine.prefill([Request((1, 5, 6, 7, 8, 9), SamplingParams(max_tokens=4)) for _ in range(3)])
    others = torch.ones(engine.kv.num_blocks, dtype=torch.bool)
    others[scratch] = False
    before = engine.kv.memory[others].clone()
    engine.decode_step()  # three rows padded to a bucket of four
    changed = (engine.kv.memory[others] != before).any(dim=1).nonzero().flatten().tolist()
    blocks = [b for b in range(engine.kv.num_blocks) if b != scratch]
    touched = {blocks[i] for i in changed}
    owned = {b for o in outs for b in engine._get(o.seq_id).blocks}
    assert touched and touched <= owned, "only the real rows' own blocks take new KV"
    assert scratch not in owned


def test_the_scratch_block_is_kept_out_of_the_pool(make_engine, graph_engine):
    engine = graph_engine(num_blocks=32)
    assert engine.limits.num_blocks == 31
    usage = engine.usage()
    assert (usage.used, usage.free) == (0, 31)
    plain = make_engine(native_kernels=False, num_blocks=32)
    assert plain.limits.num_blocks == 32 and plain.graphs is None  # nothing changes without graphs


def test_the_static_decode_step_equals_the_eager_step(make_engine):
    """decode_static (what a graph holds) against Transformer.step's decode logits, real rows only."""
    engine = make_engine(native_kernels=False)
    outs = engine.prefill([Request((1, *range(3, 3 + n)), SamplingParams(max_tokens=4)) for n in (2, 9, 20)])
    seqs = [engine._get(o.seq_id) for o in outs]
    tokens, positions, table = engine._host_rows(seqs)
    cache_before = engine.kv.cache.clone()
    eager, _ = engine.model.step(engine._decode_rows(seqs), [], engine.kv.cache)
    engine.kv.cache.copy_(cache_before)
    wide = torch.zeros(3, 128, dtype=torch.long)
    wide[:, : table.shape[1]] = table
    static = engine.model.decode_static(tokens, positions, wide, positions + 1, engine.kv.cache, reference)
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (dict(cuda_graphs=True), "cuda_graphs"),
        (dict(graph_buckets=(4, 2)), "graph_buckets"),
        (dict(graph_buckets=()), "graph_buckets"),
        (dict(graph_buckets=(0, 1)), "graph_buckets"),
        (dict(fuse_pointwise=True), "fuse_pointwise"),
    ],
)
def test_engine_config_refuses_bad_graph_settings(tmp_path, settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model_dir=tmp_path, **settings)


def test_graph_settings_come_from_config_parameters(tmp_path):
    config = EngineConfig.from_dict({"model_dir": str(tmp_path), "graph_buckets": "1,2,8"}, strings=True)
    assert config.graph_buckets == (1, 2, 8) and config.cuda_graphs is False
