"""Captured decode steps against eager ones: ``Engine.decode_step()`` wall time, host work included.

For each model, two engines on one device in one run, the same settings but ``cuda_graphs``: eager, and
with the decode step captured per batch bucket (``disagg.engine.replay``; attention by the Triton-lang
paged kernel where ``triton`` imports). Reports, per batch size at a given context:

- milliseconds per decode step, each engine, and their ratio;
- the capture time at load;
- whether the greedy tokens of a few prompts are the same with and without graphs, in fp32 (where they
  must be) and in the benchmark's dtype (reported);
- on CUDA, the weights' bytes over the bandwidth of a device copy measured in the same run: the floor a
  batch-1 step is compared with.

    python -m perf.graph_bench --model DIR [--model DIR ...] --out-dir DIR [--batch 1 --batch 64]

NOT yet run on a GPU: ``perf/gpu_check.sh`` (step ``graph_bench``) is the prepared run. With
``--device cpu`` it runs the same script with ``Recorder``, the CPU stand-in for CUDA graphs (no speed
meaning: it checks the script and the tokens only). Writes graph_bench.json and graph_bench.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.replay import Recorder
from disagg.engine.sequence import Request
from disagg_tools.checkpoints import ensure_model
from perf.benchlib.outputs import write_results


def _engine(
    model: Path, device: str, dtype: str, graphs: bool, max_batch: int, fused: bool = False
) -> Engine:
    on_cuda = device.startswith("cuda")
    config = EngineConfig(
        model_dir=model,
        device=device,
        dtype=dtype,
        kv_cache_mb=2048 if on_cuda else 64,
        max_batch_size=max_batch,
        cuda_graphs=graphs and on_cuda,
        fuse_pointwise=fused and graphs and on_cuda,
    )
    return Engine(config, graph_api=Recorder() if graphs and not on_cuda else None)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [(1, *torch.randint(3, vocab, (length - 1,), generator=gen).tolist()) for _ in range(count)]


def step_ms(engine: Engine, batch: int, context: int, steps: int, reps: int, device: str) -> list[float]:
    """Milliseconds per ``decode_step()`` of ``batch`` sequences at about ``context`` tokens each:
    one warm-up run of ``steps`` steps, then ``reps`` timed runs (each its own sample)."""
    params = SamplingParams(max_tokens=steps * (reps + 1) + 2)
    outs = engine.prefill([Request(p, params) for p in _prompts(batch, context, engine.vocab_size, batch)])
    samples = []
    try:
        for rep in range(reps + 1):
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                engine.decode_step()  # reads the sampled ids back: the device's work is inside
            elapsed = time.perf_counter() - start
            if rep:
                samples.append(elapsed / steps * 1e3)
    finally:
        for out in outs:
            engine.free(out.seq_id)
    return samples


def greedy_tokens(engine: Engine, count: int) -> list[list[int]]:
    """The greedy tokens of three fixed prompts, decoded in one batch."""
    prompts = _prompts(3, 24, engine.vocab_size, 7)
    outs = engine.prefill([Request(p, SamplingParams(max_tokens=count)) for p in prompts])
    tokens = {o.seq_id: [o.token_id] for o in outs}
    while engine.active_sequences():
        for out in engine.decode_step():
            tokens[out.seq_id].append(out.token_id)
    return [tokens[o.seq_id] for o in outs]


def _copy_gb_s(device: str, reps: int) -> float | None:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (median); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    src = torch.ones(256 << 20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(samples[1:]) / 1e9


def _weight_bytes(engine: Engine) -> int:
    """Bytes a decode step reads whole: every layer's projections and norms, the final norm and the
    output head (the embedding is only looked up)."""
    model = engine.model
    norms = [model.norm, *(t for layer in model.layers for t in (layer.ln_attn, layer.ln_mlp))]
    projections = [model.lm_head]
    for layer in model.layers:
        projections += [layer.qkv, layer.o, layer.gate_up, layer.down]
    return sum(p.nbytes for p in projections) + sum(t.numel() * t.element_size() for t in norms)


def run(model: Path, args: argparse.Namespace) -> dict:
    device, max_batch = args.device, max(args.batch)
    result: dict = dict(model=str(model), device=device, dtype=args.dtype, context=args.context)
    result["stand_in"] = not device.startswith("cuda")  # Recorder, not CUDA graphs: no speed meaning
    # tokens: fp32 must match exactly; the benchmark's dtype is reported
    on_cuda = device.startswith("cuda")  # the fused pointwise work needs CUDA graphs, not the stand-in
    for dtype in dict.fromkeys(("float32", args.dtype)):
        eager_tokens = greedy_tokens(_engine(model, device, dtype, False, 4), args.tokens)
        graph_tokens = greedy_tokens(_engine(model, device, dtype, True, 4), args.tokens)
        result[f"tokens_equal_{dtype}"] = eager_tokens == graph_tokens
        if on_cuda:
            fused_tokens = greedy_tokens(_engine(model, device, dtype, True, 4, fused=True), args.tokens)
            result[f"fused_tokens_equal_{dtype}"] = eager_tokens == fused_tokens
    eager = _engine(model, device, args.dtype, False, max_batch)
    graphs = _engine(model, device, args.dtype, True, max_batch)
    fused = _engine(model, device, args.dtype, True, max_batch, fused=True) if on_cuda else None
    if graphs.graphs is None:
        raise RuntimeError("the engine with cuda_graphs captured nothing")
    result["capture_s"] = graphs.graphs.capture_seconds
    result["fused_capture_s"] = fused.graphs.capture_seconds if fused is not None and fused.graphs else None
    result["buckets"] = list(graphs.graphs.captured)
    rows = []
    for batch in args.batch:
        eager_ms = step_ms(eager, batch, args.context, args.steps, args.reps, device)
        graph_ms = step_ms(graphs, batch, args.context, args.steps, args.reps, device)
        fused_ms = step_ms(fused, batch, args.context, args.steps, args.reps, device) if fused else None
        rows.append(
            dict(
                batch=batch,
                eager_ms=statistics.median(eager_ms),
                graph_ms=statistics.median(graph_ms),
                fused_ms=statistics.median(fused_ms) if fused_ms else None,
                eager_samples=eager_ms,
                graph_samples=graph_ms,
                fused_samples=fused_ms,
            )
        )
    result["rows"] = rows
    result["replays"] = graphs.graphs.replays
    result["eager_fallback_steps"] = graphs.graphs.eager_steps
    result["weight_bytes"] = _weight_bytes(graphs)
    result["copy_gb_s"] = _copy_gb_s(device, args.reps)
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(device)
    return result


def section(result: dict) -> str:
    where = result.get("gpu") or "CPU, with the Recorder stand-in (no speed meaning)"
    same_dtype = result[f"tokens_equal_{result['dtype']}"]
    lines = [
        f"## `{Path(result['model']).name}`, {result['dtype']}, on {where}",
        "",
        f"Decode steps at a {result['context']}-token context; captured buckets {result['buckets']} in "
        f"{result['capture_s']:.2f} s. Greedy tokens with graphs equal eager ones: fp32 "
        f"{result['tokens_equal_float32']}, {result['dtype']} {same_dtype}.",
        "",
        "Graphs + fused: the captured step with its pointwise work compiled into fused kernels "
        f"(`fuse_pointwise`; captured in {result.get('fused_capture_s') or 0:.2f} s, compilation included; "
        f"fp32 tokens equal eager ones: {result.get('fused_tokens_equal_float32', '–')}).",
        "",
        "| batch | eager ms/step | graphs ms/step | graphs + fused ms/step | eager / graphs "
        "| eager / fused |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ratio = row["eager_ms"] / row["graph_ms"]
        fused = row.get("fused_ms")
        cells = ["–", "–"] if not fused else [f"{fused:.3f}", f"{row['eager_ms'] / fused:.2f}"]
        lines.append(
            f"| {row['batch']} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} | {cells[0]} | {ratio:.2f} "
            f"| {cells[1]} |"
        )
    if result["copy_gb_s"]:
        floor = result["weight_bytes"] / (result["copy_gb_s"] / 2 * 1e9) * 1e3
        lines += [
            "",
            f"The weights ({result['weight_bytes'] / 1e6:.0f} MB) read once at half the measured copy rate "
            f"({result['copy_gb_s']:.0f} GB/s read + written): {floor:.3f} ms, the floor of a batch-1 step.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0", help="cuda:N; cpu runs the Recorder stand-in")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", action="append", type=int, help="batch sizes (default 1, 8, 64)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt compared")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    args.batch = args.batch or [1, 8, 64]
    if any(b < 1 for b in args.batch) or min(args.context, args.steps, args.reps, args.tokens) < 1:
        parser.error("--batch, --context, --steps, --reps and --tokens must be positive")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here (--device cpu runs the stand-in)")
    results = [run(ensure_model(m), args) for m in args.model]
    table = "# Captured decode steps against eager ones\n\nWritten by `perf/graph_bench.py`.\n\n" + "\n".join(
        section(r) for r in results
    )
    write_results(args.out_dir, "graph_bench", {"models": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
