"""Hot prompts measured: a burst of similar prompts amid steady traffic, and a chat workload.

**Burst** (the source's scenario, in one run). Other users send unique prompts (`--other-tokens`,
`--other-output` tokens out) open-loop Poisson at `--rate` for the whole run. At `--burst-at` s a burst
of `--burst-count` prompts arrives at `--burst-rate`: one shared prefix of `--prefix-tokens` tokens
plus a short unique tail each (a promotion's templated question), `--hot-output` tokens out. Reported
per setup: the other users' TTFT and TPOT p99 before the burst (arrivals before it) and during it
(arrivals from its first to `--tail` s after its last), the hot requests' own TTFT p50 / p99 and how
many were refused, and the goodput of the whole trace (other users judged by the frozen `chat` SLOs,
hot ones by `codegen`'s). Setups, each a fresh Triton on a repository of `disagg repository`
(`--kv-cache-mb 1024`: prefill and decode hold vLLM's 2 GiB of KV between them), disaggregated, to
`ensemble`:

- `none`: no prefix cache, no isolation (the default repository);
- `cache`: `--prefix-cache`;
- `isolation`: `--hot-group-rate R` (each hot group starts at most R requests/s, waiting at most
  30 s; on two cores the hot pool has no core of its own, so the token bucket is the isolation);
- `both`: the two;
- `adaptive`: `both` with `--hot-rate-adaptive`: R is the group rate's maximum, and it halves while
  the decode pool's mean step time is over 1.1x its step time before the burst
  (`disagg.hot.throttle`);
- `hot_pool` (with `--hot-pool`): `--prefix-cache --hot-decode-cores 1`, hot groups decoded on a
  second decode pool sharing the decode core at nice 5: what two cores allow of a dedicated pool.

**Chat**. Unique user messages in the model's chat template, so the only shared part is the
template's system prompt, Poisson at `--chat-rate`: TTFT p50 / p99 and goodput (`chat` SLOs) with the
cache off and on. Two workloads: `chat`, the model's default system prompt, and `chat_system`, an
operator's system prompt of `--system-tokens` tokens (0: not run).

vLLM CPU runs both workloads side by side, as its users run it: bf16, computing on both cores, with
`--enable-prefix-caching` (and `--no-enable-prefix-caching` for its own cache-off line); its exact
command line is in the report. One run per setup; the setups run one after another. With
`--repeats N` each setup's burst runs N times (seeds seed..seed+N-1, a fresh trace and server each):
each run is split by its own burst, then the runs are pooled, so the p99s are over N times the
requests (one run's "during" window holds 35-46 other users: its p99 is its slowest one or two), and
each run's own ratio is shown beside; its report goes to a section of its own in `--report`.

    .venv/bin/python -m perf.hot_prompts --model-dir .models/smollm2-135m-instruct

Writes `<out-dir>/hot_prompts.json`, `.md` and `.png`, and its section of `--report` (perf/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sys
import tempfile
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from disagg.serverconfig import parse_cpus
from perf.benchlib.arrivals import poisson_arrivals
from perf.benchlib.clients import ClientConfig, make_client
from perf.benchlib.cliutil import log, machine, pin_self, write_json
from perf.benchlib.deploy import (
    VllmConfig,
    VllmServer,
    start_triton,
    vllm_command_line,
    with_orchestrator_parameters,
)
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, Slo, percentile
from perf.benchlib.report import with_section
from perf.benchlib.slo import SLO_FILE, load_frozen
from perf.benchlib.workload import PromptFactory, RequestSpec, new_salt

REPO_ROOT = Path(__file__).resolve().parents[1]
BURST_SETUPS = {  # setup -> disagg repository flags (the group rate is added where it says "rate")
    "none": [],
    "cache": ["--prefix-cache"],
    "isolation": ["rate"],
    "both": ["--prefix-cache", "rate"],
    "adaptive": ["--prefix-cache", "rate", "--hot-rate-adaptive"],  # both, the group rate adaptive
    "hot_pool": ["--prefix-cache", "--hot-decode-cores", "1"],
}
CHAT_SETUPS = {"off": [], "on": ["--prefix-cache"]}
HOT_ROUTES = ("cold", "hot_shared", "hot_pool", "hot_delayed", "hot_refused")


def counters(metrics_url: str) -> dict[str, float]:
    """The hot routes, the prefill pool's prefix-cache blocks and the adaptive hot-group cap's decisions
    so far (summed over series)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out = {f"route_{r}": 0.0 for r in HOT_ROUTES} | {"cache_hits": 0.0, "cache_misses": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "disagg_hot_routes_total" and sample.labels.get("model") == "orchestrator":
                out[f"route_{sample.labels['route']}"] += sample.value
            elif sample.name == "disagg_prefix_cache_hits_total" and sample.labels.get("pool") == "prefill":
                out["cache_hits"] += sample.value
            elif sample.name == "disagg_prefix_cache_misses_total" and sample.labels.get("pool") == "prefill":
                out["cache_misses"] += sample.value
            elif (
                sample.name == "disagg_hot_rate_decisions_total"
                and sample.labels.get("model") == "orchestrator"
            ):
                key = f"rate_{sample.labels['action']}"  # the adaptive cap's decisions, by action
                out[key] = out.get(key, 0.0) + sample.value
    return out


# ---- traces ------------------------------------------------------------------------------------------


def burst_trace(
    args: argparse.Namespace, factory: PromptFactory, salt: str, seed: int | None = None
) -> list[RequestSpec]:
    rng = np.random.default_rng(args.seed if seed is None else seed)
    span = args.burst_count / args.burst_rate
    duration = args.burst_at + span + args.tail
    others = poisson_arrivals(args.rate, max(1, int(args.rate * duration * 2) + 10), rng)
    specs = [
        RequestSpec(0, float(t), factory.make(args.other_tokens, f"{salt}o{i}", rng), args.other_tokens,
                    args.other_output, "other")
        for i, t in enumerate(others) if t < duration
    ]  # fmt: skip
    prefix = factory.make(args.prefix_tokens, f"{salt}hot", rng)
    hot_at = poisson_arrivals(args.burst_rate, args.burst_count, rng)
    for i, t in enumerate(hot_at):
        words = "".join(factory.words[j] for j in rng.integers(0, len(factory.words), size=args.tail_tokens))
        prompt = f"{prefix} Question {i}:{words}"
        specs.append(
            RequestSpec(0, args.burst_at + float(t), prompt, factory.count(prompt), args.hot_output, "hot")
        )
    specs.sort(key=lambda s: s.arrival)
    return [replace(s, index=i) for i, s in enumerate(specs)]


def chat_trace(
    args: argparse.Namespace, factory: PromptFactory, salt: str, system_tokens: int = 0
) -> list[RequestSpec]:
    """Unique user messages in the chat template; ``system_tokens``: an operator's system prompt of
    that length (0: the template's default one)."""
    import jinja2

    config = json.loads((args.model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if not template:
        raise SystemExit(f"{args.model_dir} has no chat template: the chat workload needs one")
    render = jinja2.Environment(autoescape=False).from_string(template).render
    rng = np.random.default_rng(args.seed + 1)
    system = factory.make(system_tokens, f"{salt}sys", rng) if system_tokens else None
    arrivals = poisson_arrivals(args.chat_rate, max(1, int(args.chat_rate * args.chat_duration)), rng)
    specs = []
    for i, t in enumerate(arrivals):
        message = factory.make(args.chat_tokens, f"{salt}c{i}", rng)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": message}
        ]
        prompt = render(messages=messages, add_generation_prompt=True)
        specs.append(RequestSpec(i, float(t), prompt, factory.count(prompt), args.chat_output, "chat"))
    return specs


def shared_prefix_tokens(factory: PromptFactory, trace: list[RequestSpec]) -> int:
    """Tokens the first two prompts of a kind share from their start."""
    a, b = (factory.tokenizer.encode(s.prompt).ids for s in trace[:2])
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- runs --------------------------------------------------------------------------------------------


async def replay(
    client_config: ClientConfig, trace: list[RequestSpec], factory: PromptFactory
) -> list[RequestRecord]:
    client = make_client(client_config)
    await client.open()
    try:
        horizon = trace[-1].arrival + 1
        return await run_trace(
            client, trace, LoadConfig(max_duration_s=horizon, drain_timeout_s=180), factory.count_output
        )
    finally:
        await client.close()


def triton_run(
    args: argparse.Namespace,
    scratch: Path,
    name: str,
    flags: list[str],
    trace: list[RequestSpec],
    factory: PromptFactory,
) -> tuple[list[RequestRecord], dict[str, float]]:
    from disagg_tools.repository import main as write_repository

    out = scratch / f"repository-{name}"
    flags = [
        f
        for flag in flags
        for f in (["--hot-group-rate", f"{args.hot_group_rate:g}"] if flag == "rate" else [flag])
    ]
    flags = ["--kv-cache-mb", str(args.kv_cache_mb), *flags]
    with contextlib.redirect_stderr(io.StringIO()):  # it lists every file it writes
        written = write_repository(["--out", str(out), *flags])
    if written != 0:
        raise RuntimeError(f"disagg repository failed for {name}")
    tuned = {
        k: str(v)
        for k, v in (
            ("hot_prompts.threshold", args.hot_threshold),
            ("hot_prompts.group_burst", args.hot_group_burst),
        )
    }
    tuned = {k: v for k, v in tuned.items() if v != "None"}
    if tuned:  # the entry points' hot-prompt settings, where they differ from the defaults
        out = with_orchestrator_parameters(out, scratch / f"tuned-{name}", tuned)
    server = start_triton(
        out, scratch / name, args.model_dir, exit_timeout_s=10, cpus=parse_cpus(args.server_cpus)
    )
    try:
        before = counters(server.config.metrics_url)
        config = ClientConfig(kind="triton", url=server.config.grpc_url, model="ensemble")
        records = asyncio.run(replay(config, trace, factory))
        after = counters(server.config.metrics_url)
    finally:
        server.stop(grace_s=5)
    return records, {k: after[k] - before[k] for k in after}


def vllm_config(args: argparse.Namespace, caching: bool) -> VllmConfig:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    return VllmConfig(model_dir=args.model_dir.resolve(), cpus="0,1", omp_bind="0-1", dtype="bfloat16",
                      served_name=args.model_dir.name, extra_args=(flag,),
                      log_path=args.out_dir / f"vllm-{'cache' if caching else 'nocache'}.log")  # fmt: skip


def vllm_runs(
    args: argparse.Namespace, caching: bool, traces: dict[str, list[RequestSpec]], factory: PromptFactory
) -> tuple[dict[str, list[RequestRecord]], str]:
    config = vllm_config(args, caching)
    with VllmServer(config).start() as server:
        server.wait_healthy()
        client = ClientConfig(kind="openai", url=config.url, model=config.served_name)
        records = {name: asyncio.run(replay(client, trace, factory)) for name, trace in traces.items()}
    return records, vllm_command_line(config)


# ---- summaries ---------------------------------------------------------------------------------------


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else p * 1000


def latency(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    errors = Counter((r.error or "")[:80] for r in records if not r.ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": dict(errors.most_common(3)),
        "ttft_ms_p50": _ms(ttft, 50),
        "ttft_ms_p99": _ms(ttft, 99),
        "tpot_ms_p50": _ms(tpot, 50),
        "tpot_ms_p99": _ms(tpot, 99),
    }


def burst_summary(
    args: argparse.Namespace, records: list[RequestRecord], slos: dict[str, Slo]
) -> dict[str, Any]:
    return pooled_summary(args, [records], slos)


def pooled_summary(
    args: argparse.Namespace, runs: list[list[RequestRecord]], slos: dict[str, Slo]
) -> dict[str, Any]:
    """The burst's figures over one or more runs of it: each run's other users split into before and
    during by that run's burst, then pooled, so the percentiles are over every run's requests; with
    several runs, each run's own TPOT p99 ratio too (the spread between runs)."""
    before: list[RequestRecord] = []
    during: list[RequestRecord] = []
    hot: list[RequestRecord] = []
    ratios = []
    good = span = 0.0
    for records in runs:
        burst = [r for r in records if r.kind == "hot"]
        others = [r for r in records if r.kind == "other"]
        end = max(r.arrival for r in burst) + args.tail
        run_before = [r for r in others if r.arrival < args.burst_at]
        run_during = [r for r in others if args.burst_at <= r.arrival <= end]
        before, during, hot = before + run_before, during + run_during, hot + burst
        b, d = latency(run_before)["tpot_ms_p99"], latency(run_during)["tpot_ms_p99"]
        ratios.append(d / b if b and d else None)
        good += sum(r.meets(slos["other"]) for r in others) + sum(r.meets(slos["hot"]) for r in burst)
        span += max(r.arrival for r in records) or 1.0
    out = {
        "others_before": latency(before),
        "others_during": latency(during),
        "hot": latency(hot),
        "goodput_rps": good / span,
        "attainment": good / sum(len(r) for r in runs),
    }
    if len(runs) > 1:
        out["runs"] = len(runs)
        out["tpot_p99_ratio_per_run"] = ratios
    return out


def chat_summary(records: list[RequestRecord], slo: Slo) -> dict[str, Any]:
    span = max(r.arrival for r in records) or 1.0
    good = sum(r.meets(slo) for r in records)
    return {**latency(records), "goodput_rps": good / span, "attainment": good / len(records)}


# ---- report ------------------------------------------------------------------------------------------


def _f(value: float | None, spec: str = ".0f") -> str:
    return "–" if value is None else format(value, spec)


def _per_run(summary: dict[str, Any]) -> str:
    """Each run's own ratio, where the setup's figures pool several runs."""
    ratios = summary.get("tpot_p99_ratio_per_run")
    if not ratios:
        return ""
    return f" (pooled over {len(ratios)} runs; each: {', '.join(_f(r, '.2f') for r in ratios)})"


def markdown(out: dict[str, Any], command: str) -> str:
    a = out["settings"]
    lines = [
        "# Hot prompts: a burst of similar prompts amid steady traffic, and a chat workload",
        "",
        f"Written by `perf/hot_prompts.py`: `{command}`. Model `{a['model']}`; {out['machine']}.",
        "",
        f"**Burst.** Other users: unique {a['other_tokens']}-token prompts, {a['other_output']} tokens out, "
        f"Poisson {a['rate']:g} req/s throughout (SLOs {out['slo']['other']}). Burst at {a['burst_at']:g} s: "
        f"{a['burst_count']} prompts at {a['burst_rate']:g} req/s sharing a "
        f"{out['burst_shared_tokens']}-token prefix, each {a['tail_tokens']} unique words after it, "
        f"{a['hot_output']} tokens out (SLOs "
        f'{out["slo"]["hot"]}). "during": other users arriving from the burst\'s first request to '
        f"{a['tail']:g} s after its last. Isolation: at most {a['hot_group_rate']:g} req/s per hot group.",
        "",
        "| setup | others TTFT p99 before / during, ms | others TPOT p99 before / during, ms | TPOT ratio "
        "| hot TTFT p50 / p99, ms | hot failed | goodput, req/s | hot routes | cache hit blocks |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, v in out["burst"].items():
        b, d, h = v["others_before"], v["others_during"], v["hot"]
        ratio = None if not (b["tpot_ms_p99"] and d["tpot_ms_p99"]) else d["tpot_ms_p99"] / b["tpot_ms_p99"]
        routes = v.get("counters", {})
        shown = ", ".join(
            f"{r}: {routes[f'route_{r}']:.0f}" for r in HOT_ROUTES[1:] if routes.get(f"route_{r}")
        )
        decided = [  # the adaptive cap's decisions (setup adaptive)
            f"{k.removeprefix('rate_')} {n:.0f}"
            for k, n in sorted(routes.items())
            if k.startswith("rate_") and n
        ]
        if decided:
            shown += f"; rate decisions: {', '.join(decided)}"
        lines.append(
            f"| {name} | {_f(b['ttft_ms_p99'])} / {_f(d['ttft_ms_p99'])} | {_f(b['tpot_ms_p99'], '.1f')} / "
            f"{_f(d['tpot_ms_p99'], '.1f')} | {_f(ratio, '.2f')}x{_per_run(v)} | "
            f"{_f(h['ttft_ms_p50'])} / {_f(h['ttft_ms_p99'])} "
            f"| {h['failed']} of {h['requests']} | {v['goodput_rps']:.2f} | {shown or '–'} "
            f"| {_f(routes.get('cache_hits'))} |"
        )
    if not out["chat"]:  # a burst-only run (--no-chat)
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"**Chat.** Unique {a['chat_tokens']}-token user messages in the model's chat template, "
        f"{a['chat_output']} tokens out, Poisson {a['chat_rate']:g} req/s for {a['chat_duration']:g} s "
        f"(SLOs {out['slo']['other']}). Shared by every prompt: the template and its system prompt, "
        + ", ".join(f"`{w}` {n} tokens" for w, n in out["chat_shared_tokens"].items())
        + ".",
        "",
        "| workload | setup | TTFT p50 / p99, ms | TPOT p50 / p99, ms | failed | goodput, req/s "
        "| cache hit blocks |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, v in out["chat"].items():
        workload, _, setup = key.partition("/")
        lines.append(
            f"| {workload} | {setup} | {_f(v['ttft_ms_p50'])} / {_f(v['ttft_ms_p99'])} | "
            f"{_f(v['tpot_ms_p50'], '.1f')} / {_f(v['tpot_ms_p99'], '.1f')} | {v['failed']} of "
            f"{v['requests']} | {v['goodput_rps']:.2f} | {_f(v.get('counters', {}).get('cache_hits'))} |"
        )
    if out["vllm_commands"]:
        lines += ["", "vLLM command lines:", ""] + [f"- `{c}`" for c in out["vllm_commands"]]
    return "\n".join(lines) + "\n"


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["burst"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    x = np.arange(len(names))
    for offset, phase, colour in ((-0.2, "others_before", "tab:blue"), (0.2, "others_during", "tab:orange")):
        values = [out["burst"][n][phase]["tpot_ms_p99"] or 0 for n in names]
        left.bar(x + offset, values, 0.4, label=phase.replace("others_", "other users, "), color=colour)
    left.set(
        xticks=x, xticklabels=names, ylabel="TPOT p99, ms", title="Other users' TPOT p99 around the burst"
    )
    left.legend()
    hot = [out["burst"][n]["hot"]["ttft_ms_p50"] or 0 for n in names]
    right.bar(x, hot, 0.5, color="tab:red")
    right.set(
        xticks=x, xticklabels=names, ylabel="TTFT p50, ms", title="The burst's own TTFT p50", yscale="log"
    )
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".models" / "smollm2-135m-instruct")
    parser.add_argument("--rate", type=float, default=2.0, help="other users, req/s")
    parser.add_argument("--other-tokens", type=int, default=128)
    parser.add_argument("--other-output", type=int, default=64)
    parser.add_argument("--burst-at", type=float, default=30.0)
    parser.add_argument("--burst-count", type=int, default=100)
    parser.add_argument("--burst-rate", type=float, default=10.0)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--tail-tokens", type=int, default=12)
    parser.add_argument("--hot-output", type=int, default=32)
    parser.add_argument("--tail", type=float, default=10.0, help="s after the burst's last arrival")
    parser.add_argument("--hot-group-rate", type=float, default=1.5)
    parser.add_argument("--hot-pool", action="store_true", help="also run the hot_pool setup")
    parser.add_argument(
        "--kv-cache-mb",
        type=int,
        default=1024,
        help="each pool's KV space: prefill and decode together hold vLLM's 2 GiB (VLLM_CPU_KVCACHE_SPACE)",
    )
    parser.add_argument("--chat-rate", type=float, default=2.0)
    parser.add_argument("--chat-duration", type=float, default=30.0)
    parser.add_argument("--chat-tokens", type=int, default=100)
    parser.add_argument("--chat-output", type=int, default=32)
    parser.add_argument(
        "--system-tokens", type=int, default=256, help="chat_system's system prompt, tokens (0: not run)"
    )
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-chat", action="store_true", help="the burst only")
    parser.add_argument("--setups", default="", help="burst setups to run, comma-separated (default: all)")
    parser.add_argument(
        "--hot-threshold", type=int, help="the entry points' hot_prompts.threshold (default: theirs)"
    )
    parser.add_argument(
        "--hot-group-burst", type=int, help="the entry points' hot_prompts.group_burst (default: theirs)"
    )
    parser.add_argument(
        "--server-cpus", default="", help="pin tritonserver's own threads, e.g. '0' (default: unpinned)"
    )
    parser.add_argument("--loadgen-cpus", default=None, help="pin the load generator, e.g. '0'")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the burst per setup (seeds seed, seed+1, ...), pooled: its percentiles are over "
        "every run's requests",
    )
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "hot_prompts")
    parser.add_argument("--from-json", type=Path, help="write the reports of this run's JSON, run nothing")
    parser.add_argument(
        "--report", type=Path, default=REPO_ROOT / "perf" / "RESULTS.md", help="its section is replaced"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    pin_self(args.loadgen_cpus)
    if args.from_json is not None:  # the reports again, from a run's JSON
        write_reports(args, json.loads(args.from_json.read_text()))
        return 0
    frozen = load_frozen(SLO_FILE, args.model_dir.name)
    if "chat" not in frozen or "codegen" not in frozen:
        log(f"no frozen chat/codegen SLOs for {args.model_dir.name} in {SLO_FILE}: make bench-slos")
        return 2
    slos = {"other": frozen["chat"].slo, "hot": frozen["codegen"].slo}
    factory = PromptFactory.from_model_dir(args.model_dir)
    burst = burst_trace(args, factory, new_salt())
    chats = {"chat": chat_trace(args, factory, new_salt())}
    if args.system_tokens:
        chats["chat_system"] = chat_trace(args, factory, new_salt(), args.system_tokens)
    hot = [s for s in burst if s.kind == "hot"]
    out: dict[str, Any] = {
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("model_dir", "out_dir")},
                     "model": args.model_dir.name},
        "slo": {k: f"{s.ttft_s * 1000:.0f} ms / {s.tpot_s * 1000:.1f} ms" for k, s in slos.items()},
        "burst_shared_tokens": shared_prefix_tokens(factory, hot),
        "chat_shared_tokens": {w: shared_prefix_tokens(factory, t) for w, t in chats.items()},
        "machine": machine(),
        "burst": {},
        "chat": {},
        "vllm_commands": [],
    }  # fmt: skip
    wanted = (
        args.setups.split(",")
        if args.setups
        else [k for k in BURST_SETUPS if k != "hot_pool" or args.hot_pool]
    )
    unknown = set(wanted) - set(BURST_SETUPS)
    if unknown:
        log(f"unknown setups {sorted(unknown)}; the setups are {', '.join(BURST_SETUPS)}")
        return 2
    setups = {k: BURST_SETUPS[k] for k in wanted}
    if args.no_chat:
        chats = {}
    with tempfile.TemporaryDirectory(prefix="hot-prompts-") as scratch:
        for name, flags in setups.items():
            runs, seen = [], {}
            for rep in range(args.repeats):  # a fresh trace (seed + rep) on a fresh server each time
                trace = burst if rep == 0 else burst_trace(args, factory, new_salt(), args.seed + rep)
                records, counted = triton_run(args, Path(scratch), name, flags, trace, factory)
                runs.append(records)
                seen = {k: seen.get(k, 0.0) + v for k, v in counted.items()}
            out["burst"][name] = {**pooled_summary(args, runs, slos), "counters": seen}
            log(f"{name}: {json.dumps(out['burst'][name], default=str)}")
        for workload, chat in chats.items():
            for setup, flags in CHAT_SETUPS.items():
                records, seen = triton_run(args, Path(scratch), f"{workload}-{setup}", flags, chat, factory)
                key = f"{workload}/{setup}"
                out["chat"][key] = {**chat_summary(records, slos["other"]), "counters": seen}
                log(f"{key}: {json.dumps(out['chat'][key], default=str)}")
    if not args.no_vllm:
        for caching in (True, False):
            traces = {"burst": burst, **chats} if caching else dict(chats)
            runs, command = vllm_runs(args, caching, traces, factory)
            label = "vllm_cache" if caching else "vllm_nocache"
            out["vllm_commands"].append(command)
            if "burst" in runs:
                out["burst"][label] = burst_summary(args, runs["burst"], slos)
            for workload in chats:
                out["chat"][f"{workload}/{label}"] = chat_summary(runs[workload], slos["other"])
            log(f"{label} done")
    out["command"] = "python -m perf.hot_prompts " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(args.out_dir / "hot_prompts.json", out)
    write_reports(args, out)
    return 0


def write_reports(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The markdown table, the plot and the section of perf/RESULTS.md, from the run's JSON."""
    report = markdown(out, out["command"])
    (args.out_dir / "hot_prompts.md").write_text(report)
    plot(out, args.out_dir / "hot_prompts.png")
    if args.report is not None and args.report.is_file():
        runs = max((v.get("runs", 1) for v in out["burst"].values()), default=1)
        heading, section = "## Hot prompts", "hot_prompts"
        if runs > 1:  # a pooled run has a section of its own, by its first seed
            seed = out["settings"]["seed"]
            seeds = f"{seed}-{seed + runs - 1}"
            heading = f"## Hot prompts, each burst run {runs} times (seeds {seeds}) and pooled"
        if not out["chat"]:
            report = report.replace(", and a chat workload", "", 1)
            section = f"hot_prompts_pooled_{seed}"
        body = report.replace("# Hot prompts", heading, 1)
        picture = os.path.relpath(args.out_dir.resolve() / "hot_prompts.png", args.report.resolve().parent)
        body += f"\n![the burst, per setup]({picture})\n"
        args.report.write_text(with_section(args.report.read_text(), section, body))
    log(report)


if __name__ == "__main__":
    sys.exit(main())
