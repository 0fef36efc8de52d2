"""vLLM CPU's offline engine (``vllm.LLM``) measured the way ``perf/engine_bench.py`` measures ours.

Run by ``engine_bench.py`` with the interpreter of ``.venv-vllm`` (vLLM lives in a venv of its own),
pinned by the caller to the cores it measures on, and told those cores through
``VLLM_CPU_OMP_THREADS_BIND`` so that vLLM computes on all of them (its default ``auto`` keeps one
core for itself). Every prompt is unique (vLLM caches prefixes by default, and chunked prefill stays
at its default), generation is greedy with ``ignore_eos``:

  - prefill: one prompt of ``--prompt-tokens`` with ``max_tokens=1``;
  - decode at batch B: B prompts of ``--context`` tokens with ``max_tokens = steps + 1``; the decode
    time is the total minus the time of B other prompts of the same length with ``max_tokens=1``
    (their prefill, measured alone), and the rate is B x steps / that time.

Writes one JSON object to ``--out``: the median seconds of each measurement over ``--reps`` (vLLM
logs to stdout, also after the run, so the figures go to a file of their own).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn from 3..vocab")
    parser.add_argument("--out", required=True, help="where the JSON result goes")
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0)
    rng = random.Random(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [1, *(rng.randrange(3, args.vocab) for _ in range(n - 1))]}

    def timed(prompts: list[dict], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
            raise SystemExit("vLLM returned fewer tokens than asked (ignore_eos)")
        return elapsed

    timed([prompt(args.prompt_tokens)], 1)  # warm-up: compilation, allocator
    result: dict = {"prefill_s": None, "decode": {}}
    result["prefill_s"] = statistics.median(timed([prompt(args.prompt_tokens)], 1) for _ in range(args.reps))
    for batch in (int(b) for b in args.batches.split(",")):
        timed([prompt(args.context) for _ in range(batch)], args.steps + 1)  # warm-up of this batch shape
        totals, prefills = [], []
        for _ in range(args.reps):
            totals.append(timed([prompt(args.context) for _ in range(batch)], args.steps + 1))
            prefills.append(timed([prompt(args.context) for _ in range(batch)], 1))
        total, prefill = statistics.median(totals), statistics.median(prefills)
        result["decode"][str(batch)] = {"total_s": total, "prefill_s": prefill, "decode_s": total - prefill}
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
