"""Decode attention over the paged KV cache: the engine's kernel against the PyTorch alternatives.

For one decode step's attention in one layer (one query row per sequence), on one core, at uniform
and mixed context lengths (one 1,000-token sequence among short ones):
  - ``kernel, one call``: the engine's bf16 path (``disagg.engine.kernel.decode_attention``): every
    row in one call, reading only its own blocks from the cache, fp32 scores and softmax;
  - ``grouped matmul``: the engine's PyTorch path without its kernels (``Transformer._attend_batch``):
    sequences grouped by block count (widths a power of 4 apart), per group a gather, then batched
    matmuls with a float32 softmax in bf16 (SDPA in fp32);
  - ``grouped SDPA``: the same groups through PyTorch's fused CPU SDPA kernel (the earlier path);
  - ``padded, one call``: every sequence padded to the longest, one gather and one SDPA call;
  - ``flat, one call``: no per-group loop and no padding: the used blocks of all sequences gathered
    flat, scores per position against its own sequence's query, a segmented softmax by
    ``index_reduce`` / ``index_add``.

All four read the same cache and give the same result within bf16 rounding (checked here). Writes
perf/results/attention_bench.json and .md.

    python -m perf.attention_bench [--model DIR] [--dtype bfloat16] [--core N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from disagg.engine import kernel
from disagg.engine.device import kernel_threads
from disagg.engine.engine import Engine, EngineConfig
from disagg.paths import resolve_model_dir
from disagg_tools.checkpoints import ensure_model
from perf.benchlib.timing import median_time

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = {
    "1 x 100": [100],
    "8 x 128": [128] * 8,
    "1 x 1000 + 7 x 50": [1000] + [50] * 7,
    "32 x 200": [200] * 32,
    "1 x 1000 + 31 x 60": [1000] + [60] * 31,
}


def grouped_sdpa(
    q: torch.Tensor, cache: torch.Tensor, layer: int, groups: list, kv_heads: int
) -> torch.Tensor:
    out = torch.empty_like(q)
    for rows, table, span, bias in groups:
        b = rows.shape[0]
        keys = cache[:, layer, 0].index_select(0, table).view(b, span, kv_heads, -1).transpose(1, 2)
        values = cache[:, layer, 1].index_select(0, table).view(b, span, kv_heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q[rows][:, :, None], keys, values, attn_mask=bias, enable_gqa=True
        )
        out[rows] = attn[:, :, 0]
    return out


def padded(
    q: torch.Tensor, cache: torch.Tensor, layer: int, table: torch.Tensor, bias: torch.Tensor, kv_heads: int
):
    b, span = q.shape[0], bias.shape[-1]
    keys = cache[:, layer, 0].index_select(0, table).view(b, span, kv_heads, -1).transpose(1, 2)
    values = cache[:, layer, 1].index_select(0, table).view(b, span, kv_heads, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=bias, enable_gqa=True)[
        :, :, 0
    ]


def flat(
    q: torch.Tensor, cache: torch.Tensor, layer: int, blocks: torch.Tensor, seq: torch.Tensor, past, kv_heads
):
    b, heads, head_dim = q.shape
    keys = cache[:, layer, 0].index_select(0, blocks).view(-1, kv_heads, head_dim)  # [S, nkv, hd]
    values = cache[:, layer, 1].index_select(0, blocks).view(-1, kv_heads, head_dim)
    queries = q.view(b, kv_heads, -1, head_dim).index_select(0, seq).float()  # [S, nkv, g, hd]
    scores = torch.matmul(queries, keys.float()[..., None])[..., 0] * head_dim**-0.5  # [S, nkv, g]
    scores = scores.masked_fill(past[:, None, None], float("-inf"))
    top = torch.full((b, *scores.shape[1:]), float("-inf")).index_reduce_(0, seq, scores, "amax")
    weights = torch.exp(scores - top.index_select(0, seq))
    total = torch.zeros_like(top).index_add_(0, seq, weights)
    out = torch.zeros(b, *scores.shape[1:], head_dim).index_add_(
        0, seq, weights[..., None] * values.float()[:, :, None]
    )
    return (out / total[..., None]).to(q.dtype).view(b, heads, head_dim)


def scenario(engine: Engine, lengths: list[int], reps: int) -> dict:
    model, cache = engine.model, engine.kv.cache
    cfg, bs = model.cfg, cache.shape[3]
    gen = torch.Generator().manual_seed(len(lengths))
    order = torch.randperm(cache.shape[0], generator=gen)
    tables, used = [], 0
    for length in lengths:
        count = -(-(length + 1) // bs)
        tables.append(order[used : used + count])
        used += count
    width = max(len(t) for t in tables)
    block_table = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    positions = torch.tensor(lengths)
    q = torch.randn(len(lengths), cfg.num_heads, cfg.head_dim, generator=gen).to(model.dtype)
    groups = model._length_groups(positions, block_table, bs)
    span = width * bs
    past = torch.arange(span)[None, :] > positions[:, None]
    pad_bias = torch.zeros(past.shape).masked_fill_(past, float("-inf"))[:, None, None, :]
    flat_blocks = torch.cat(tables)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([len(t) * bs for t in tables]))
    offsets = torch.cat([torch.arange(len(t) * bs) for t in tables])
    flat_past = offsets > positions[seq]
    kvh = cfg.num_kv_heads
    runs = {}
    attend = kernel.decode_attention() if model.dtype == torch.bfloat16 else None
    if attend is not None:

        def one_call() -> torch.Tensor:
            with kernel_threads():  # on the kernels' team, as in an engine step
                return attend(q, cache, 0, block_table, positions)

        runs["kernel, one call"] = one_call
    runs |= {
        "grouped matmul": lambda: model._attend_batch(q, cache, 0, groups),
        "grouped SDPA": lambda: grouped_sdpa(q, cache, 0, groups, kvh),
        "padded, one call": lambda: padded(q, cache, 0, block_table.reshape(-1), pad_bias, kvh),
        "flat, one call": lambda: flat(q, cache, 0, flat_blocks, seq, flat_past, kvh),
    }
    with torch.inference_mode():
        reference = runs["grouped SDPA"]().float()
        errors = {name: (run().float() - reference).abs().max().item() for name, run in runs.items()}
        times = {name: median_time(run, reps, warmup=3) * 1e6 for name, run in runs.items()}
    return dict(lengths=lengths, groups=len(groups), microseconds=times, max_abs_diff_vs_sdpa=errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--core", type=int, default=min(os.sched_getaffinity(0)))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(resolve_model_dir(args.model))
    engine = Engine(
        EngineConfig(
            model_dir=model_dir, dtype=args.dtype, num_blocks=4096, cores=(args.core,), num_threads=1
        )
    )
    engine.kv.cache.normal_()  # keys and values that make the softmax non-trivial
    results = {name: scenario(engine, lengths, args.reps) for name, lengths in SCENARIOS.items()}
    out = dict(
        model=str(model_dir), dtype=args.dtype, core=args.core, torch=torch.__version__, results=results
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "attention_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    names = list(next(iter(results.values()))["microseconds"])
    lines = [
        f"# Decode attention, one layer, `{model_dir.name}` {args.dtype}, core {args.core}",
        "",
        "Written by `perf/attention_bench.py`. Microseconds per call (median of "
        f"{args.reps}); in brackets the largest difference from grouped SDPA's output.",
        "",
        "| sequences x context | groups | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for name, r in results.items():
        cells = [f"{r['microseconds'][n]:.0f} ({r['max_abs_diff_vs_sdpa'][n]:.1g})" for n in names]
        lines.append(f"| {name} | {r['groups']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (args.out_dir / "attention_bench.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
