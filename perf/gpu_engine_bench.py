"""Engine speed on a CUDA GPU: this engine vs transformers on the same GPU, side by side in one run.

Measures prefill tokens/s (one prompt) and decode tokens/s at batch 1, 8 and 32, for transformers
(SDPA, eager, fp32 and bf16; and bf16 with its static cache through ``generate``, which compiles the
forward itself on a GPU) and this engine (eager in fp32 and bf16, and bf16 with CUDA graphs), with
repetitions interleaved as ``engine_bench.py`` does on CPU cores. Below each table: the time to read the
weights once at the GPU's measured device-to-device copy bandwidth, the floor of a batch-1 decode step.

    python -m perf.gpu_engine_bench --model DIR [--model DIR ...] [--out-dir DIR]

Needs a CUDA device (run by ``perf/gpu_check.sh`` on a lent GPU machine). Writes gpu_engine_bench.json
and gpu_engine_bench.md into --out-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from disagg_tools.checkpoints import ensure_model
from perf.benchlib.outputs import write_results
from perf.benchlib.timing import median_time
from perf.engine_bench import EngineRunner, HFRunner, HFStaticRunner, _ms_per_call, measure, table_row


def _copy_gb_s(device: torch.device, reps: int) -> float:
    """Bytes read plus written per second by one 1 GiB device-to-device copy (median)."""
    src = torch.ones(256 << 20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)

    copy()
    return 2 * src.numel() * src.element_size() / median_time(copy, reps) / 1e9


def _weight_bytes(runner: EngineRunner) -> int:
    """Bytes a decode step reads whole: every layer's projections and norms, the final norm and the
    output head (the embedding table is only looked up; a tied head is counted once)."""
    model = runner.engine.model
    tensors = {id(model.norm): model.norm}
    for layer in model.layers:
        for t in (layer.ln_attn, layer.ln_mlp):
            tensors[id(t)] = t
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            tensors[id(projection.weight)] = projection.weight
    tensors[id(model.lm_head.weight)] = model.lm_head.weight
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run(model_dir: Path, device: str, reps: int, prompt_len: int, context: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return [1, *torch.randint(3, 1000, (n - 1,), generator=gen).tolist()]

    static = HFStaticRunner(model_dir, device, "bfloat16")
    runners = [
        HFRunner(model_dir, device, "float32"),
        HFRunner(model_dir, device, "bfloat16"),
        static,
        EngineRunner(model_dir, "float32", device=device),
        EngineRunner(model_dir, "bfloat16", device=device),
        EngineRunner(model_dir, "bfloat16", device=device, graphs=True),
    ]
    for runner in runners[3:]:
        runner.name = runner.name.replace("disagg engine", "disagg engine (cuda)")
    rows = measure(runners, tokens, prompt_len, context, steps, reps)
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]

    def rate(runner: str, like: dict) -> float:
        same = (
            r
            for r in rows
            if r["runner"] == runner and (r["phase"], r["batch"]) == (like["phase"], like["batch"])
        )
        return next(same)["tokens_per_s"]

    for row in rows:
        eager = f"transformers {'fp32' if row['dtype'] == 'float32' else 'bf16'} (sdpa)"
        row["vs_transformers"] = row["tokens_per_s"] / rate(eager, row)
        row["vs_static"] = (
            row["tokens_per_s"] / rate(static.name, row) if row["dtype"] == "bfloat16" else None
        )
    dev = torch.device(device)
    bf16 = runners[4]
    import transformers

    return dict(
        model=str(model_dir),
        gpu=torch.cuda.get_device_name(dev),
        torch=torch.__version__,
        transformers=transformers.__version__,
        static_compiled=static.compiled,
        reps=reps,
        prompt_tokens=prompt_len,
        decode_context=context,
        decode_steps=steps,
        copy_gb_s=_copy_gb_s(dev, reps),
        bf16_weight_bytes=_weight_bytes(bf16),
        rows=rows,
    )


def section(result: dict) -> str:
    lines = [
        f"## `{Path(result['model']).name}` on {result['gpu']}",
        "",
        f"torch {result['torch']}; prefill of one {result['prompt_tokens']}-token prompt; decode at a "
        f"{result['decode_context']}-token context, {result['decode_steps']} steps; median of "
        f"{result['reps']} interleaved repetitions. Ratios are against eager transformers in the same "
        f"dtype, and for bf16 against transformers' static-cache `generate` (transformers "
        f"{result.get('transformers', '?')}; torch.compile "
        f"{'ran' if result.get('static_compiled') else 'did NOT run'} in it).",
        "",
        "| phase | batch | runner | tokens/s | ms per call | × transformers, same dtype | × static cache |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    lines += [
        table_row(
            r, [f"{r['vs_transformers']:.2f}", "–" if r.get("vs_static") is None else f"{r['vs_static']:.2f}"]
        )
        for r in result["rows"]
    ]
    floor_ms = result["bf16_weight_bytes"] / (result["copy_gb_s"] / 2 * 1e9) * 1e3
    steps = {
        r["runner"]: _ms_per_call(r)
        for r in result["rows"]
        if r["phase"] == "decode"
        and r["batch"] == 1
        and r["runner"].startswith("disagg engine (cuda) bfloat16")
    }
    against = "; ".join(f"{ms:.2f} ms for {name}" for name, ms in steps.items())
    lines += [
        "",
        f"The bf16 weights are {result['bf16_weight_bytes'] / 1e6:.0f} MB; read once at half the measured "
        f"copy rate ({result['copy_gb_s']:.0f} GB/s read + written) they take {floor_ms:.3f} ms: the floor "
        f"of a batch-1 step, against {against}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device here")
    results = [
        run(ensure_model(m), args.device, args.reps, args.prompt_tokens, args.context, args.steps)
        for m in args.model
    ]
    table = "# Engine speed on a GPU\n\nWritten by `perf/gpu_engine_bench.py`.\n\n" + "\n".join(
        section(r) for r in results
    )
    write_results(args.out_dir, "gpu_engine_bench", {"models": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
