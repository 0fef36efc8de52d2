"""Chunked prefill: a prompt prefilled in chunks, each attending to the chunks already cached, gives the
logits of the whole prompt at once (float32, within the summation-order noise) and the same tokens."""

from __future__ import annotations

import pytest
import torch
from margins import TIE, record_margins

from disagg.engine.errors import InvalidRequest
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request

PROMPT = tuple([1, *range(7, 50)])  # 44 tokens: chunks cross block boundaries (block size 4)


def _agree_until_tie(expected: list[int], got: list[int], margins: list[float]) -> None:
    """Greedy streams agree up to the first step where the reference had a near tie."""
    assert len(got) == len(expected)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        if margins[step] < TIE:
            return
        assert have == want, f"step {step}: {have} != {want} (margin {margins[step]:.2e})"


def _chunked(engine, request, size, decode=True):
    seq_id = engine.start(request, decode=decode)
    outputs = []
    while not outputs or outputs[-1] is None:
        outputs.append(engine.prefill_chunk(seq_id, size))
    assert all(o is None for o in outputs[:-1]) and len(outputs) == -(-len(request.prompt_token_ids) // size)
    return seq_id, outputs[-1]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias", "mistral"])
@pytest.mark.parametrize("size", [1, 3, 4, 5, 16, 43])
def test_chunked_logits_equal_whole_prompt(make_engine, kind, size):
    engine = make_engine(kind)
    seen: list[torch.Tensor] = []
    model = engine.model
    forward = model.step

    def recording(*args, **kwargs):
        decoded, chunks = forward(*args, **kwargs)
        seen.extend(out.clone() for out in chunks if out is not None)
        return decoded, chunks

    model.step = recording
    request = Request(PROMPT, SamplingParams(max_tokens=1))
    engine.prefill([request])
    _chunked(engine, request, size)
    whole, chunked = seen
    assert torch.allclose(whole, chunked, atol=1e-4, rtol=1e-4), (whole - chunked).abs().max()
    top = torch.topk(whole, 2).values
    if top[0] - top[1] >= TIE:
        assert torch.argmax(whole) == torch.argmax(chunked)


def test_chunked_sequence_decodes_and_hands_off_like_a_whole_one(make_engine):
    request = Request(PROMPT, SamplingParams(max_tokens=10, min_length=10))
    engine = make_engine()
    margins = record_margins(engine)
    (out,) = engine.prefill([request])
    expected = [out.token_id]
    while engine.active_sequences():
        expected += [o.token_id for o in engine.decode_step()]
    seq_id, first = _chunked(engine, request, 6)
    tokens = [first.token_id]
    while engine.active_sequences():
        tokens += [o.token_id for o in engine.decode_step()]
    _agree_until_tie(expected, tokens, margins)
    # prefill-only, in chunks, then exported: the importer continues it exactly
    src, dst = make_engine(), make_engine()
    seq_id, first = _chunked(src, request, 7, decode=False)
    assert src.active_sequences() == [], "a prefill-only sequence never joins the batch"
    state, layout, blocks = src.export_kv(seq_id)
    assert layout.num_tokens == len(PROMPT)
    dst_id = dst.import_kv(state, layout, src.kv.memory[torch.tensor(blocks)])
    tokens = [first.token_id]
    while dst.active_sequences():
        tokens += [o.token_id for o in dst.decode_step() if o.seq_id == dst_id]
    _agree_until_tie(expected, tokens, margins)
    src.free(seq_id)
    assert src.kv.free_blocks == src.kv.num_blocks == dst.kv.free_blocks


def test_chunk_misuse_is_refused(make_engine):
    engine = make_engine()
    seq_id = engine.start(Request((1, 2, 3), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequest):
        engine.prefill_chunk(seq_id, 0)
    assert engine.prefill_chunk(seq_id, 8) is not None
    with pytest.raises(InvalidRequest):
        engine.prefill_chunk(seq_id, 1)  # nothing left to prefill


def test_a_fused_step_equals_chunks_then_decode(make_engine):
    """Engine.step: prompt chunks riding in the decode step's forward pass give the tokens of the same
    chunks and decode steps run one after the other (float32, up to the reference's first near tie)."""
    decoding = [Request((1, 9, 10 + i), SamplingParams(max_tokens=12, min_length=12)) for i in range(3)]
    prompt = Request(PROMPT, SamplingParams(max_tokens=4, min_length=4))

    def run(fused: bool) -> dict[int, list[tuple[int, float]]]:
        engine = make_engine()
        streams: dict[int, list[tuple[int, float]]] = {}
        sample = engine._append

        def recording(seq, logits):
            top = torch.topk(logits.float(), 2).values
            out = sample(seq, logits)
            streams.setdefault(seq.seq_id, []).append((out.token_id, float(top[0] - top[1])))
            return out

        engine._append = recording
        engine.prefill(decoding)
        seq_id = engine.start(prompt)
        first = None
        while first is None:
            if fused:
                _, (first,) = engine.step([(seq_id, 16)])
            else:
                first = engine.prefill_chunk(seq_id, 16)
                engine.decode_step()
        while engine.active_sequences():
            engine.decode_step()
        assert engine.kv.free_blocks == engine.kv.num_blocks
        return streams

    expected, got = run(fused=False), run(fused=True)
    assert set(expected) == set(got) and len(expected) == 4
    for seq_id, stream in expected.items():
        _agree_until_tie([t for t, _ in stream], [t for t, _ in got[seq_id]], [m for _, m in stream])


def test_a_fused_step_refuses_misuse(make_engine):
    engine = make_engine()
    seq_id = engine.start(Request((1, 2, 3), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequest):
        engine.step([(seq_id, 1), (seq_id, 1)])
    with pytest.raises(InvalidRequest):
        engine.step([(seq_id, 0)])
    assert engine.step([], decode=True) == ([], [])
