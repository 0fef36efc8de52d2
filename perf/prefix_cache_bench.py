"""Time to first token in the engine with a cached prompt prefix, against the same prompt computed
whole, side by side in one run (the engine's part of the hot-prompts issue; the serving benchmark of
bursts and isolation is ``perf/hot_prompts.py``'s job, not built yet).

For each shared-prefix length, a prompt is a shared prefix plus a tail of ``--tail`` tokens unique to
each repetition. "whole" prefills it on an engine with the prefix cache off; "cached" prefills it on
an engine with the cache on, after one prompt with the same prefix warmed the cache, so only the
blocks after the prefix (and a partial last block) are computed. Repetitions alternate between the
two engines (A B A B ...), so drift on a shared machine hits both alike; medians are reported.

    python -m perf.prefix_cache_bench [--model DIR] [--cores 0] [--dtype bfloat16] [--prefix 32,256,1024]

Writes prefix_cache_bench.json and prefix_cache_bench.md into --out-dir (default perf/results/).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.paths import resolve_model_dir
from disagg_tools.checkpoints import ensure_model

RESULTS = Path(__file__).resolve().parent / "results"


def _ttft(engine: Engine, prompt: tuple[int, ...]) -> float:
    """Seconds to prefill ``prompt`` and sample its first token (the sequence is dropped after)."""
    start = time.perf_counter()
    engine.prefill([Request(prompt, SamplingParams(max_tokens=1))])
    return time.perf_counter() - start


def measure(
    model_dir: Path, cores: tuple[int, ...], dtype: str, prefixes: list[int], tail: int, reps: int
) -> dict:
    def engine(cache: bool) -> Engine:
        config = EngineConfig(
            model_dir=model_dir, dtype=dtype, cores=cores, kv_cache_mb=256, prefix_cache=cache
        )
        return Engine(config)

    whole, cached = engine(False), engine(True)
    vocab = whole.vocab_size
    rng = random.Random(0)
    rows = []
    for length in prefixes:
        prefix = tuple(rng.randrange(3, vocab) for _ in range(length))

        def prompt(prefix: tuple[int, ...] = prefix) -> tuple[int, ...]:
            return prefix + tuple(rng.randrange(3, vocab) for _ in range(tail))

        _ttft(whole, prompt())  # warm-up, and the cache's first copy of the prefix
        _ttft(cached, prompt())
        hits_before = cached.usage().prefix_hits
        times: dict[str, list[float]] = {"whole": [], "cached": []}
        for _ in range(reps):
            times["whole"].append(_ttft(whole, prompt()))
            times["cached"].append(_ttft(cached, prompt()))
        hit_blocks = (cached.usage().prefix_hits - hits_before) / reps
        w, c = statistics.median(times["whole"]), statistics.median(times["cached"])
        rows.append(
            {
                "prefix_tokens": length,
                "prompt_tokens": length + tail,
                "whole_ms": w * 1e3,
                "cached_ms": c * 1e3,
                "speedup": w / c,
                "cached_tokens_per_prompt": hit_blocks * cached.config.block_size,
            }
        )
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: $MODEL_DIR or the tiny model)"
    )
    parser.add_argument("--cores", default="0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix", default="32,256,1024", help="shared-prefix lengths in tokens")
    parser.add_argument("--tail", type=int, default=24, help="tokens after the shared prefix")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = ensure_model(resolve_model_dir(args.model))
    cores = tuple(int(c) for c in args.cores.split(","))
    prefixes = [int(p) for p in args.prefix.split(",")]
    result = {
        "model": str(model_dir),
        "cores": list(cores),
        "dtype": args.dtype,
        "tail_tokens": args.tail,
        "reps": args.reps,
        "machine": platform.processor() or platform.machine(),
        **measure(model_dir, cores, args.dtype, prefixes, args.tail, args.reps),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prefix_cache_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Prefix cache: TTFT in the engine ({model_dir.name}, {args.dtype}, cores {args.cores})",
        "",
        f"A shared prefix plus {args.tail} unique tokens; medians of {args.reps} alternating repetitions.",
        "",
        "| shared prefix | prompt | whole prefill | cached prefix | speed-up | tokens taken from the cache |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['prefix_tokens']} | {r['prompt_tokens']} | {r['whole_ms']:.1f} ms "
            f"| {r['cached_ms']:.1f} ms | {r['speedup']:.2f}x | {r['cached_tokens_per_prompt']:.0f} |"
        )
    (args.out_dir / "prefix_cache_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
