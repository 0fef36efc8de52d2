"""The null engine (``EngineConfig.null_compute``): no weights loaded, no forward pass; each step repeats
a row's own token, through the engine's real blocks, sampling, stop rules and hand-off, so a served
stream through it costs the relay alone (``perf.relay_floor``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import disagg.engine.engine as engine_module
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import FINISH_LENGTH, FINISH_STOP, Request
from disagg.pool.instance import PoolConfig
from disagg.pool.offline import generate

PROMPT = (1, 7, 9, 11, 13)


@pytest.fixture
def null_engine(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Engine]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a null engine loaded the checkpoint's weights")

    monkeypatch.setattr(engine_module, "load_weights", refuse)
    return lambda **settings: make_engine(null_compute=True, **settings)


def test_a_stream_repeats_its_prompts_last_token_to_its_length(null_engine: Callable[..., Engine]) -> None:
    engine = null_engine()
    tokens, reason = generate(engine, Request(PROMPT, SamplingParams(max_tokens=6)))
    assert tokens == [13] * 6 and reason == FINISH_LENGTH
    assert engine.kv.free_blocks == engine.kv.num_blocks  # the finished sequence gave its blocks back
    assert engine.describe()["projections"] == engine.describe()["attention"] == "null"


def test_a_batch_keeps_each_rows_own_token(null_engine: Callable[..., Engine]) -> None:
    engine = null_engine()
    params = SamplingParams(max_tokens=4)
    first = engine.prefill([Request((1, 2, 30), params), Request((1, 40), params)])
    got = {out.seq_id: [out.token_id] for out in first}
    while engine.active_sequences():
        for out in engine.decode_step():
            got[out.seq_id].append(out.token_id)
    assert sorted(got.values()) == [[30] * 4, [40] * 4]


def test_the_stop_rules_apply_to_its_tokens(null_engine: Callable[..., Engine]) -> None:
    engine = null_engine()
    tokens, reason = generate(engine, Request(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(13,))))
    assert tokens == [13] and reason == FINISH_STOP


def test_a_handed_off_sequence_continues_on_a_null_decoder(null_engine: Callable[..., Engine]) -> None:
    prefill, decode = null_engine(), null_engine()
    (out,) = prefill.prefill([Request(PROMPT, SamplingParams(max_tokens=5))], decode=False)
    state, layout, blocks = prefill.export_kv(out.seq_id)
    seq_id = decode.import_kv(state, layout, prefill.kv.memory[torch.tensor(blocks)])
    prefill.free(out.seq_id)
    tokens = list(state.generated_token_ids)
    while decode.active_sequences():
        tokens += [o.token_id for o in decode.decode_step() if o.seq_id == seq_id]
    assert tokens == [13] * 5


def test_it_captures_no_graphs(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="null_compute"):
        EngineConfig(model_dir=checkpoint("llama-gqa"), device="cuda", cuda_graphs=True, null_compute=True)


def test_a_pool_parameter_switches_it_on(tiny_model_dir: Path) -> None:
    params = {"role": "decode", "model_dir": str(tiny_model_dir), "null_compute": "true"}
    assert PoolConfig.from_dict(params, strings=True).engine.null_compute is True
    assert (
        PoolConfig.from_dict({**params, "null_compute": "false"}, strings=True).engine.null_compute is False
    )
