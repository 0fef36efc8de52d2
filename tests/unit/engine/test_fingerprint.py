"""The KV compatibility fingerprint: KV of another checkpoint or layout is refused before any memory
is touched, with the named error (RELIABILITY B7)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.fingerprint import checkpoint_id, kv_fingerprint
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.kv.errors import IncompatibleKV
from disagg.kv.layout import KVLayout, LayoutError
from disagg.pool.offline import generate
from disagg.protocol.errors import KV_INCOMPATIBLE, UNAVAILABLE, classify

REQUEST = Request((1, 5, 6, 7, 8, 9, 10), SamplingParams(max_tokens=8))


def _engine(model_dir: Path, **settings: object) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, num_blocks=64, block_size=4, **settings))


def _exported(engine: Engine) -> tuple:
    (out,) = engine.prefill([REQUEST], decode=False)
    state, layout, blocks = engine.export_kv(out.seq_id)
    return state, layout, engine.kv.memory[torch.tensor(blocks)].clone()


def test_kv_of_another_checkpoint_is_refused_before_memory_is_touched(checkpoint, tmp_path):
    same = checkpoint("llama-gqa")
    other = write_checkpoint(tmp_path / "other", "llama-gqa", seed=1)  # same shapes, other weights
    exporter = _engine(same)
    state, layout, payload = _exported(exporter)
    assert len(layout.fingerprint) == 32

    stranger = _engine(other)
    assert stranger.kv_layout.with_tokens(0) != exporter.kv_layout.with_tokens(0)
    assert stranger.kv_layout.fingerprint != layout.fingerprint
    free = stranger.kv.free_blocks
    touched: list[int] = []
    with pytest.raises(IncompatibleKV, match="fingerprint"):
        stranger.import_kv(state, layout, lambda memory, dest: touched.extend(dest))
    assert touched == [] and stranger.kv.free_blocks == free and not stranger.active_sequences()
    error = classify(IncompatibleKV("x"))
    assert (error.code, error.message) == (UNAVAILABLE, KV_INCOMPATIBLE)

    # the same checkpoint in another folder (a copy) is the same model: its KV is accepted
    twin = tmp_path / "twin"
    twin.mkdir()
    for f in same.iterdir():
        (twin / f.name).write_bytes(f.read_bytes())
    importer = _engine(twin)
    seq_id = importer.import_kv(state, layout, payload)
    tokens = list(state.generated_token_ids)
    while importer.active_sequences():
        tokens += [o.token_id for o in importer.decode_step() if o.seq_id == seq_id]
    assert tokens == generate(_engine(same), REQUEST)[0]


def test_kv_dtype_and_block_size_change_the_fingerprint_and_compute_dtype_does_not(checkpoint):
    model = checkpoint("llama-gqa")
    base = _engine(model, dtype="float32", kv_dtype="bfloat16").kv_layout.fingerprint
    assert _engine(model, dtype="bfloat16", kv_dtype="bfloat16").kv_layout.fingerprint == base
    assert _engine(model, dtype="float32", kv_dtype="float32").kv_layout.fingerprint != base
    layout = KVLayout(2, 2, 16, "bfloat16", 4)
    assert kv_fingerprint("a" * 32, layout) != kv_fingerprint("a" * 32, KVLayout(2, 2, 16, "bfloat16", 8))
    assert kv_fingerprint("a" * 32, layout) != kv_fingerprint("b" * 32, layout)


def test_checkpoint_id_is_remembered_until_a_file_changes(checkpoint, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for f in checkpoint("llama-gqa").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cache = tmp_path / "state" / "checkpoints.json"
    first = checkpoint_id(folder, cache)
    assert cache.is_file() and first in cache.read_text()
    assert checkpoint_id(folder, cache) == first
    weights = next(folder.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor, same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert checkpoint_id(folder, cache) != first
    cache.write_text("not json")
    assert checkpoint_id(folder, cache) == checkpoint_id(folder, tmp_path / "fresh.json")


def test_layout_carries_its_fingerprint_and_refuses_a_malformed_one():
    layout = KVLayout(2, 2, 16, "bfloat16", 4, 9, fingerprint="0" * 32)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert layout.with_tokens(3).fingerprint == "0" * 32
    unstamped = {k: v for k, v in layout.to_dict().items() if k != "fingerprint"}
    assert KVLayout.from_dict(unstamped).fingerprint == ""
    for bad in ("xyz", "0" * 31, 7):
        with pytest.raises(LayoutError, match="fingerprint"):
            KVLayout.from_dict({**layout.to_dict(), "fingerprint": bad})
