"""The engine on a CUDA device: the same greedy tokens as on the CPU, every dtype runs, KV over CUDA IPC.

Skipped without CUDA (``conftest.py``); run on a lent GPU by ``perf/gpu_check.sh``.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
from pathlib import Path

import pytest
from gpu_peer import decode_importer, engine_on
from kv_support import SECRET

from disagg.engine.engine import Engine
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.kv import TransportConfig, create_transport

PROMPTS = [
    (1, 5, 9, 200, 31, 7),
    tuple([1, *range(40, 40 + 37)]),
    tuple([1, *[(7 * i) % 900 + 3 for i in range(130)]]),
]
TIMEOUT_S = 120


def _generate(engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int) -> list[list[int]]:
    """Greedy generation of every prompt in one batch, each sequence's tokens in order."""
    params = SamplingParams(max_tokens=max_tokens)
    return _run(engine, [Request(p, params) for p in prompts])


def _run(engine: Engine, requests: list[Request]) -> list[list[int]]:
    """Every request in one batch until all are done, each sequence's tokens in order."""
    outs = engine.prefill(requests)
    tokens = {o.seq_id: [o.token_id] for o in outs}
    while engine.active_sequences():
        for out in engine.decode_step():
            tokens[out.seq_id].append(out.token_id)
    for seq_id in tokens:
        engine.free(seq_id)
    return [tokens[o.seq_id] for o in outs]


def test_fp32_on_cuda_generates_the_cpu_tokens(tiny_model_dir: Path) -> None:
    cpu = _generate(engine_on(tiny_model_dir, "cpu", "float32"), PROMPTS, 12)
    gpu_engine = engine_on(tiny_model_dir, "cuda:0", "float32")
    assert gpu_engine.kv.memory.device.type == "cuda"
    assert _generate(gpu_engine, PROMPTS, 12) == cpu
    assert gpu_engine.usage().used == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_on_cuda_run_and_leave_no_blocks_held(tiny_model_dir: Path, dtype: str) -> None:
    engine = engine_on(tiny_model_dir, "cuda:0", dtype)
    vocab = engine.vocab_size
    out = _generate(engine, PROMPTS, 12)
    assert [len(t) for t in out] == [12, 12, 12]
    assert all(0 <= t < vocab for seq in out for t in seq)
    assert engine.usage().used == 0
    # On CUDA the kernels chosen depend on the batch's shape, so a sequence's half-precision tokens may
    # differ with its batch (the CPU kernels promise invariance, CUDA's do not): reported, not required.
    alone = [_generate(engine, [p], 12)[0] for p in PROMPTS]
    same = sum(a == b for a, b in zip(alone, out, strict=True))
    print(f"{dtype}: {same} of {len(out)} sequences equal alone and batched")
    assert engine.usage().used == 0


def test_auto_dtype_on_cuda_is_bfloat16(tiny_model_dir: Path) -> None:
    assert engine_on(tiny_model_dir, "cuda:0", "auto").config.dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_continues_exactly_in_another_process_over_cuda_ipc(
    tiny_model_dir: Path, dtype: str
) -> None:
    prefix = "g" + secrets.token_hex(4)
    transport = create_transport("cuda_ipc", TransportConfig(secret=SECRET, prefix=prefix, checksum=True))
    exporter = engine_on(tiny_model_dir, "cuda:0", dtype, transport)
    assert exporter.kv.memory.device.type == "cuda"
    whole = [_generate(exporter, [p], 10)[0] for p in PROMPTS]  # each alone, as the importer decodes it
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_importer, args=(str(tiny_model_dir), dtype, prefix, child), daemon=True)
    proc.start()
    try:
        for prompt, expected in zip(PROMPTS, whole, strict=True):
            (out,) = exporter.prefill([Request(prompt, SamplingParams(max_tokens=10))], decode=False)
            exported = exporter.export_sequence(out.seq_id, transport)
            parent.send((exported.state.to_dict(), exported.descriptor))
            assert parent.poll(TIMEOUT_S), "the importing process did not answer"
            tokens, held = parent.recv()
            assert [out.token_id, *tokens] == expected
            assert held == 0
            transport.poll()  # the importer's ack, written into our region, ends the lease
            assert transport.held_leases() == 0
            exporter.free(out.seq_id)
        parent.send(None)
        proc.join(TIMEOUT_S)
        assert proc.exitcode == 0
        assert exporter.usage().used == 0
    finally:
        if proc.is_alive():
            proc.kill()
        transport.close()
