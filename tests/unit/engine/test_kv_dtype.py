"""kv_dtype: the KV cache has a dtype of its own, one per prefill/decode pair, so a pool computing in
fp32 can hand its KV, rounded to bf16, to a pool computing in bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from disagg.engine.device import auto_dtype
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.errors import InvalidRequest
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.kv.errors import IncompatibleKV
from disagg.pool.offline import generate

PROMPT = (1, *range(20, 47))  # 27 tokens: 7 blocks of 4, the last one partial


def handoff(src: Engine, dst: Engine, request: Request) -> list[int]:
    """Prefill on ``src``, move the KV block by block into ``dst``, decode there to the end."""
    (out,) = src.prefill([request], decode=False)
    state, layout, blocks = src.export_kv(out.seq_id)

    def fill(memory: torch.Tensor, dest: list[int]) -> None:
        for s, d in zip(blocks, dest, strict=True):
            memory[d].copy_(src.kv.memory[s])

    seq_id = dst.import_kv(state, layout, fill)
    src.free(out.seq_id)
    tokens = list(state.generated_token_ids)
    while dst.active_sequences():
        tokens += [o.token_id for o in dst.decode_step() if o.seq_id == seq_id]
    assert dst.kv.free_blocks == dst.kv.num_blocks
    return tokens


def test_kv_dtype_defaults_to_the_compute_dtype_and_auto_follows_the_dtype_rule(tmp_path) -> None:
    def config(**settings: object) -> EngineConfig:
        return EngineConfig(model_dir=tmp_path, **settings)

    assert config(dtype="float32").kv_dtype == "float32"
    assert config(dtype="bfloat16").kv_dtype == "bfloat16"
    assert config(dtype="float32", kv_dtype="bfloat16").kv_dtype == "bfloat16"
    assert (
        config(dtype="float32", kv_dtype="auto").kv_dtype == auto_dtype("cpu") == config(dtype="auto").dtype
    )
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        config(kv_dtype="int8")


def test_the_cache_holds_the_computed_keys_and_values_rounded_to_the_kv_dtype(make_engine) -> None:
    """Layer 0's keys and values depend only on the embeddings, so a bf16 cache of an fp32 engine
    holds exactly the fp32 cache's values rounded to bf16 (deeper layers attend to rounded KV)."""
    request = Request(PROMPT, SamplingParams(max_tokens=2))
    caches = []
    for kv_dtype in ("float32", "bfloat16"):
        engine = make_engine(dtype="float32", kv_dtype=kv_dtype)
        assert engine.kv.cache.dtype == getattr(torch, kv_dtype)
        assert engine.describe()["kv_dtype"] == kv_dtype and engine.describe()["dtype"] == "float32"
        (out,) = engine.prefill([request], decode=False)
        _, layout, blocks = engine.export_kv(out.seq_id)
        assert layout.dtype == kv_dtype
        layer0 = engine.kv.cache[torch.tensor(blocks), 0]  # [blocks, 2, bs, nkv, hd]
        caches.append(layer0.transpose(0, 1).flatten(1, 2)[:, : len(PROMPT)])  # [2, T, nkv, hd]
    full, rounded = caches
    assert torch.equal(rounded, full.to(torch.bfloat16))
    assert not torch.equal(rounded.float(), full)  # the rounding is real: fp32 values are not bf16


def test_a_pair_sharing_a_bf16_cache_continues_exactly_across_the_handoff(make_engine) -> None:
    """fp32 compute with a bf16 cache on both sides: the hand-off moves the cache's bytes as they
    are, so the tokens equal one engine's with the same settings, greedy and sampled."""
    for params in (SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.9, seed=5)):
        request = Request(PROMPT, params)
        expected = generate(make_engine(dtype="float32", kv_dtype="bfloat16"), request)[0]
        src, dst = (make_engine(dtype="float32", kv_dtype="bfloat16") for _ in range(2))
        assert handoff(src, dst, request) == expected


def test_an_fp32_prefill_hands_bf16_kv_to_a_bf16_decode_pool(make_engine) -> None:
    """Different compute dtypes, one KV dtype: the import is accepted, the decode pool reads the
    cache with its own attention path (the bf16 kernels where the CPU has them), and the sequence
    runs to its length."""
    request = Request(PROMPT, SamplingParams(max_tokens=16, min_length=16))
    src = make_engine(dtype="float32", kv_dtype="bfloat16")
    dst = make_engine(dtype="bfloat16")
    tokens = handoff(src, dst, request)
    assert len(tokens) == 16
    assert tokens[0] == generate(make_engine(dtype="float32", kv_dtype="bfloat16"), request)[0][0]


def test_a_decode_pool_refuses_kv_of_another_dtype(make_engine) -> None:
    src, dst = make_engine(dtype="float32"), make_engine(dtype="float32", kv_dtype="bfloat16")
    (out,) = src.prefill([Request(PROMPT, SamplingParams(max_tokens=4))], decode=False)
    state, layout, blocks = src.export_kv(out.seq_id)
    with pytest.raises(IncompatibleKV, match="fingerprint"):  # the KV dtype is part of it
        dst.import_kv(state, layout, src.kv.memory[torch.tensor(blocks)])
    with pytest.raises(InvalidRequest, match="dtype"):  # and the layout is checked as well
        dst.import_kv(
            state, replace(layout, fingerprint=dst.kv_layout.fingerprint), src.kv.memory[torch.tensor(blocks)]
        )
    assert dst.kv.free_blocks == dst.kv.num_blocks and not dst.active_sequences()
