"""What ``torch.compile`` does for inference on these CPU cores, beside this engine's own kernels.

Issue 13 asks for a compiled fast path through inductor (freezing, weight prepacking for oneDNN, fused
pointwise work) and allows custom kernels where a measurement shows inductor cannot get there. This is
that measurement, side by side in one run, on the same cores and model:

  - transformers, eager, with a static KV cache (the graph inductor compiles);
  - transformers through ``torch.compile(fullgraph=True, dynamic=False)`` with
    ``torch._inductor.config.freezing`` (weights folded as constants and prepacked for oneDNN), one
    graph per shape: the 300-token prefill and decode at each batch size;
  - this engine as the pools run it (its own projection and attention kernels),

all in ``--dtype``: bf16 (the pools' dtype where oneDNN runs bf16) or fp32 (an AVX2-only CPU's).

It reports prefill and decode tokens/s, milliseconds per call, and each compiled shape's compile time
(the first call, which the pools would pay at start-up per shape bucket). Repetitions are interleaved
(A B C A B C ...) and the median is reported.

    python -m perf.compile_bench [--model DIR ...] [--cores 0] [--reps R] [--batch 1 --batch 8]
        [--dtype bfloat16|float32]

Writes compile_bench.json and compile_bench.md into --out-dir (default perf/results/engine_1core).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor

from disagg.paths import resolve_model_dir
from disagg_tools.checkpoints import ensure_model
from perf.benchlib.outputs import write_results
from perf.engine_bench import EngineRunner, _interleaved, cpu_flags, table_row

RESULTS = Path(__file__).resolve().parent / "results" / "engine_1core"


class StaticCacheRunner:
    """transformers with a static KV cache, eager or compiled by inductor with freezing.

    One cache per batch size, reset between uses, so a compiled graph is reused (its guards see the
    same cache tensors) rather than recompiled per call.
    """

    def __init__(
        self, model_dir: Path, compiled: bool, max_len: int, mode: str | None = None, dtype: str = "bfloat16"
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        self.dtype = dtype
        self.compiled = compiled
        label = f"torch.compile (inductor, freezing{', ' + mode if mode else ''})"
        short = "bf16" if dtype == "bfloat16" else "fp32"
        self.name = f"transformers {short}, " + (label if compiled else "eager")
        self.max_len = max_len
        self.caches: dict[int, object] = {}
        self.compile_s: dict[str, float] = {}
        forward = self.model.forward
        options = dict(fullgraph=True, dynamic=False, mode=mode)
        self.forward = torch.compile(forward, **options) if compiled else forward

    def _cache(self, batch: int):
        from transformers import StaticCache

        cache = self.caches.get(batch)
        if cache is None:
            cache = self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            # The cache allocates on its first write; do that eagerly, so that no compiled graph is
            # specialised on an unallocated cache (its guards would fail on every later call).
            self.model(
                input_ids=torch.zeros(max(batch, 1), 1, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(1),
            )
        cache.reset()
        return cache

    def _call(self, shape: str, **kwargs):
        if not self.compiled or shape in self.compile_s:
            return self.forward(**kwargs)
        start = time.perf_counter()
        out = self.forward(**kwargs)
        self.compile_s[shape] = time.perf_counter() - start
        return out

    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> None:
        ids = torch.tensor([prompt])
        positions = torch.arange(len(prompt))
        cache = self._cache(0)  # its own cache: batch 1 of the decode rows keeps its graph's
        self._call(
            f"prefill {len(prompt)}",
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=positions,
            logits_to_keep=1,
        )

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        batch, context = len(prompts), len(prompts[0])
        cache = self._cache(batch)
        out = self.model(  # the prompts' KV, eager: only the decode step is timed
            input_ids=torch.tensor(prompts),
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(context),
            logits_to_keep=1,
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for i in range(steps):
            position = torch.tensor([context + i])
            out = self._call(
                f"decode batch {batch}",
                input_ids=token,
                past_key_values=cache,
                use_cache=True,
                cache_position=position,
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


def run(
    model_dir: Path,
    cores: tuple[int, ...],
    reps: int,
    prompt_len: int,
    context: int,
    steps: int,
    batches: tuple[int, ...],
    modes: tuple[str | None, ...],
    dtype: str = "bfloat16",
) -> dict:
    """One model's rows: every runner at every shape, and the compiled runner's compile times."""
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    inductor.freezing = True
    # Every runner compiles the same code object (transformers' forward), one graph per shape and
    # runner: more than dynamo's default limit of 8 per code object. A fresh start per model.
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return [1, *torch.randint(3, 1000, (n - 1,), generator=gen).tolist()]

    max_len = max(prompt_len, context + steps) + 1
    # The first call of each shape compiles it: _interleaved's warm-up call per runner takes it, so
    # no timed repetition includes a compile.
    compiled = [StaticCacheRunner(model_dir, True, max_len, mode, dtype) for mode in modes]
    eager = StaticCacheRunner(model_dir, False, max_len, dtype=dtype)
    runners = [eager, *compiled, EngineRunner(model_dir, dtype)]
    prompt = tokens(prompt_len)

    def time_prefill(runner) -> float:
        start = time.perf_counter()
        runner.prefill(prompt)
        return time.perf_counter() - start

    rows = []
    for name, sec in _interleaved(runners, time_prefill, reps).items():
        rows.append(dict(phase="prefill", runner=name, batch=1, tokens=prompt_len, seconds=sec))
    for batch in batches:
        prompts = [tokens(context) for _ in range(batch)]
        seconds = _interleaved(runners, lambda r, p=prompts: r.decode(p, steps), reps)
        for name, sec in seconds.items():
            rows.append(dict(phase="decode", runner=name, batch=batch, tokens=batch * steps, seconds=sec))
    engine = runners[-1].name
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        ours = next(
            r
            for r in rows
            if r["runner"] == engine and r["phase"] == row["phase"] and r["batch"] == row["batch"]
        )
        row["engine_speedup"] = row["seconds"] / ours["seconds"]
    return dict(
        model=str(model_dir),
        dtype=dtype,
        cores=list(cores),
        torch=torch.__version__,
        cpu_flags=cpu_flags(),
        prompt_tokens=prompt_len,
        decode_context=context,
        decode_steps=steps,
        reps=reps,
        rows=rows,
        compile_s={runner.name: runner.compile_s for runner in compiled},
    )


def section(result: dict) -> str:
    lines = [
        f"## `{Path(result['model']).name}`",
        "",
        f"Cores {result['cores']}, torch {result['torch']}, CPU {result['cpu_flags']}; prefill of one "
        f"{result['prompt_tokens']}-token prompt; decode at a {result['decode_context']}-token context, "
        f"{result['decode_steps']} steps; median of {result['reps']} interleaved repetitions.",
        "",
        "| phase | batch | runner | tokens/s | ms per call | engine's speed-up |",
        "|---|---:|---|---:|---:|---:|",
    ]
    lines += [table_row(r, [f"{r['engine_speedup']:.2f}"]) for r in result["rows"]]
    lines += ["", "Compile time of each shape (its first call, on these cores):", ""]
    for runner, shapes in result["compile_s"].items():
        times = ", ".join(f"{shape} {seconds:.1f} s" for shape, seconds in shapes.items())
        lines.append(f"- {runner}: {times}")
    return "\n".join(lines) + "\n"


def markdown(results: list[dict]) -> str:
    head = [
        f"# torch.compile (inductor) beside the engine's kernels, {results[0].get('dtype', 'bfloat16')}",
        "",
        "Written by `perf/compile_bench.py`. \"engine's speed-up\" is the row's time over the engine's "
        "time for the same phase and batch (above 1: the engine is faster).",
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(section(r) for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", action="append", help="checkpoint folder, repeatable")
    parser.add_argument("--cores", default=str(min(os.sched_getaffinity(0))))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 8)")
    parser.add_argument(
        "--mode",
        action="append",
        help="torch.compile mode, repeatable; 'default' is inductor's default "
        "(default: default and max-autotune-no-cudagraphs, whose CPU GEMM templates are tuned per shape)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    modes = tuple(
        None if m == "default" else m for m in args.mode or ("default", "max-autotune-no-cudagraphs")
    )
    cores = tuple(int(c) for c in args.cores.split(","))
    batches = tuple(args.batch or (1, 8))
    results = []
    for model in args.model or [None]:
        model_dir = ensure_model(resolve_model_dir(model))
        results.append(
            run(
                model_dir,
                cores,
                args.reps,
                args.prompt_tokens,
                args.context,
                args.steps,
                batches,
                modes,
                args.dtype,
            )
        )
    table = markdown(results)
    write_results(args.out_dir, "compile_bench", {"models": results}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
