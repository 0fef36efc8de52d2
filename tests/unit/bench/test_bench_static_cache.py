"""transformers' static-cache path as the GPU engine benchmark runs it (perf.engine_bench.HFStaticRunner),
on CPU: its cache is built for the installed transformers, generate gives the steps asked, and nothing is
compiled here (transformers compiles the forward itself on a GPU only)."""

from __future__ import annotations

from pathlib import Path

from checkpoints import write_checkpoint

from perf.engine_bench import HFRunner, HFStaticRunner


def test_the_static_cache_runner_times_its_steps_and_compiles_nothing_on_cpu(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", "llama-gqa")
    runner = HFStaticRunner(model, "cpu", "float32")
    assert runner.name == "transformers fp32 (static cache, generate)"
    prompts = [[1, 5, 9, 13], [1, 6, 10, 14]]
    seconds = runner.decode(prompts, 3)
    assert seconds >= 0.0 and runner.compiled is False
    assert runner.decode(prompts, 3) >= 0.0  # the same cache object again, reset
    assert len(runner._caches) == 1
    runner.decode(prompts[:1], 3)
    assert len(runner._caches) == 2  # one per batch size
    assert HFRunner(model, "cpu", "float32").name == "transformers fp32 (sdpa)"
