"""bf16 projections: the engine's kernel against oneDNN's prepacked kernel, side by side in one run.

For every projection of one forward step of a model (its layers' qkv, o, gate_up and down, and the
output head), at M input rows, on pinned cores:
  - ``kernel``: ``disagg.engine.kernel.gemm`` on its own weight layout (what the pools run);
  - ``oneDNN``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
    ``_reorder_linear_weight`` (the engine's path where the kernels are not).
Weights have the model's shapes (from its config.json; random values: speed does not depend on
them), one copy per layer, so a step streams them from memory as the engine's does. Repetitions are
interleaved (kernel, oneDNN, kernel, ...) and the median of each is reported. Writes
projection_bench.json and projection_bench.md into --out-dir.

    python perf/projection_bench.py [--model DIR] [--cores 0[,1]] [--rows 1,2,4,8,16,32,64,300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine import kernel
from disagg.engine.checkpoint import load_config
from disagg.paths import ensure_model, resolve_model_dir

RESULTS = Path(__file__).resolve().parent / "results"


def shapes(model_dir: Path) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(out, in) of one layer's projections, the head's, and the layer count."""
    cfg = load_config(model_dir)
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd), (2 * i, h), (h, i)]
    return layer, (cfg.vocab_size, h), cfg.num_layers


def run(model_dir: Path, cores: tuple[int, ...], rows: list[int], reps: int) -> dict:
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    gemm = kernel.gemm()
    if gemm is None:
        raise SystemExit("the kernels are off here (no AVX-512-BF16 or no C compiler): nothing to compare")
    layer, head, layers = shapes(model_dir)
    weights = [torch.randn(n, k).bfloat16() for _ in range(layers) for n, k in layer] + [
        torch.randn(*head).bfloat16()
    ]
    ours = [kernel.pack(w) for w in weights]
    theirs = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    widths = [w.shape[1] for w in weights]
    del weights
    table = []
    for m in rows:
        inputs = {k: torch.randn(m, k).bfloat16() for k in set(widths)}

        def kernel_step(inputs: dict = inputs) -> None:
            for packed, k in zip(ours, widths, strict=True):
                gemm(inputs[k], packed, None)

        def onednn_step(inputs: dict = inputs) -> None:
            for packed, k in zip(theirs, widths, strict=True):
                torch.ops.mkldnn._linear_pointwise(inputs[k], packed, None, "none", [], "")

        samples: dict[str, list[float]] = {"kernel": [], "oneDNN": []}
        kernel_step()  # warm-up
        onednn_step()
        for _ in range(reps):
            for name, step in (("kernel", kernel_step), ("oneDNN", onednn_step)):
                start = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        table.append(
            dict(rows=m, kernel_ms=ms["kernel"], onednn_ms=ms["oneDNN"], speedup=ms["oneDNN"] / ms["kernel"])
        )
    return dict(
        model=str(model_dir),
        cores=list(cores),
        reps=reps,
        projections=len(ours),
        weight_bytes=sum(p.nbytes for p in ours),
        torch=torch.__version__,
        amx=kernel.cpu_has_amx(),
        table=table,
    )


def markdown(result: dict) -> str:
    lines = [
        "# bf16 projections: the engine's kernel and oneDNN",
        "",
        f"Written by `perf/projection_bench.py`. Model shapes of `{Path(result['model']).name}`: "
        f"{result['projections']} projections, {result['weight_bytes'] / 1e6:.0f} MB of bf16 weights per "
        f"step; cores {result['cores']}, torch {result['torch']}, AMX: {result['amx']}; median of "
        f"{result['reps']} interleaved repetitions.",
        "",
        "| rows | kernel, ms | oneDNN prepacked, ms | kernel speed-up |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["table"]:
        lines.append(
            f"| {row['rows']} | {row['kernel_ms']:.1f} | {row['onednn_ms']:.1f} | {row['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else SmolLM2-135M-Instruct)")
    parser.add_argument("--cores", default="0", help="comma-separated core list (default 0)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,300")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(resolve_model_dir(args.model))
    cores = tuple(int(c) for c in args.cores.split(","))
    result = run(model_dir, cores, [int(r) for r in args.rows.split(",")], args.reps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "projection_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out_dir / "projection_bench.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
