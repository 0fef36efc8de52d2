"""The prefix cache: the hash chain, the block pool's reference counts, states and eviction, and the
engine prefilling a prompt from the cached blocks of its prefix, with the output of a full prefill."""

from __future__ import annotations

import random

import pytest
import torch
from margins import TIE, record_margins

from disagg.engine.errors import OutOfBlocks
from disagg.engine.kvcache import KVCache
from disagg.engine.params import SamplingParams
from disagg.engine.prefix import block_keys
from disagg.engine.sequence import Request
from disagg.kv.layout import KVLayout

BS = 4  # the engine factory's block size

# ---- the hash chain ---------------------------------------------------------------------------------


def test_keys_name_every_token_up_to_each_full_block():
    a = block_keys(list(range(10)), 4)
    assert len(a) == 2, "the partial third block has no key"
    assert all(len(k) == 16 for k in a)
    assert block_keys([*range(8), 99, 98], 4) == a, "tokens after the last full block do not count"
    b = block_keys([0, 1, 2, 3, 4, 5, 6, 99], 4)
    assert b[0] == a[0] and b[1] != a[1], "a change in block 1 changes its key, not block 0's"
    c = block_keys([7, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[0] != a[0] and c[1] != a[1], "a change in block 0 changes every later key (the chain)"
    moved = block_keys([4, 5, 6, 7, 4, 5, 6, 7], 4)
    assert moved[0] != moved[1], "the same tokens at another position are another prefix"
    assert block_keys(list(range(12)), 4, limit=1) == a[:1]
    assert block_keys(list(range(12)), 4, limit=0) == []
    with pytest.raises(ValueError):
        block_keys([1], 0)


# ---- the block pool ---------------------------------------------------------------------------------


def _pool(num_blocks: int = 8, prefix_cache: bool = True) -> KVCache:
    return KVCache(KVLayout(1, 1, 2, "float32", BS), num_blocks, prefix_cache=prefix_cache)


def _exact(kv: KVCache) -> None:
    assert kv.used_blocks + kv.cached_blocks + kv.free_blocks == kv.num_blocks
    assert kv.available_blocks == kv.cached_blocks + kv.free_blocks


def test_a_published_block_is_shared_then_cached_then_taken_again():
    kv = _pool()
    keys = block_keys(range(12), BS)
    blocks = kv.allocate(3)
    assert [kv.publish(b, k) for b, k in zip(blocks, keys, strict=True)] == [True] * 3
    again = kv.match(keys)
    assert again == blocks and kv.used_blocks == 3, "shared: the same blocks, one more reference each"
    kv.free(blocks)
    assert kv.used_blocks == 3 and kv.cached_blocks == 0, "the second holder keeps them used"
    kv.free(again)
    assert (kv.used_blocks, kv.cached_blocks, kv.free_blocks) == (0, 3, 5)
    _exact(kv)
    assert kv.match(keys[:2] + block_keys(range(100, 104), BS)) == blocks[:2], "the longest run"
    counters = kv.counters()
    assert (counters.hits, counters.misses) == (5, 1)
    assert kv.publish(blocks[0], keys[0]) is False, "already published"
    other = kv.allocate(1)
    assert kv.publish(other[0], keys[2]) is False, "the key is taken (the same block computed twice)"
    kv.free(blocks[:2] + other)
    assert (kv.cached_blocks, kv.free_blocks) == (3, 5), "the duplicate went back to free, not cached"
    _exact(kv)


def test_allocation_evicts_the_least_recently_used_cached_blocks_last_block_first():
    kv = _pool(num_blocks=4)
    old, new = block_keys(range(8), BS), block_keys(range(50, 58), BS)
    first = kv.allocate(2)
    for b, k in zip(first, old, strict=True):
        kv.publish(b, k)
    kv.free(first)
    second = kv.allocate(2)
    for b, k in zip(second, new, strict=True):
        kv.publish(b, k)
    kv.free(second)
    assert kv.cached_blocks == 4 and kv.free_blocks == 0
    taken = kv.allocate(1)
    assert taken == [first[1]], "the oldest sequence's last block goes first"
    assert kv.counters().evictions == 1
    assert kv.match(old) == [first[0]], "its first block is still cached"
    assert kv.match(new) == second
    with pytest.raises(OutOfBlocks):
        kv.allocate(1)  # every block is held now
    kv.free([*taken, first[0], *second])
    _exact(kv)


def test_with_the_cache_off_nothing_is_kept():
    kv = _pool(prefix_cache=False)
    blocks = kv.allocate(2)
    assert kv.publish(blocks[0], block_keys(range(4), BS)[0]) is False
    kv.free(blocks)
    assert kv.free_blocks == kv.num_blocks and kv.cached_blocks == 0
    assert kv.match(block_keys(range(4), BS)) == []


def test_misuse_is_refused():
    kv = _pool()
    blocks = kv.allocate(2)
    with pytest.raises(RuntimeError):
        kv.free([blocks[0], blocks[0]])
    kv.free(blocks)
    with pytest.raises(RuntimeError):
        kv.free(blocks[:1])
    with pytest.raises(RuntimeError):
        kv.publish(blocks[0], b"k" * 16)


def test_accounting_stays_exact_over_a_long_random_workload():
    rng = random.Random(7)
    kv = _pool(num_blocks=32)
    prefixes = [[rng.randrange(50) for _ in range(BS * 6)] for _ in range(4)]
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.45 or kv.available_blocks < 8):
            kv.free(held.pop(rng.randrange(len(held))))
        else:
            tokens = prefixes[rng.randrange(4)][: BS * rng.randrange(1, 7)] + [
                rng.randrange(50)
            ] * rng.randrange(6)
            keys = block_keys(tokens, BS)
            shared = kv.match(keys)
            need = kv.blocks_for(len(tokens) + 2)
            try:
                own = kv.allocate(need - len(shared))
            except OutOfBlocks:
                kv.free(shared)
                continue
            blocks = shared + own
            for index in range(len(shared), len(keys)):
                kv.publish(blocks[index], keys[index])
            held.append(blocks)
        _exact(kv)
    for blocks in held:
        kv.free(blocks)
    _exact(kv)
    assert kv.used_blocks == 0 and kv.cached_blocks > 0
    assert kv.counters().hits > 0 and kv.counters().evictions > 0


# ---- the engine -------------------------------------------------------------------------------------


def _greedy(engine, prompts, max_tokens=8):
    """Each prompt alone, in turn (so a later one may reuse an earlier one's blocks): its tokens."""
    out = []
    for prompt in prompts:
        (first,) = engine.prefill(
            [Request(prompt, SamplingParams(max_tokens=max_tokens, min_length=max_tokens))]
        )
        tokens = [first.token_id]
        while engine.active_sequences():
            tokens += [o.token_id for o in engine.decode_step()]
        out.append(tokens)
    return out


def _agree_until_tie(expected, got, margins):
    assert len(got) == len(expected)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        if margins[step] < TIE:
            return
        assert have == want, f"step {step}: {have} != {want} (margin {margins[step]:.2e})"


def _count_computed(engine) -> list[int]:
    """Record, for every prompt chunk the engine's forward passes compute from now on, its tokens."""
    computed: list[int] = []
    step = engine.model.step

    def counting(decode, parts, cache):
        computed.extend(int(p.tokens.shape[0]) for p in parts)
        return step(decode, parts, cache)

    engine.model.step = counting
    return computed


@pytest.mark.parametrize("shared_blocks", [1, 2, 10])
@pytest.mark.parametrize("tail", [1, 3, 6])  # tokens after the shared blocks: each ends mid-block
def test_a_cached_prefix_gives_the_tokens_of_a_full_prefill(make_engine, shared_blocks, tail):
    base = [1, *range(20, 20 + shared_blocks * BS - 1)]
    prompts = [tuple(base + [60 + i + k for k in range(tail)]) for i in range(3)]
    off = make_engine()
    margins = record_margins(off)
    expected = _greedy(off, prompts)
    on = make_engine(prefix_cache=True)
    computed = _count_computed(on)
    got = _greedy(on, prompts)
    per_prompt = len(margins) // len(prompts)
    for i in range(len(prompts)):
        window = slice(i * per_prompt, (i + 1) * per_prompt)
        _agree_until_tie(expected[i], got[i], margins[window])
    assert computed[0] == len(prompts[0]), "the first prompt is computed whole"
    assert computed[1:] == [tail, tail], "the later ones only after their shared blocks"
    usage = on.usage()
    assert usage.prefix_hits == 2 * shared_blocks
    assert usage.used == 0 and usage.free == on.kv.num_blocks and usage.cached > 0


def test_a_whole_cached_prompt_still_computes_its_last_token(make_engine):
    engine = make_engine(prefix_cache=True)
    prompt = tuple(range(1, 1 + 3 * BS))  # exactly three blocks
    margins = record_margins(engine)
    (first,) = _greedy(engine, [prompt])
    computed = _count_computed(engine)
    (again,) = _greedy(engine, [prompt])
    _agree_until_tie(first, again, margins)
    assert computed[0] == BS, "the last block is recomputed: its last token gives the first logits"
    assert engine.usage().prefix_hits == 2


def test_an_abort_during_a_shared_prefill_leaves_the_other_holder_intact(make_engine):
    prompt = tuple([1, *range(20, 20 + 8 * BS)])
    reference = make_engine()
    margins = record_margins(reference)
    expected = _greedy(reference, [prompt])[0]
    engine = make_engine(prefix_cache=True)
    a = engine.start(Request(prompt, SamplingParams(max_tokens=8, min_length=8)))
    assert engine.prefill_chunk(a, 5 * BS) is None  # five blocks computed and published
    b = engine.start(Request(prompt, SamplingParams(max_tokens=8, min_length=8)))
    assert engine.usage().prefix_hits == 5
    assert engine.abort(a)
    out = None
    while out is None:
        out = engine.prefill_chunk(b, BS)
    tokens = [out.token_id]
    while engine.active_sequences():
        tokens += [o.token_id for o in engine.decode_step()]
    _agree_until_tie(expected, tokens, margins)
    usage = engine.usage()
    assert usage.used == 0 and usage.free == engine.kv.num_blocks
    assert engine.kv.cached_blocks + engine.kv.free_blocks == engine.kv.num_blocks


def test_a_refused_admission_gives_the_matched_blocks_back(make_engine):
    engine = make_engine(prefix_cache=True, num_blocks=12)
    prompt = tuple(range(1, 1 + 4 * BS + 1))
    _greedy(engine, [prompt], max_tokens=2)
    cached = engine.kv.cached_blocks
    with pytest.raises(OutOfBlocks):
        engine.prefill([Request(prompt, SamplingParams(max_tokens=40))])  # needs more than the pool
    assert engine.usage().used == 0 and engine.kv.cached_blocks == cached


def test_eviction_under_pressure_never_refuses_what_fits(make_engine):
    engine = make_engine(prefix_cache=True, num_blocks=16)
    for i in range(12):  # 12 distinct prompts of 3 full blocks each, 16 blocks in all
        _greedy(engine, [tuple(range(1 + i * 20, 1 + i * 20 + 3 * BS))], max_tokens=2)
    usage = engine.usage()
    assert usage.prefix_evictions > 0 and usage.used == 0 and usage.free == 16


def test_the_hand_off_exports_shared_blocks_and_frees_them_after(make_engine):
    prompt = tuple([1, *range(20, 20 + 6 * BS)])
    src, dst = make_engine(prefix_cache=True), make_engine()
    margins = record_margins(src)
    expected = _greedy(src, [prompt])[0]
    (first,) = src.prefill([Request(prompt, SamplingParams(max_tokens=8, min_length=8))], decode=False)
    (seq_id,) = src.held_sequences()
    state, layout, blocks = src.export_kv(seq_id)
    assert src.usage().prefix_hits == 6
    dst_id = dst.import_kv(state, layout, src.kv.memory[torch.tensor(blocks)])
    tokens = [first.token_id]
    while dst.active_sequences():
        tokens += [o.token_id for o in dst.decode_step() if o.seq_id == dst_id]
    _agree_until_tie(expected, tokens, margins)
    src.free(seq_id)
    assert src.usage().used == 0 and src.usage().free == src.kv.num_blocks


def test_two_hand_offs_of_one_prefix_in_flight_export_private_blocks(make_engine, tmp_path):
    """A burst: two prompts that share a cached prefix are prefilled and handed off together. Each
    lease holds blocks of its own (the shared ones copied), so both exports are granted, both imports
    give the engine's tokens, and every block comes back."""
    from disagg.kv import TransportConfig, create_transport

    prefix = [1, *range(20, 20 + 6 * BS)]
    prompts = [tuple([*prefix, 70 + i, 80 + i]) for i in range(2)]
    dst = make_engine()
    transport = create_transport("fake", TransportConfig(secret=b"k" * 32))
    try:
        # the prefill engine's KV lives in the transport's memory: exported in place, as in a pool
        memory = transport.allocate_memory(256, dst.kv_layout.block_bytes)
        src = make_engine(prefix_cache=True, kv_memory=memory)
        margins = record_margins(src)
        expected = _greedy(src, prompts)  # the first computes and publishes the prefix
        firsts = src.prefill(
            [Request(p, SamplingParams(max_tokens=8, min_length=8)) for p in prompts], decode=False
        )
        held = src.held_sequences()
        assert src.usage().prefix_hits >= 2 * 6
        tokens_out = []
        exported = [src.export_sequence(seq_id, transport) for seq_id in held]  # both leases granted
        blocks = [set(src._get(seq_id).blocks) for seq_id in held]
        assert not blocks[0] & blocks[1], "no block in two leases"
        for first, handed in zip(firsts, exported, strict=True):
            imported = dst.import_sequence(handed.state, handed.descriptor, transport)
            tokens = [first.token_id]
            while dst.active_sequences():
                tokens += [o.token_id for o in dst.decode_step() if o.seq_id == imported.seq_id]
            tokens_out.append(tokens)
        per_prompt = len(margins) // len(prompts)
        for i, tokens in enumerate(tokens_out):
            _agree_until_tie(expected[i], tokens, margins[i * per_prompt : (i + 1) * per_prompt])
        for seq_id, handed in zip(held, exported, strict=True):
            assert transport.release(handed.lease_id)
            src.free(seq_id)
        usage = src.usage()
        assert usage.used == 0 and usage.free == src.kv.num_blocks
    finally:
        transport.close()
