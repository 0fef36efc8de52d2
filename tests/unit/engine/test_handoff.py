"""export_kv / import_kv: a sequence prefilled in one process continues exactly in another."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import pytest
import torch

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.errors import InvalidRequest
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.kv.errors import IncompatibleKV
from disagg.kv.layout import KVLayout
from disagg.pool.offline import generate

PROMPTS = [(1, 7, 9, 11), (1, *range(20, 63))]


def _prefill_and_export(model_dir: str, request_dicts: list[dict], conn) -> None:
    """Child process: prefill without decoding, ship state + layout + raw blocks over a pipe."""
    engine = Engine(EngineConfig(model_dir=model_dir, num_blocks=64, block_size=4))
    for item in request_dicts:
        state = SequenceState.from_dict(item)
        (out,) = engine.prefill([Request(state.prompt_token_ids, state.params)], decode=False)
        state, layout, blocks = engine.export_kv(out.seq_id)
        payload = engine.kv.memory[torch.tensor(blocks)].numpy().tobytes()
        conn.send((state.to_dict(), layout.to_dict(), payload))
        engine.free(out.seq_id)
    conn.send(engine.kv.free_blocks == engine.kv.num_blocks)
    conn.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_cross_process_handoff_continues_exactly(checkpoint, make_engine, sampled):
    model_dir = checkpoint("llama-gqa")
    params = SamplingParams(max_tokens=24, temperature=0.9 if sampled else 0.0, top_k=40, seed=77)
    requests = [Request(p, params) for p in PROMPTS]
    expected = [generate(make_engine(), r)[0] for r in requests]

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    wire = [SequenceState(r.prompt_token_ids, (), r.params).to_dict() for r in requests]
    proc = ctx.Process(target=_prefill_and_export, args=(str(model_dir), wire, child))
    proc.start()
    decoder = make_engine()
    got: dict[int, list[int]] = {}
    for _ in requests:
        state_dict, layout_dict, payload = parent.recv()
        state = SequenceState.from_dict(state_dict)
        layout = KVLayout.from_dict(layout_dict)
        blocks = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(layout.num_blocks, -1)
        seq_id = decoder.import_kv(state, layout, blocks)
        got[seq_id] = list(state.generated_token_ids)
    exporter_clean = parent.recv()
    proc.join(timeout=60)
    assert proc.exitcode == 0 and exporter_clean
    while decoder.active_sequences():
        for out in decoder.decode_step():
            got[out.seq_id].append(out.token_id)
    assert list(got.values()) == expected
    assert decoder.kv.free_blocks == decoder.kv.num_blocks


def test_import_through_callable_single_copy(make_engine):
    request = Request((1, 5, 6, 7, 8, 9), SamplingParams(max_tokens=12))
    expected = generate(make_engine(), request)[0]
    src = make_engine()
    (out,) = src.prefill([request], decode=False)
    state, layout, src_blocks = src.export_kv(out.seq_id)

    def fill(memory: torch.Tensor, dest: list[int]) -> None:
        for s, d in zip(src_blocks, dest, strict=True):  # block to block, no staging buffer
            memory[d].copy_(src.kv.memory[s])

    dst = make_engine()
    seq_id = dst.import_kv(state, layout, fill)
    tokens = list(state.generated_token_ids)
    while dst.active_sequences():
        tokens += [o.token_id for o in dst.decode_step() if o.seq_id == seq_id]
    assert tokens == expected
    src.free(out.seq_id)
    assert src.kv.free_blocks == src.kv.num_blocks


def test_failed_fill_returns_blocks(make_engine):
    src = make_engine()
    (out,) = src.prefill([Request((1, 2, 3), SamplingParams(max_tokens=5))], decode=False)
    state, layout, _ = src.export_kv(out.seq_id)
    dst = make_engine()

    def broken(memory, dest):
        raise OSError("link down")

    with pytest.raises(OSError):
        dst.import_kv(state, layout, broken)
    assert dst.kv.free_blocks == dst.kv.num_blocks and not dst.held_sequences()


def test_import_refuses_mismatched_layout_and_state(make_engine):
    src = make_engine()
    (out,) = src.prefill([Request((1, 2, 3, 4, 5), SamplingParams(max_tokens=5))], decode=False)
    state, layout, blocks = src.export_kv(out.seq_id)
    payload = src.kv.memory[torch.tensor(blocks)]
    dst = make_engine(block_size=8)
    with pytest.raises(IncompatibleKV, match="fingerprint"):  # the block size is part of it
        dst.import_kv(state, layout, payload)
    with pytest.raises(InvalidRequest, match="layout"):  # and the layout itself is checked too
        dst.import_kv(state, replace(layout, fingerprint=dst.kv_layout.fingerprint), payload)
    dst = make_engine()
    with pytest.raises(InvalidRequest, match="token count"):
        dst.import_kv(state, layout.with_tokens(layout.num_tokens + 1), payload)
    with pytest.raises(InvalidRequest, match="payload"):
        dst.import_kv(state, layout, payload[:, :-1])
    assert dst.kv.free_blocks == dst.kv.num_blocks


def test_prefill_only_sequences_do_not_decode(make_engine):
    engine = make_engine()
    (out,) = engine.prefill([Request((1, 2, 3), SamplingParams(max_tokens=5))], decode=False)
    assert engine.decode_step() == [] and engine.held_sequences() == [out.seq_id]
    held = engine.kv.used_blocks
    assert held == engine.kv.blocks_for(3), "a prefill pool holds only the prompt's blocks"
