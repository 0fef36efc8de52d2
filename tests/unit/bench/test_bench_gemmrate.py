"""The prompt's projection FLOPs (counted by hand on small shapes, and against a checkpoint's own
weights) and the one-thread reference GEMM timing that engine_bench sets beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from disagg.engine.checkpoint import load_config
from perf.benchlib.gemmrate import layer_shapes, prompt_flops, reference_seconds


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 8
    intermediate_size: int = 12
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int | None = 4
    num_layers: int = 3
    vocab_size: int = 10


def test_a_prompts_flops_are_twice_its_rows_times_the_layers_weights_plus_the_heads_once() -> None:
    # q 8x8, k and v 8x4, o 8x8, gate and up 8x12, down 12x8: 64 + 32 + 32 + 64 + 96 + 96 + 96 = 480
    assert layer_shapes(Shape()) == [(8, 8), (8, 4), (8, 4), (8, 8), (8, 12), (8, 12), (12, 8)]
    assert prompt_flops(Shape(), 5) == 2 * 5 * 3 * 480 + 2 * 8 * 10  # 14400 + 160
    assert prompt_flops(Shape(), 1) == 2 * 1440 + 160
    # head_dim unset: hidden_size / num_heads, as config.json reads
    assert prompt_flops(Shape(head_dim=None), 5) == 14560
    # a head_dim of its own: q 8x12, k and v 8x6, o 12x8, the MLP as before: 96 + 48 + 48 + 96 + 288
    assert prompt_flops(Shape(head_dim=6, num_layers=1), 1) == 2 * 576 + 160


def test_the_count_reads_a_checkpoints_config_and_matches_its_weights(tiny_model_dir: Path) -> None:
    cfg = load_config(tiny_model_dir)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (not a dict)
    layers = sum(
        math.prod(shape)
        for key, shape in shapes.items()
        if key.startswith("model.layers.") and key.endswith(".weight") and key.split(".")[-2] in names
    )
    head = shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])
    assert prompt_flops(cfg, 7) == 2 * 7 * layers + 2 * head[0] * head[1]


def test_the_reference_runs_on_one_thread_and_gives_the_thread_count_back(monkeypatch) -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    linear = torch.nn.functional.linear

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return linear(x, weight)

    monkeypatch.setattr("perf.benchlib.gemmrate.F.linear", counted)
    seconds = reference_seconds(Shape(), 5, torch.float32, reps=2)
    assert seconds > 0 and torch.get_num_threads() == before
    assert seen == [1] * (3 * (3 * 7 + 1))  # a warm-up and two repetitions: 3 layers of 7, the head
