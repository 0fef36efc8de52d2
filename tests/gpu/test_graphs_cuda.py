"""Captured decode steps and the Triton-lang paged attention on a CUDA device (issue 45).

Skipped without CUDA (``conftest.py``); run on a lent GPU by ``perf/gpu_check.sh`` (step pytest_gpu).
Prepared on CPU, where the same control flow is tested through the ``Recorder`` stand-in
(tests/unit/engine/test_replay.py) and the kernel under Triton's interpreter
(tests/unit/engine/test_paged.py): NOT yet run on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_cuda import PROMPTS, _generate, _run

from disagg.engine import paged
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request


def _engine(model_dir: Path, dtype: str, graphs: bool, **settings: object) -> Engine:
    config = EngineConfig(
        model_dir=model_dir, device="cuda:0", dtype=dtype, kv_cache_mb=64, cuda_graphs=graphs, **settings
    )
    return Engine(config)


def test_fp32_graphs_generate_the_eager_tokens(tiny_model_dir: Path) -> None:
    eager = _generate(_engine(tiny_model_dir, "float32", False), PROMPTS, 12)
    engine = _engine(tiny_model_dir, "float32", True, max_batch_size=8)
    assert engine.graphs is not None and engine.graphs.captured == (1, 2, 4, 8)
    assert _generate(engine, PROMPTS, 12) == eager
    assert engine.graphs.replays > 0, "the decode steps replayed a graph"
    assert engine.usage().used == 0


def _sampled(engine: Engine, max_tokens: int) -> list[list[int]]:
    """Every prompt sampled in one batch (temperature, top-k, top-p, seeds of their own)."""
    settings = [
        dict(temperature=0.8, seed=1),
        dict(temperature=1.2, top_k=20, seed=2),
        dict(top_p=0.9, seed=3),
    ]
    requests = [
        Request(p, SamplingParams(max_tokens=max_tokens, **{"temperature": 1.0, **kw}))
        for p, kw in zip(PROMPTS, settings, strict=True)
    ]
    return _run(engine, requests)


def test_fp32_graphs_sample_in_the_graph_the_eager_tokens(tiny_model_dir: Path) -> None:
    eager = _sampled(_engine(tiny_model_dir, "float32", False), 12)
    engine = _engine(tiny_model_dir, "float32", True, max_batch_size=8)
    assert _sampled(engine, 12) == eager
    assert engine.graphs is not None and engine.graphs.replays > 0


def test_fp32_graphs_with_fused_pointwise_work_generate_the_eager_tokens(tiny_model_dir: Path) -> None:
    eager = _generate(_engine(tiny_model_dir, "float32", False), PROMPTS, 12)
    engine = _engine(tiny_model_dir, "float32", True, max_batch_size=8, fuse_pointwise=True)
    assert _generate(engine, PROMPTS, 12) == eager
    assert engine.graphs is not None and engine.graphs.replays > 0


def test_bf16_graphs_run_and_leave_no_blocks_held(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, "bfloat16", True, max_batch_size=8)
    out = _generate(engine, PROMPTS, 12)
    assert [len(t) for t in out] == [12, 12, 12]
    assert engine.usage().used == 0


def test_a_batch_above_the_largest_bucket_runs_eagerly(tiny_model_dir: Path) -> None:
    eager = _generate(_engine(tiny_model_dir, "float32", False), PROMPTS, 8)
    engine = _engine(tiny_model_dir, "float32", True, graph_buckets=(1, 2))
    assert _generate(engine, PROMPTS, 8) == eager
    assert engine.graphs is not None and engine.graphs.eager_steps > 0


@pytest.mark.skipif(not paged.triton_available(), reason="no triton package with this torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_equals_the_reference_on_cuda(dtype: torch.dtype) -> None:
    kernel = paged.triton_attention()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(96, 2, 2, 16, 3, 64, generator=gen).to(dtype).cuda()  # SmolLM2's kv heads, hd
    table = torch.randperm(96, generator=gen)[: 4 * 20].view(4, 20).cuda()
    lens = torch.tensor([1, 17, 200, 320]).cuda()
    q = torch.randn(4, 9, 64, generator=gen).to(dtype).cuda()
    got = kernel(q, cache, 1, table, lens)
    want = paged.reference(q, cache, 1, table, lens)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
