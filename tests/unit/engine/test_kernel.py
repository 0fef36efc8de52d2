"""The bf16 kernels (projection and paged decode attention) against PyTorch, a row's bits independent of
its batch, the build cache, and the fallback without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine import amxkernel, kernel
from disagg.engine.projection import Projection

needs_kernel = pytest.mark.skipif(kernel.gemm() is None, reason="no AVX-512-BF16 or no C compiler here")


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # both round an fp32 sum to bf16; the sums run in different orders: one bf16 step apart at most
    scale = expected.float().abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.float() - expected.float()).abs().max().item() <= scale * 2**-7


@pytest.fixture
def threads():
    """Set torch's (and so the kernels') thread count for one test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 40])
@pytest.mark.parametrize(("outputs", "width"), [(37, 64), (130, 576), (64, 46), (5, 2)])
def test_the_kernel_matches_f_linear(rows: int, outputs: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * width + outputs)
    weight = torch.randn(outputs, width, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16()
    x = torch.randn(rows, width, generator=generator).bfloat16()
    gemm, packed = kernel.gemm(), kernel.pack(weight)
    _close(gemm(x, packed, None), F.linear(x, weight))
    _close(gemm(x, packed, bias), F.linear(x, weight, bias))


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_thread_count(threads) -> None:
    """What keeps a sequence's greedy text independent of what it is batched with: each row's sum
    runs in an order fixed by the input index alone."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(3000, 576, generator=generator).bfloat16()  # big enough to be split
    bias = torch.randn(3000, generator=generator).bfloat16()
    x = torch.randn(100, 576, generator=generator).bfloat16()
    gemm, packed = kernel.gemm(), kernel.pack(weight)  # 47 tiles: an odd count
    threads(1)
    alone = torch.cat([gemm(x[i : i + 1], packed, bias) for i in range(100)])
    for count in (2, 3, 6, 7, 13, 40, 100):
        assert torch.equal(gemm(x[:count], packed, bias), alone[:count])
    threads(2)  # from 48 rows on, the threads split rows as well as tiles
    for count in (1, 5, 40, 48, 53, 100):
        assert torch.equal(gemm(x[:count], packed, bias), alone[:count])
    wide = gemm(x, packed, bias, True)  # the same sums, unrounded
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), alone)


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    gemm = kernel.gemm()
    packed = kernel.pack(torch.zeros(4, 8).bfloat16())
    with pytest.raises(ValueError, match="width 8"):
        gemm(torch.zeros(2, 6).bfloat16(), packed, None)
    with pytest.raises(ValueError):
        gemm(torch.zeros(1, 8), packed, None)  # fp32 rows
    with pytest.raises(ValueError, match="bias"):
        gemm(torch.zeros(1, 8).bfloat16(), packed, torch.zeros(3).bfloat16())
    with pytest.raises(ValueError, match="even"):
        kernel.pack(torch.zeros(4, 7).bfloat16())
    assert gemm(torch.zeros(0, 8).bfloat16(), packed, None).shape == (0, 4)


@needs_kernel
def test_a_native_projection_holds_only_the_kernels_layout() -> None:
    weight = torch.randn(128, 64).bfloat16()  # whole tiles of 64 outputs: no padding
    projection = Projection(weight, None, pack=True, native=True)
    if kernel.cpu_has_amx():
        pytest.skip("with AMX the projection keeps oneDNN's layout as well (tested below)")
    assert projection.native is not None and projection.weight is None and not projection.packed
    assert projection.nbytes == projection.native.nbytes == 128 * 64 * 2
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(projection(x), kernel.gemm()(x, projection.native, None))
    assert torch.equal(projection(x, 2), projection(x))  # one path: the split changes nothing


@needs_kernel
def test_with_amx_prompt_rows_go_to_onednn_and_decode_rows_to_the_kernel(monkeypatch) -> None:
    """Where the AMX tile kernel is off (``disagg.engine.amxkernel``: tested there)."""
    monkeypatch.setattr(kernel, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(amxkernel, "gemm", lambda emulated=False: None)
    weight, bias = torch.randn(128, 64).bfloat16(), torch.randn(128).bfloat16()
    projection = Projection(weight, bias, pack=True, native=True)
    assert projection.native is not None and projection.packed
    assert projection.nbytes == 2 * 128 * 64 * 2  # both layouts
    x = torch.randn(7, 64).bfloat16()
    decode = kernel.gemm()(x[:3], projection.native, bias)
    split = projection(x, 3)
    assert torch.equal(split[:3], decode)
    assert torch.equal(split[3:], F.linear(x[3:], weight, bias))  # the packed weight: F.linear's bits
    assert torch.equal(projection(x, 0), F.linear(x, weight, bias))
    assert torch.equal(projection(x), kernel.gemm()(x, projection.native, bias))
    head = Projection(weight, None, pack=True, native=True, wide=True, split=False)  # an output head
    assert head.weight is None and head.nbytes == 128 * 64 * 2  # the kernel's layout only
    logits = head(x, 0)  # every row through the kernel, in fp32
    assert logits.dtype == torch.float32 and torch.equal(logits, kernel.gemm()(x, head.native, None, True))


@needs_kernel
@pytest.mark.parametrize("amx", [True, False])
def test_an_injected_amx_decides_where_prompt_rows_go(monkeypatch, amx: bool) -> None:
    """``amx`` given, the CPU is not asked: with it (and the AMX tile kernel off) prompt rows go to
    oneDNN and decode rows to the kernel (both layouts held), without it every row goes to the kernel
    (its layout alone)."""
    monkeypatch.setattr(kernel, "cpu_has_amx", lambda: pytest.fail("the CPU was asked despite amx"))
    monkeypatch.setattr(amxkernel, "gemm", lambda emulated=False: None)
    weight, bias = torch.randn(128, 64).bfloat16(), torch.randn(128).bfloat16()
    projection = Projection(weight, bias, pack=True, native=True, amx=amx)
    assert projection.native is not None
    x = torch.randn(7, 64).bfloat16()
    every_row = kernel.gemm()(x, projection.native, bias)
    split = projection(x, 3)
    assert torch.equal(split[:3], kernel.gemm()(x[:3], projection.native, bias))  # decode rows
    assert torch.equal(projection(x), every_row)  # all decode rows: the kernel either way
    if amx:
        assert projection.packed and projection.nbytes == 2 * 128 * 64 * 2
        assert torch.equal(split[3:], F.linear(x[3:], weight, bias))  # prompt rows: oneDNN's bits
        assert torch.equal(projection(x, 0), F.linear(x, weight, bias))
    else:
        assert projection.weight is None and not projection.packed and projection.nbytes == 128 * 64 * 2
        assert torch.equal(split[3:], kernel.gemm()(x[3:], projection.native, bias))  # the kernel too
        assert torch.equal(projection(x, 0), every_row)


def test_without_the_kernel_projections_fall_back_to_onednn(monkeypatch) -> None:
    weight = torch.randn(16, 64).bfloat16()
    monkeypatch.setattr(kernel, "gemm", lambda: None)
    projection = Projection(weight, None, pack=True, native=True)
    assert projection.native is None and projection.weight is not None
    x = torch.randn(1, 64).bfloat16()
    _close(projection(x), F.linear(x, weight))
    monkeypatch.undo()
    odd = Projection(torch.randn(4, 7).bfloat16(), None, pack=False, native=True)  # the layout holds pairs
    x = torch.randn(2, 7).bfloat16()
    assert odd.native is None and torch.equal(odd(x), F.linear(x, odd.weight))


def test_a_build_is_reused_and_a_broken_compiler_is_an_error(tmp_path, monkeypatch) -> None:
    if not kernel.cpu_supports():
        pytest.skip("this CPU has no AVX-512-BF16")
    built = kernel.build(tmp_path)
    assert built.is_file() and built.parent == tmp_path
    stamp = built.stat().st_mtime_ns
    assert kernel.build(tmp_path) == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="failed"):
        kernel.build(tmp_path / "other")


def _sdpa_reference(q, cache, layer, tables, positions):
    """Each sequence alone through PyTorch's SDPA in fp32 over its gathered positions."""
    out = []
    for row, (table, position) in enumerate(zip(tables, positions.tolist(), strict=True)):
        span = position + 1
        keys = cache[table, layer, 0].flatten(0, 1)[:span].float().transpose(0, 1)  # [nkv, span, hd]
        values = cache[table, layer, 1].flatten(0, 1)[:span].float().transpose(0, 1)
        attn = F.scaled_dot_product_attention(q[row].float()[:, None], keys, values, enable_gqa=True)
        out.append(attn[:, 0])
    return torch.stack(out)


needs_attention = pytest.mark.skipif(
    kernel.decode_attention() is None, reason="no AVX-512-BF16 or no C compiler here"
)


@needs_attention
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (4, 2, 64), (1, 8, 32), (2, 1, 128)])
def test_paged_attention_matches_sdpa_at_mixed_lengths(kv_heads: int, group: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(kv_heads * group)
    blocks, layers, block_size = 64, 2, 4
    cache = torch.randn(blocks, layers, 2, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    lengths = [0, 3, 4, 17, 40]  # positions: one token, a block edge, spans of several blocks
    order = torch.randperm(blocks, generator=generator)
    tables, used = [], 0
    for position in lengths:
        count = position // block_size + 1
        tables.append(order[used : used + count])
        used += count
    width = max(len(t) for t in tables)
    table = torch.stack([F.pad(t, (0, width - len(t)), value=blocks - 1) for t in tables])
    positions = torch.tensor(lengths)
    q = (2 * torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator)).bfloat16()
    got = kernel.decode_attention()(q, cache, 1, table, positions)
    expected = _sdpa_reference(q, cache, 1, tables, positions)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - expected).abs().max().item() < 2e-2  # bf16 output rounding


@needs_attention
@pytest.mark.parametrize(("start", "rows"), [(0, 1), (0, 37), (0, 130), (50, 20), (17, 1), (33, 64)])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 32), (2, 1, 128)])
def test_prompt_attention_matches_causal_sdpa(
    threads, start: int, rows: int, kv_heads: int, group: int, head_dim: int
) -> None:
    """A chunk at positions start.. over its sequence's scattered blocks (the first chunk at 0, a later
    one over what is cached before it), on one thread and two: fp32 SDPA's result within bf16
    rounding, and the same bits on both."""
    generator = torch.Generator().manual_seed(start * rows + head_dim)
    blocks, layers, block_size = 48, 2, 8
    cache = torch.randn(blocks, layers, 2, block_size, kv_heads, head_dim, generator=generator).bfloat16()
    table = torch.randperm(blocks, generator=generator)[: -(-(start + rows) // block_size) + 1]
    q = (2 * torch.randn(rows, kv_heads * group, head_dim, generator=generator)).bfloat16()
    span = start + rows
    keys = cache[table, 1, 0].flatten(0, 1)[:span].float().transpose(0, 1)  # [nkv, span, hd]
    values = cache[table, 1, 1].flatten(0, 1)[:span].float().transpose(0, 1)
    mask = torch.arange(span)[None, :] <= torch.arange(start, span)[:, None]
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    attend = kernel.prompt_attention()
    threads(1)
    got = attend(q, cache, 1, table, start)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - expected).abs().max().item() < 2e-2  # bf16 weights and output rounding
    threads(2)
    assert torch.equal(attend(q, cache, 1, table, start), got)
    with pytest.raises(ValueError, match="past"):
        attend(q, cache, 1, table[:1], start + block_size)


@needs_attention
def test_paged_attention_refuses_shapes_it_does_not_cover() -> None:
    attend = kernel.decode_attention()
    cache = torch.zeros(4, 1, 2, 4, 1, 48).bfloat16()  # head_dim 48: not a multiple of 32
    with pytest.raises(ValueError):
        attend(
            torch.zeros(1, 1, 48).bfloat16(), cache, 0, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1)
        )


@needs_attention
def test_an_engine_decodes_the_same_with_and_without_its_kernels() -> None:
    """One decode step of three sequences after their prefill, in bf16 with the kernels and without,
    against fp32: the kernels' logits are as close to fp32's as PyTorch's bf16 path is (both are
    bf16 rounding apart from it; a wrong block, position or head would be of the order of the logits
    themselves)."""
    from disagg import paths
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request

    logits = {}
    for name, dtype, native in (
        ("kernels", "bfloat16", True),
        ("torch", "bfloat16", False),
        ("fp32", "float32", False),  # the token-exact reference path
    ):
        config = EngineConfig(
            model_dir=paths.tiny_model_dir(), dtype=dtype, num_blocks=64, native_kernels=native
        )
        engine = Engine(config)
        on = name == "kernels"
        assert engine.model.paged_attention is on and (engine.model.lm_head.native is not None) is on
        assert (engine.model.prompt is not None) is on and (engine.model.norm_kernel is not None) is on
        requests = [Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=4)) for n in (5, 21, 40)]
        engine.prefill(requests)
        rows = engine._decode_rows(list(engine._sequences.values()))
        logits[name], _ = engine.model.step(rows, [], engine.kv.cache)
    reference = logits["fp32"]
    kernels, torch_bf16 = ((logits[n] - reference).abs().max().item() for n in ("kernels", "torch"))
    assert kernels < 1.5 * torch_bf16 + 0.01 * reference.abs().max().item()
    assert kernels < 0.15 * reference.abs().max().item()


@needs_kernel
def test_a_sequences_bf16_text_does_not_depend_on_what_it_is_batched_with() -> None:
    """Greedy bf16 tokens of three prompts, each alone and all together, and with a prompt prefilled in
    chunks beside a decode batch (one fused step): the same tokens every way."""
    from disagg import paths
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request

    engine = Engine(EngineConfig(model_dir=paths.tiny_model_dir(), dtype="bfloat16", num_blocks=64))
    prompts = [tuple(range(3, 3 + n)) for n in (5, 21, 40)]
    params = SamplingParams(max_tokens=12)

    def run(batch: list[tuple[int, ...]], late: tuple[int, ...] | None = None) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        done: set[int] = set()

        def take(outputs) -> None:
            for out in outputs:
                tokens.setdefault(out.seq_id, []).append(out.token_id)
                if out.finished:
                    done.add(out.seq_id)

        take(engine.prefill([Request(p, params) for p in batch]))
        order = list(tokens)
        if late is not None:  # prefilled whole in one fused step, beside the decode batch's rows
            seq_id = engine.start(Request(late, params), decode=True)
            decoded, first = engine.step([(seq_id, len(late))])
            take(decoded + first)
            order.append(seq_id)
        while len(done) < len(order):
            take(engine.decode_step())
        return [tokens[seq_id] for seq_id in order]

    alone = [run([p])[0] for p in prompts]
    assert run(prompts) == alone
    assert run(prompts[::-1]) == alone[::-1]
    assert run(prompts[:2], late=prompts[2]) == alone


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_pointwise_kernels_match_pytorch(threads, rows: int) -> None:
    """RMSNorm and silu(gate) * up, against the PyTorch operations the engine runs without them:
    within one bf16 step (the kernels round once where PyTorch rounds twice), and the same bits on
    one thread and two."""
    generator = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=generator)).bfloat16()
    weight = torch.randn(576, generator=generator).bfloat16()
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    norm, act = kernel.rms_norm(), kernel.silu_mul()
    threads(1)
    got = norm(x, weight, 1e-5)
    _close(got, expected)
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=generator)).bfloat16()
    gate, up = gate_up.float().chunk(2, -1)
    activated = act(gate_up)
    _close(activated, F.silu(gate) * up)
    threads(2)
    assert torch.equal(norm(x, weight, 1e-5), got) and torch.equal(act(gate_up), activated)
    with pytest.raises(ValueError):
        norm(torch.zeros(2, 20).bfloat16(), torch.zeros(20).bfloat16(), 1e-5)  # not a multiple of 16
    with pytest.raises(ValueError):
        act(torch.zeros(2, 48).bfloat16())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_cache_gives_the_bits_of_the_rotary_table_and_the_cache_writes_it_replaces(
    rows, threads
) -> None:
    """Queries rotated, keys rotated into the cache, values copied into it: bit for bit what
    RotaryTable.apply and two indexed writes produce (each product and the sum rounded to bf16),
    zeros' signs and a NaN included, on any thread count; no other slot of the cache changes."""
    from disagg.engine.checkpoint import RopeConfig
    from disagg.engine.rope import RotaryTable

    heads, kv_heads, head_dim, layers, bs, blocks = 9, 3, 64, 3, 4, 100
    generator = torch.Generator().manual_seed(rows)
    table = RotaryTable(RopeConfig(theta=10000.0), head_dim, 512, torch.bfloat16)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    qkv[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    positions = torch.randperm(512, generator=generator)[:rows].sort().values
    slots = torch.randperm(blocks * bs, generator=generator)[:rows]  # distinct slots
    slot_block, slot_offset = slots // bs, slots % bs
    layer = 1
    before = torch.randn(blocks, layers, 2, bs, kv_heads, head_dim, generator=generator).bfloat16()

    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref = table.apply(q_ref.reshape(rows, heads, head_dim), positions)
    k_ref = table.apply(k_ref.reshape(rows, kv_heads, head_dim), positions)
    expected = before.clone()
    expected[slot_block, layer, 0, slot_offset] = k_ref
    expected[slot_block, layer, 1, slot_offset] = v_ref.reshape(rows, kv_heads, head_dim)

    rope = kernel.rope_cache()
    for count in (1, 2):
        threads(count)
        cache = before.clone()
        q = rope(qkv, cache, layer, positions, slot_block, slot_offset, table.cos, table.sin, heads, kv_heads)
        assert torch.equal(q.view(torch.int16), q_ref.view(torch.int16))  # bits, NaN and -0 included
        assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(ValueError):
        rope(
            qkv[:, :-64],
            cache,
            layer,
            positions,
            slot_block,
            slot_offset,
            table.cos,
            table.sin,
            heads,
            kv_heads,
        )
    with pytest.raises(ValueError):
        rope(
            qkv, cache, layer, positions.int(), slot_block, slot_offset, table.cos, table.sin, heads, kv_heads
        )
