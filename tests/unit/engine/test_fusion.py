"""The captured step's pointwise work (disagg.engine.fusion): the three functions give what the step
computed before them, and compiled by torch.compile (C++ kernels on this CPU; Triton ones on a GPU) they
give the plain functions' values, one compilation serving every batch size."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from disagg.engine import fusion
from disagg.engine.paged import reference
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_the_functions_compute_the_layers_pointwise_work() -> None:
    gen = torch.Generator().manual_seed(0)
    x, delta, weight = (torch.randn(3, 16, generator=gen) for _ in range(3))
    residual, normed = fusion.norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(residual, x + delta)
    torch.testing.assert_close(normed, rms(x + delta, weight, 1e-5))
    assert torch.equal(fusion.norm(x, None, weight, 1e-5)[0], x)
    gate_up = torch.randn(3, 8, generator=gen)
    torch.testing.assert_close(
        fusion.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:]
    )


def test_rotary_write_rotates_q_and_k_and_writes_k_and_v_at_each_rows_slot() -> None:
    gen = torch.Generator().manual_seed(1)
    nh, nkv, hd = 4, 2, 8
    qkv = torch.randn(2, (nh + 2 * nkv) * hd, generator=gen)
    angle = torch.randn(2, hd // 2, generator=gen)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    cache = torch.zeros(5, 3, 2, 4, nkv, hd)
    q = fusion.rotary_write(
        qkv, cos, sin, cache, 1, torch.tensor([3, 0]), torch.tensor([2, 1]), (nh, nkv, hd)
    )

    def rotate(x: torch.Tensor, row: int) -> torch.Tensor:
        return x * cos[row] + torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), -1) * sin[row]

    for row, (block, offset) in enumerate([(3, 2), (0, 1)]):
        q_in, k_in, v_in = qkv[row].split([nh * hd, nkv * hd, nkv * hd])
        torch.testing.assert_close(q[row], rotate(q_in.view(nh, hd), row))
        torch.testing.assert_close(cache[block, 1, 0, offset], rotate(k_in.view(nkv, hd), row))
        torch.testing.assert_close(cache[block, 1, 1, offset], v_in.view(nkv, hd))
    assert int((cache != 0).any(-1).any(-1).sum()) == 4  # two rows x (k, v), nothing else written


@pytest.fixture(scope="module")
def compiled() -> fusion.Pointwise:
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()  # this module's compilations alone in the counters
    return fusion.Pointwise.compiled()


def test_the_compiled_step_gives_the_plain_steps_logits_at_every_batch_size(make_engine, compiled) -> None:
    engine = make_engine(native_kernels=False)
    outs = engine.prefill([Request((1, *range(3, 3 + n)), SamplingParams(max_tokens=4)) for n in (2, 9, 20)])
    tokens, positions, table = engine._host_rows([engine._get(o.seq_id) for o in outs])
    wide = torch.zeros(3, 128, dtype=torch.long)
    wide[:, : table.shape[1]] = table
    cache = engine.kv.cache
    graphs = []
    for rows in (3, 2):  # a second batch size: the dynamic dimension, no second compilation needed
        before = cache.clone()
        args = (tokens[:rows], positions[:rows], wide[:rows], positions[:rows] + 1, cache, reference)
        plain = engine.model.decode_static(*args, fusion.PLAIN)
        written = cache.clone()
        cache.copy_(before)
        fused = engine.model.decode_static(*args, compiled)
        graphs.append(int(counters["stats"]["unique_graphs"]))
        torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache, written, atol=1e-5, rtol=1e-5)  # the same KV written
        cache.copy_(before)
    assert compiled.fused and not fusion.PLAIN.fused
    assert graphs[0] >= 3 and graphs[1] == graphs[0]  # each function compiled, once for both sizes
