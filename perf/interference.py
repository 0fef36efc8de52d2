"""The source article's interference experiment against one deployment.

Run 1: decode-only load, `--count` requests with 10-token prompts and 64 output tokens, Poisson at
`--rate`. Run 2: the same arrivals with `--long-share` (20 %) of the requests carrying unique
`--long-prompt`-token (300) prompts instead. Reports TPOT p50/p99 of the SHORT requests in both runs and
the ratio mixed / decode-only: under continuous batching each long prefill stalls the decode batch, while
a disaggregated deployment should stay flat.

    python -m perf.interference --kind triton --url 127.0.0.1:8001 --model ensemble --rate 4
    python -m perf.interference --kind openai --url http://127.0.0.1:8000 --model tiny --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from perf.benchlib.clients import make_client
from perf.benchlib.cliutil import add_target_args, client_config, log, pin_self, write_json
from perf.benchlib.experiment import interference
from perf.benchlib.metrics import Slo
from perf.benchlib.workload import PromptFactory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_args(parser)
    parser.add_argument("--rate", type=float, required=True, help="requests/s (Poisson), both runs")
    parser.add_argument("--count", type=int, default=100, help="requests per run")
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--long-prompt", type=int, default=300, help="tokens of the long prompts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ttft-slo", type=float, default=10.0, help="only for the runs' attainment")
    parser.add_argument("--tpot-slo", type=float, default=1.0, help="only for the runs' attainment")
    parser.add_argument("--loadgen-cpus", default=None, help="pin this load generator, e.g. '0'")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "out" / "interference.json"
    )
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    pin_self(args.loadgen_cpus)
    factory = PromptFactory.from_model_dir(args.model_dir)
    client = make_client(client_config(args))
    await client.open()
    try:
        result = await interference(
            client, factory, args.rate, args.count, Slo(args.ttft_slo, args.tpot_slo), args.seed,
            args.long_share, args.long_prompt,
        )  # fmt: skip
    finally:
        await client.close()
    fig = result.figures()
    for run in ("decode_only", "mixed"):
        errors = getattr(result, run).summary.n_errors
        log(
            f"{run:>11}: short TPOT p50 {fig[f'{run}_tpot_p50']} s, p99 {fig[f'{run}_tpot_p99']} s "
            f"({errors} errors)"
        )
    log(f"ratio mixed/decode-only: p50 {fig['ratio_p50']}, p99 {fig['ratio_p99']}")
    write_json(args.out, result.to_dict(with_records=True))
    log(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
