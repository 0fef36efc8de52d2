"""perf/graph_bench.py end to end on CPU, through the Recorder stand-in for CUDA graphs: the script the
GPU run depends on loads a model, compares tokens and writes its tables (no speed meaning here)."""

from __future__ import annotations

import json
from pathlib import Path

from checkpoints import write_checkpoint

from perf import graph_bench


def test_the_graph_bench_runs_on_cpu_with_the_stand_in(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", "llama-gqa")
    (model / "tokenizer.json").write_text("{}")  # the folder check wants one; token ids need none
    out = tmp_path / "out"
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--batch", "1", "--batch", "3"]
    argv += ["--context", "12", "--steps", "2", "--reps", "1", "--tokens", "4", "--out-dir", str(out)]
    assert graph_bench.main(argv) == 0
    (result,) = json.loads((out / "graph_bench.json").read_text())["models"]
    assert result["stand_in"] is True and result["tokens_equal_float32"] is True
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    assert result["buckets"] == [1, 2, 3] and result["replays"] > 0 and result["copy_gb_s"] is None
    table = (out / "graph_bench.md").read_text()
    assert "Recorder stand-in" in table and "| 3 |" in table
