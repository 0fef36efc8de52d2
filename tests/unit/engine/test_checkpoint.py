"""Checkpoint parsing: both RoPE spellings, and refusal of what the engine does not implement."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from disagg.affinity import pin_process
from disagg.engine.checkpoint import load_config, parse_config, parse_rope
from disagg.engine.device import pin_cpu
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.errors import CheckpointError
from disagg.engine.rope import inverse_frequencies

BASE = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=100,
)


def test_rope_spellings_agree():
    old = parse_rope({"rope_theta": 1234.0, "rope_scaling": None})
    new = parse_rope({"rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"}})
    assert old == new
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaled["original_max_position_embeddings"] = 8192
    old = parse_rope({"rope_theta": 5e5, "rope_scaling": scaled})
    new = parse_rope({"rope_parameters": {**scaled, "rope_theta": 5e5}})
    assert old == new and new.rope_type == "llama3"


def test_llama3_schedule_shape():
    rope = parse_rope(
        {
            "rope_parameters": dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            )
        }
    )
    plain = inverse_frequencies(parse_rope({"rope_theta": 5e5}), 128)
    scaled = inverse_frequencies(rope, 128)
    assert torch.equal(scaled[:10], plain[:10]), "high frequencies are kept"
    assert torch.allclose(scaled[-5:], plain[-5:] / 8.0), "low frequencies are divided by the factor"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_fields_are_refused_by_name(change, field):
    with pytest.raises(CheckpointError, match=field):
        parse_config({**BASE, **change})


def test_mistral_window_caps_the_context():
    cfg = parse_config(
        {**BASE, "model_type": "mistral", "sliding_window": 256, "max_position_embeddings": 4096}
    )
    assert cfg.max_context == 256


def test_missing_files_and_tensors(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="config\\.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(CheckpointError, match="safetensors"):
        Engine(EngineConfig(model_dir=tmp_path))
    src = checkpoint("llama-gqa")
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="lacks tensor"):
        Engine(EngineConfig(model_dir=tmp_path))


def test_engine_config_rejects_unknown_and_bad_settings(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) blocksize"):
        EngineConfig.from_dict({"model_dir": tmp_path, "blocksize": 16})
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_dir=tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model_dir=tmp_path, block_size=0)


def test_bfloat16_engine_runs(make_engine):
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request
    from disagg.pool.offline import generate

    request = Request((1, 30, 31, 32), SamplingParams(max_tokens=16))
    fp32 = generate(make_engine(), request)[0]
    bf16 = generate(make_engine(dtype="bfloat16"), request)[0]
    assert len(bf16) == 16 and all(0 <= t < 256 for t in bf16)
    assert bf16[:3] == fp32[:3], "bf16 drifts from fp32 over time, but not at once"


def test_pin_cpu_restricts_affinity():
    before = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    try:
        core = min(before)
        pin_cpu((core,))
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="not available"):
            pin_cpu((10_000,))
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def test_pin_process_moves_threads_started_before_it():
    before = os.sched_getaffinity(0)
    started, release = threading.Event(), threading.Event()
    native: list[int] = []

    def idle() -> None:
        native.append(threading.get_native_id())
        started.set()
        release.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    try:
        started.wait()
        core = min(before)
        assert pin_process((core,)) >= 2  # this thread and the one already running
        assert os.sched_getaffinity(native[0]) == {core}
        assert os.sched_getaffinity(0) == {core}
        with pytest.raises(ValueError, match="not available"):
            pin_process((10_000,))
    finally:
        release.set()
        thread.join()
        os.sched_setaffinity(0, before)
