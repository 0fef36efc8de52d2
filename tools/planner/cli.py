"""``disagg profile`` (measure a pool's step times on its cores, fit, write a profile) and ``disagg plan``
(simulate the placements a machine allows from profiles, and recommend one).

    disagg profile --model .models/tiny --cores 0 --out profile-1.json
    disagg profile --model .models/tiny --cores 0,1 --out profile-2.json
    disagg plan --cores 2 --profile 1=profile-1.json --profile 2=profile-2.json \\
        --prompt lognormal:300:0.5 --output lognormal:64:0.5 --ttft 1.6 --tpot 0.068
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from disagg_tools.planner.lengths import parse_lengths
from disagg_tools.planner.machine import describe, gpu_placements, load_machine
from disagg_tools.planner.plan import Prediction, Traffic, plan, rank
from disagg_tools.planner.profile import DecodePoint, Fit, PrefillPoint, Profile
from disagg_tools.planner.simulator import ROUTINGS, Slo

PREFILL_SHAPES = [(16,), (64,), (128,), (256,), (512,), (1024,), (128,) * 4, (256,) * 4, (64,) * 8]
DECODE_SHAPES = [(1, 64), (4, 64), (16, 64), (1, 512), (4, 512), (8, 512), (16, 256), (2, 1024)]
QUICK_PREFILL = PREFILL_SHAPES[:5] + PREFILL_SHAPES[6:7]
QUICK_DECODE = [(1, 64), (4, 64), (8, 256), (2, 512)]


def measure(model: Path, cores: tuple[int, ...], dtype: str, repeats: int, quick: bool) -> Profile:
    """Step times of the reference engine pinned to ``cores`` (median of ``repeats``), fitted."""
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request

    engine = Engine(EngineConfig(model_dir=model, dtype=dtype, cores=cores, kv_cache_mb=512))
    limit = engine.model_config.max_context
    prefill_points, decode_points = [], []
    for shape in QUICK_PREFILL if quick else PREFILL_SHAPES:
        if max(shape) >= limit:
            continue
        seconds = []
        for r in range(repeats + 1):  # the first is a warm-up
            requests = [Request((1 + r,) * n, SamplingParams(max_tokens=1)) for n in shape]
            started = time.perf_counter()
            outs = engine.prefill(requests, decode=False)
            seconds.append(time.perf_counter() - started)
            for out in outs:
                engine.free(out.seq_id)
        prefill_points.append(PrefillPoint(shape, statistics.median(seconds[1:])))
    for batch, context in QUICK_DECODE if quick else DECODE_SHAPES:
        if context + repeats + 2 >= limit:
            continue
        params = SamplingParams(max_tokens=repeats + 3, min_length=repeats + 3)
        outs = engine.prefill([Request((1,) * context, params) for _ in range(batch)], decode=True)
        engine.decode_step()  # warm-up
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.decode_step()
            seconds.append(time.perf_counter() - started)
        decode_points.append(DecodePoint(batch, batch * (context + 2), statistics.median(seconds)))
        for out in outs:
            engine.free(out.seq_id)
    layout = engine.kv_layout
    return Profile.fitted(
        prefill_points,
        decode_points,
        cores=cores,
        model=str(model),
        dtype=dtype,
        kv_bytes_per_token=layout.bytes_per_token,
    )


def _fit_line(name: str, fit: Fit) -> str:
    return f"{name} fit: mean error {fit.mean_error:.1%}, worst {fit.max_error:.1%}"


def profile_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg profile", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="checkpoint folder (default: $MODEL_DIR, else the default)"
    )
    parser.add_argument("--cores", default="0", help="the cores the pool would get, e.g. 0 or 0,1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument(
        "--tpot-slo",
        type=float,
        default=0.0,
        help="also print the decode batch knee under this TPOT (seconds): the batch tuner's start",
    )
    parser.add_argument("--context", type=int, default=256, help="the knee's context per sequence")
    parser.add_argument("--max-batch", type=int, default=64, help="the knee's largest batch")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from disagg.paths import resolve_model_dir
    from disagg_tools.checkpoints import ensure_model

    cores = tuple(int(c) for c in args.cores.split(","))
    profile = measure(
        ensure_model(resolve_model_dir(args.model)), cores, args.dtype, args.repeats, args.quick
    )
    args.out.write_text(profile.to_json())
    print(_fit_line("prefill", profile.prefill))
    print(_fit_line("decode", profile.decode))
    if args.tpot_slo > 0:
        print(knee_line(profile, args.tpot_slo, args.context, args.max_batch))
    print(f"wrote {args.out}")
    return 0


def knee_line(profile: Profile, tpot_slo_s: float, context: int, max_batch: int) -> str:
    """The decode batch knee under a TPOT SLO on the fitted step-time curve at ``context`` tokens per
    sequence (``disagg.scheduling.tuner.batch_knee``): the batch tuner's ``batch_start``."""
    from disagg.scheduling.tuner import batch_knee

    curve = [(b, profile.decode_s(b, b * context)) for b in range(1, max_batch + 1)]
    try:
        knee = batch_knee(curve, tpot_slo_s)
    except ValueError as exc:
        return f"decode batch knee: none ({exc})"
    step = dict(curve)[knee]
    return (
        f"decode batch knee under a TPOT of {tpot_slo_s * 1000:.1f} ms at {context} tokens of context: "
        f"{knee} (step {step * 1000:.1f} ms, {knee / step:.0f} tokens/s)"
    )


def plan_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, help="cores of the machine (with --profile)")
    parser.add_argument(
        "--profile", action="append", default=[], metavar="K=FILE", help="the profile of a K-core pool"
    )
    parser.add_argument(
        "--machine",
        type=Path,
        help="a GPU machine description (YAML, e.g. deploy/machines/8xa100.yaml) instead of --cores and "
        "--profile: its instances' step times are predicted from the GPUs and the model's shape",
    )
    parser.add_argument("--context", type=int, default=2048, help="with --machine: context per sequence")
    parser.add_argument(
        "--prompt", default="lognormal:300:0.5", help="prompt lengths (fixed, uniform, lognormal)"
    )
    parser.add_argument("--output", default="lognormal:64:0.5", help="output lengths")
    parser.add_argument("--ttft", type=float, required=True, help="TTFT SLO, seconds")
    parser.add_argument("--tpot", type=float, required=True, help="TPOT SLO, seconds")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--transfer-gbps", type=float, default=0.0, help="KV hand-off rate, GB/s (0: free)")
    parser.add_argument("--chunk-tokens", type=int, default=0, help="also try colocated in chunks of this")
    parser.add_argument(
        "--relay-ms-per-token",
        type=float,
        default=0.0,
        help="what serving adds to a decode step per token it produces, ms (perf/relay_cost.py; 0: none)",
    )
    parser.add_argument(
        "--prefill-relay-ms-per-token",
        type=float,
        default=0.0,
        help="disaggregated: the entry points' CPU per token streamed, taken from the prefill instances "
        "whose cores they share, ms (perf/relay_cost.py; 0: none)",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="random",
        help="how requests meet a pool's instances: random (Triton's own assignment, load-oblivious: "
        "the default) or least_loaded (a router that knows each instance's queue)",
    )
    parser.add_argument(
        "--lend-tpot",
        type=float,
        default=None,
        help="on 2 cores with 1- and 2-core profiles, also the elastic pair whose decode instance lends its "
        "core to prefill within this TPOT budget, seconds (pools.decode.lend_tpot_s; e.g. half --tpot)",
    )
    parser.add_argument("--requests", type=int, default=300, help="simulated requests per rate")
    parser.add_argument("--top", type=int, default=None, help="print only the best N placements")
    args = parser.parse_args(argv)
    if args.machine is not None:
        return _plan_machine(args)
    if args.cores is None or not args.profile:
        parser.error("give --cores and --profile K=FILE (measured here), or --machine FILE")
    try:
        profiles = {}
        for item in args.profile:
            k, _, path = item.partition("=")
            profiles[int(k)] = Profile.load(Path(path))
        traffic = Traffic(parse_lengths(args.prompt), parse_lengths(args.output), args.requests)
    except (ValueError, OSError) as exc:
        print(f"disagg plan: {exc}", file=sys.stderr)
        return 2
    for k, p in sorted(profiles.items()):
        fits = f"{_fit_line('prefill', p.prefill)}; {_fit_line('decode', p.decode)}"
        print(f"{k}-core profile ({p.model}, {p.dtype}): {fits}")
    results = plan(
        args.cores,
        profiles,
        traffic,
        Slo(args.ttft, args.tpot),
        transfer_bytes_per_s=args.transfer_gbps * 1e9,
        chunk_tokens=args.chunk_tokens,
        target=args.attainment,
        relay_s_per_token=args.relay_ms_per_token / 1e3,
        prefill_relay_s_per_token=args.prefill_relay_ms_per_token / 1e3,
        routing=args.routing,
        lend_tpot_s=args.lend_tpot,
    )
    _table(results, "cores", "per core")
    return 0


def _table(results: list[Prediction], unit: str, per: str, top: int | None = None) -> None:
    print(f"\n| placement | {unit} | goodput (req/s) | {per} | TTFT p90 (ms) | TPOT p90 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results[:top]:
        ttft = "–" if r.ttft_p90_s is None else f"{r.ttft_p90_s * 1000:.0f}"
        tpot = "–" if r.tpot_p90_s is None else f"{r.tpot_p90_s * 1000:.1f}"
        print(f"| {r.name} | {r.cores} | {r.goodput_rps:.2f} | {r.per_core:.2f} | {ttft} | {tpot} |")
    best = results[0] if results else None
    if best is not None:
        print(f"\nrecommended (predicted, not measured): {best.name}, {best.goodput_rps:.2f} req/s")


def _plan_machine(args: argparse.Namespace) -> int:
    """``disagg plan --machine``: every placement of the machine's GPUs, from predicted step times."""
    try:
        machine = load_machine(args.machine)
        traffic = Traffic(parse_lengths(args.prompt), parse_lengths(args.output), args.requests)
    except (ValueError, OSError) as exc:
        print(f"disagg plan: {exc}", file=sys.stderr)
        return 2
    about = describe(machine)
    print(
        f"{about['machine']}: {about['gpus']} GPUs, {about['model']} ({about['params_b']} B parameters, "
        f"{about['kv_kb_per_token']} KiB of KV per token); tensor-parallel sizes that fit: "
        f"{about['tp_that_fit']}. Step times are PREDICTED from the GPUs' peak, bandwidth and links "
        "(tools/planner/machine.py), not measured."
    )
    placements = gpu_placements(machine, args.context)
    slo = Slo(args.ttft, args.tpot)
    results = rank(placements, traffic, slo, args.attainment, per_instance=True, steps=8)
    _table(results, "GPUs", "per GPU", top=args.top)
    return 0
