"""A resumed request (``Request.generated_token_ids``): the tokens a failed pool already streamed are
prefilled after the prompt, and the engine continues as if it had generated them itself. In float32
that continuation is the uninterrupted one, greedy and sampled (the draws are seeded from (seed, n)),
up to near ties that the re-computed KV's rounding may flip."""

from __future__ import annotations

import pytest
import torch
from margins import TIE, record_margins

from disagg.engine.errors import InvalidRequest
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import FINISH_LENGTH, FINISH_STOP, Request, SequenceState
from disagg.pool.offline import generate

PROMPT = (1, 5, 9, 13, 17, 21, 25)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_resumed_request_continues_the_uninterrupted_one(make_engine, sampled, cut):
    params = SamplingParams(max_tokens=16, temperature=0.8 if sampled else 0.0, top_k=50, seed=4242)
    reference = make_engine()
    margins = record_margins(reference)
    full, reason = generate(reference, Request(PROMPT, params))
    assert len(full) == 16 and reason == FINISH_LENGTH  # random weights: no end token this early

    rest, rest_reason = generate(make_engine(), Request(PROMPT, params, tuple(full[:cut])))

    assert rest_reason == FINISH_LENGTH
    assert len(rest) == 16 - cut, "max_tokens counts the tokens it was resumed with"
    for step, (want, have) in enumerate(zip(full[cut:], rest, strict=True), start=cut):
        if margins[step] < TIE:
            break
        assert have == want, f"step {step}: {have} != {want}"


def test_resumed_request_that_was_never_cut_matches_exactly_in_chunks(make_engine):
    """Prefilled in chunks of 3 across the prompt/generated boundary: the same continuation."""
    params = SamplingParams(max_tokens=10)
    full, _ = generate(make_engine(), Request(PROMPT, params))
    engine = make_engine()
    seq_id = engine.start(Request(PROMPT, params, tuple(full[:4])))
    outputs = []
    while not outputs or outputs[-1] is None:
        outputs.append(engine.prefill_chunk(seq_id, 3))
    assert len(outputs) == -(-(len(PROMPT) + 4) // 3)
    assert outputs[-1].token_id == full[4]


def test_min_length_counts_the_resumed_tokens(make_engine):
    resumed = (7, 8)
    (unmasked, *_), _ = generate(make_engine(), Request(PROMPT, SamplingParams(max_tokens=8), resumed))

    # make that next token (draw 2) the end token: min_length 3 masks it, min_length 2 does not
    def run(min_length: int) -> tuple[list[int], str | None]:
        params = SamplingParams(8, min_length=min_length, end_id=unmasked)
        return generate(make_engine(), Request(PROMPT, params, resumed))

    held, ended = run(3), run(2)
    assert held[0][0] != unmasked
    assert ended == ([unmasked], FINISH_STOP)


@pytest.mark.parametrize(
    ("generated", "message"),
    [((1, 2, 3, 4), "tokens left to generate"), ((10**6,), "generated token ids")],
)
def test_resumed_request_is_validated(make_engine, generated, message):
    with pytest.raises(InvalidRequest, match=message):
        make_engine().validate(Request(PROMPT, SamplingParams(max_tokens=4), generated))


def test_a_resumed_prefill_exports_a_state_another_engine_imports(make_engine):
    """Prefill-only (a prefill pool): its blocks cover prompt + resumed tokens, and the exported state
    (prompt apart, generated = resumed + first new token) matches the KV it describes."""
    params = SamplingParams(max_tokens=12)
    full, _ = generate(make_engine(), Request(PROMPT, params))
    source, target = make_engine(), make_engine()
    request = Request(PROMPT, params, tuple(full[:6]))
    assert source.blocks_needed(request, decode=False) == -(-(len(PROMPT) + 6) // 4)
    (out,) = source.prefill([request], decode=False)
    state, layout, blocks = source.export_kv(out.seq_id)
    assert state == SequenceState(PROMPT, tuple(full[:7]), params)
    seq_id = target.import_kv(state, layout, source.kv.memory[torch.tensor(blocks)].clone())
    tokens = [target.decode_step()[0].token_id for _ in range(12 - 7)]
    assert tokens == full[7:] and seq_id not in target.active_sequences()
