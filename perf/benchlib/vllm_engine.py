"""vLLM CPU's offline engine (``vllm.LLM``) measured the way ``perf/engine_bench.py`` measures ours.

Run by ``engine_bench.py`` with the interpreter of ``.venv-vllm`` (vLLM lives in a venv of its own),
pinned by the caller to the cores it measures on, and told those cores through
``VLLM_CPU_OMP_THREADS_BIND`` so that vLLM computes on all of them (its default ``auto`` keeps one
core for itself). Every prompt is unique (vLLM caches prefixes by default, and chunked prefill stays
at its default), generation is greedy with ``ignore_eos``.

It measures on request, so that the caller interleaves vLLM's repetitions with its own runners': it
reads one command per line from stdin and answers each on the file descriptor ``--reply-fd`` with one
JSON line ``{"seconds": s}`` (vLLM logs to stdout, so the answers have a channel of their own):

  - ``prefill``: one prompt of ``--prompt-tokens`` with ``max_tokens=1``;
  - ``decode B``: B prompts of ``--context`` tokens with ``max_tokens = steps + 1``, less the time of
    B other prompts of the same length with ``max_tokens=1`` (their prefill, measured alone): the
    time of ``--steps`` decode steps at batch B.

It ends at the end of its input.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn from 3..vocab")
    parser.add_argument("--reply-fd", type=int, required=True, help="where the answers go")
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0)
    rng = random.Random(0)

    def prompts(batch: int, n: int) -> list[dict]:
        return [
            {"prompt_token_ids": [1, *(rng.randrange(3, args.vocab) for _ in range(n - 1))]}
            for _ in range(batch)
        ]

    def timed(batch: int, n: int, max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts(batch, n), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
            raise SystemExit("vLLM returned fewer tokens than asked (ignore_eos)")
        return elapsed

    timed(1, args.prompt_tokens, 1)  # warm-up: compilation, allocator
    with open(args.reply_fd, "w") as replies:
        for line in sys.stdin:
            command = line.split()
            if command == ["prefill"]:
                seconds = timed(1, args.prompt_tokens, 1)
            elif len(command) == 2 and command[0] == "decode" and command[1].isdigit():
                batch = int(command[1])
                seconds = timed(batch, args.context, args.steps + 1) - timed(batch, args.context, 1)
            else:
                raise SystemExit(f"unknown command {line.strip()!r}")
            replies.write(json.dumps({"seconds": seconds}) + "\n")
            replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
