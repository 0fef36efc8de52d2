"""TTFT, TPOT and KV transfer time of the multi-host deployment against the single-server one.

    # as root, from the repository root (or under sudo)
    make bench-multihost   # PYTHONPATH=tests:tests/integration .venv/bin/python -m perf.multihost_bench

Needs root and ``ip netns`` (network namespaces joined by a bridge, ``tests/netns_support.py``); exits
with status 2 and the reason where they cannot be made. Both deployments run on the same machine, one
after the other, on the same model and cores (prefill and the frontend's steps on core 0, decode on
core 1), each server in a network namespace of its own, the client in the root namespace:

- ``single``: one ``disagg serve --model-repository REPO`` (REPO: the default ``Layout()``, KV over shm);
- ``multihost``: a prefill host (``--role prefill``), a decode host (``--role decode``) and a frontend
  (``--role frontend --remote-pools "prefill=IP:8001;decode=IP:8001"``), one shared ``DISAGG_SECRET``;
  the frontend reaches the pools over gRPC, the KV crosses the veth links over NIXL / UCX (TCP only).

Workload, the same for both: 3 warm-up requests, then ``--requests`` (20) requests one at a time
(``idle``) and ``--requests`` at concurrency ``--concurrency`` (4) (``loaded``), each on the ``llm``
model, streaming, a unique prompt of about ``--prompt-tokens`` (300) tokens and exactly
``--max-tokens`` (64) output tokens (``min_length = max_tokens``). Per deployment and phase: TTFT and
TPOT p50 / p90 as the client sees them (TPOT = (last piece - first piece) / (pieces - 1), DistServe's
definition), and the mean KV transfer time and bytes per hand-off from the decode server's
``disagg_kv_transfer_seconds`` / ``disagg_kv_transfer_bytes_total`` deltas over the phase.

Writes ``multihost_bench.json`` (every number, per-request records, the exact server commands, machine
facts) and ``multihost_bench.md`` (the table and a reading of it) to ``--out-dir``. Every server is
stopped and the namespaces removed on the way out, on error too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the test suite's topology helpers: `make bench-multihost` puts tests/ and tests/integration/ on
# PYTHONPATH for them
from netns_support import Host, Topology, netns_unavailable, start_host, wait_ready
from serving_support import metric_samples
from triton_support import GrpcStream, text_request

from disagg.engine.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]

MODEL = "llm"
WARMUP = 3
SUBNET = 234  # the suite's Topology default is 233: a test run beside this one keeps its addresses
HOSTS = ("single", "front", "pre", "dec")
SINGLE, FRONTEND, PREFILL, DECODE = range(4)
TRANSFER = "disagg_kv_transfer_seconds"
BYTES = "disagg_kv_transfer_bytes_total"
SETTLE_S = 15.0  # how long the decode servers' KV counters may take to show a phase's hand-offs


def log(message: str) -> None:
    print(f"[multihost_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- workload ----------------------------------------------------------------------------------------


def make_prompt(tokenizer: Tokenizer, tag: str, target: int) -> tuple[str, int]:
    """A unique prompt of about ``target`` tokens: numbered sentences naming ``tag``; (text, tokens)."""
    sentences: list[str] = []
    count = 0
    while count < target:
        sentences.append(f"Sentence {len(sentences) + 1} of request {tag} is here.")
        count = len(tokenizer.encode(" ".join(sentences)))
    return " ".join(sentences), count


@dataclass(frozen=True)
class Record:
    """One measured request as the client saw it (seconds, monotonic clock).

    ``tpot_s`` is DistServe's (last piece - first piece) / (pieces - 1); a token whose text is empty
    (a partial character) is sent with the next piece, so there can be fewer pieces than tokens:
    ``tpot_token_s`` divides the same span by the tokens the server reports between the two pieces
    (``num_output_tokens``)."""

    phase: str
    index: int
    prompt_tokens: int  # the client's count (tokenizer.encode)
    server_input_tokens: int | None  # the server's (num_input_tokens)
    sent: float
    ttft_s: float | None
    tpot_s: float | None
    tpot_token_s: float | None
    e2e_s: float | None
    pieces: int
    output_tokens: int
    final: bool
    error: str | None


def scalar(result: Any, name: str) -> Any:
    array = result.as_numpy(name)
    return None if array is None or array.size == 0 else array.reshape(-1)[0]


def timed_request(
    stream: GrpcStream, phase: str, index: int, prompt: tuple[str, int], max_tokens: int, timeout_s: float
) -> Record:
    """Send one request on ``stream`` and time its pieces up to the final response (as
    ``triton_support.timed_stream`` does), with the token counts the ``llm`` model returns."""
    text, prompt_tokens = prompt
    values = text_request(text, max_tokens)
    values["return_num_output_tokens"] = np.array([[True]], dtype=bool)
    values["return_num_input_tokens"] = np.array([[True]], dtype=bool)
    sent = time.monotonic()
    stream.send(MODEL, values)
    first = last = final = None
    pieces, tokens, tokens_first, tokens_last = 0, 0, 0, 0
    input_tokens, error = None, None
    for event in stream.until_final(timeout_s):
        now = time.monotonic()
        if event.error is not None:
            error = str(event.error)
            break
        result = event.result
        tokens += int(scalar(result, "num_output_tokens") or 0)
        counted = scalar(result, "num_input_tokens")
        input_tokens = int(counted) if counted is not None else input_tokens
        piece = scalar(result, "text_output")
        if piece:
            if first is None:
                first, tokens_first = now, tokens
            last, tokens_last = now, tokens
            pieces += 1
        if event.final:
            final = now
    tpot = tpot_token = None
    if first is not None and last is not None and pieces > 1:
        tpot = (last - first) / (pieces - 1)
        tpot_token = (last - first) / (tokens_last - tokens_first) if tokens_last > tokens_first else None
    end = final if final is not None else last
    return Record(
        phase=phase,
        index=index,
        prompt_tokens=prompt_tokens,
        server_input_tokens=input_tokens,
        sent=sent,
        ttft_s=None if first is None else first - sent,
        tpot_s=tpot,
        tpot_token_s=tpot_token,
        e2e_s=None if end is None else end - sent,
        pieces=pieces,
        output_tokens=tokens,
        final=final is not None,
        error=error,
    )


def run_phase(
    url: str,
    phase: str,
    prompts: Sequence[tuple[str, int]],
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
) -> tuple[list[Record], float]:
    """Send ``prompts`` with at most ``concurrency`` in flight (one gRPC stream per client thread);
    the records in index order and the phase's wall time."""
    work: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        work.put(i)
    records: list[Record] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        try:
            with GrpcStream(url) as stream:
                while True:
                    try:
                        i = work.get_nowait()
                    except queue.Empty:
                        return
                    done = timed_request(stream, phase, i, prompts[i], max_tokens, timeout_s)
                    with lock:
                        records.append(done)
        except BaseException as exc:  # a client that dies must fail the phase, not shrink it
            with lock:
                failures.append(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=client, name=f"{phase}-{c}", daemon=True) for c in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * len(prompts))
    wall = time.monotonic() - start
    if failures:
        raise RuntimeError(f"{phase}: a client failed: {failures[0]!r}") from failures[0]
    if len(records) != len(prompts):
        raise RuntimeError(f"{phase}: {len(records)} of {len(prompts)} requests came back")
    return sorted(records, key=lambda r: r.index), wall


# ---- metrics -----------------------------------------------------------------------------------------


def kv_counters(hosts: Sequence[Host]) -> dict[str, float]:
    """The KV import counters summed over ``hosts`` and all their series (pool, instance)."""
    totals = {"seconds": 0.0, "count": 0.0, "bytes": 0.0}
    for host in hosts:
        for name, _, value in metric_samples(host):
            if name == f"{TRANSFER}_sum":
                totals["seconds"] += value
            elif name == f"{TRANSFER}_count":
                totals["count"] += value
            elif name == BYTES:
                totals["bytes"] += value
    return totals


def kv_by_series(hosts: Sequence[Host]) -> list[dict[str, Any]]:
    """Every KV import series of ``hosts`` (for the JSON: which pool the hand-offs landed on)."""
    out = []
    for host in hosts:
        for name, labels, value in metric_samples(host):
            if name in (f"{TRANSFER}_sum", f"{TRANSFER}_count", BYTES):
                out.append({"host": host.address, "name": name, "labels": labels, "value": value})
    return out


def settled(hosts: Sequence[Host], before: dict[str, float], expected: int) -> dict[str, float]:
    """The counters once ``expected`` more hand-offs show (or SETTLE_S passed: then as they are)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = kv_counters(hosts)
        if now["count"] - before["count"] >= expected or time.monotonic() > deadline:
            return now
        time.sleep(0.25)  # the pools publish their counters every 0.25 s


def percentile(values: Sequence[float | None], q: float) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.percentile(present, q)) if present else None


def summarize(records: Sequence[Record], wall: float, before: dict, after: dict) -> dict[str, Any]:
    handoffs = after["count"] - before["count"]
    seconds = after["seconds"] - before["seconds"]
    moved = after["bytes"] - before["bytes"]
    ok = [r for r in records if r.error is None and r.final]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": [r.error for r in records if r.error is not None],
        "pieces_min": min((r.pieces for r in records), default=0),
        "pieces_max": max((r.pieces for r in records), default=0),
        "pieces_median": percentile([r.pieces for r in records], 50),
        "output_tokens": sorted({r.output_tokens for r in records}),
        "server_input_tokens": sorted({r.server_input_tokens for r in records if r.server_input_tokens}),
        "wall_s": wall,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
        "ttft_p90_s": percentile([r.ttft_s for r in ok], 90),
        "tpot_p50_s": percentile([r.tpot_s for r in ok], 50),
        "tpot_p90_s": percentile([r.tpot_s for r in ok], 90),
        "tpot_token_p50_s": percentile([r.tpot_token_s for r in ok], 50),
        "tpot_token_p90_s": percentile([r.tpot_token_s for r in ok], 90),
        "e2e_p50_s": percentile([r.e2e_s for r in ok], 50),
        "kv_handoffs": handoffs,
        "kv_transfer_seconds_total": seconds,
        "kv_bytes_total": moved,
        "kv_transfer_mean_s": seconds / handoffs if handoffs else None,
        "kv_bytes_per_request": moved / handoffs if handoffs else None,
        "kv_counters_before": before,
        "kv_counters_after": after,
    }


# ---- deployments -------------------------------------------------------------------------------------


@dataclass
class Deployment:
    name: str
    entry: Host  # where the client sends requests
    importers: list[Host]  # the servers whose decode pools import the KV
    hosts: list[Host]  # every server, for the teardown


def host_command(host: Host) -> list[str]:
    return [str(part) for part in host.process.args]  # type: ignore[union-attr]


def start_single(
    topology: Topology, workdir: Path, secret: str, started: list[Host], transport: str = ""
) -> Deployment:
    from disagg_tools.repository import KV, Layout, write

    name = f"single-{transport}" if transport else "single"
    repository = workdir / f"{name}-repository"
    write(repository, Layout(kv=KV(transport=transport or "shm")))
    host = start_host(topology, SINGLE, workdir, secret, "--model-repository", str(repository))
    started.append(host)
    wait_ready(host)
    return Deployment(name, host, [host], [host])


def start_single_nixl(topology: Topology, workdir: Path, secret: str, started: list[Host]) -> Deployment:
    """The single server with the pools' KV over NIXL / UCX (TCP on loopback), as the pool hosts of the
    multi-host deployment hand it off: tells the transport's cost from the extra gRPC hop's."""
    return start_single(topology, workdir, secret, started, "nixl")


def start_multihost(topology: Topology, workdir: Path, secret: str, started: list[Host]) -> Deployment:
    prefill = start_host(topology, PREFILL, workdir, secret, "--role", "prefill")
    started.append(prefill)
    decode = start_host(topology, DECODE, workdir, secret, "--role", "decode")
    started.append(decode)
    remote = f"prefill={topology.address(PREFILL)}:8001;decode={topology.address(DECODE)}:8001"
    frontend = start_host(topology, FRONTEND, workdir, secret, "--role", "frontend", "--remote-pools", remote)
    started.append(frontend)
    wait_ready(prefill, decode, frontend)
    return Deployment("multihost", frontend, [decode], [frontend, prefill, decode])


def stop_all(hosts: list[Host]) -> dict[str, int | None]:
    """Stop every host (frontends first: they are the last to be started); their exit statuses."""
    statuses: dict[str, int | None] = {}
    for host in reversed(hosts):
        key = f"{host.address}:{host.config.http_url.rsplit(':', 1)[1]}"
        try:
            statuses[key] = host.stop()
        except Exception as exc:  # keep stopping the others
            log(f"stopping {key} failed: {exc!r}")
            statuses[key] = None
    hosts.clear()
    return statuses


def measure(
    deployment: Deployment,
    args: argparse.Namespace,
    prompts: dict[str, list[tuple[str, int]]],
) -> dict[str, Any]:
    url = deployment.entry.config.grpc_url
    log(f"{deployment.name}: warming up with {WARMUP} requests")
    warm, _ = run_phase(url, "warmup", prompts["warmup"], 1, args.max_tokens, args.timeout)
    bad = [r for r in warm if r.error is not None or not r.final]
    if bad:
        raise RuntimeError(f"{deployment.name}: warm-up request failed: {bad[0]}")
    counters = settled(deployment.importers, {"seconds": 0.0, "count": 0.0, "bytes": 0.0}, 0)
    phases: dict[str, Any] = {}
    records: list[Record] = []
    for phase, concurrency in (("idle", 1), ("loaded", args.concurrency)):
        log(f"{deployment.name}: {phase}: {args.requests} requests at concurrency {concurrency}")
        done, wall = run_phase(url, phase, prompts[phase], concurrency, args.max_tokens, args.timeout)
        after = settled(deployment.importers, counters, len(done))
        phases[phase] = {"concurrency": concurrency, **summarize(done, wall, counters, after)}
        records += done
        counters = after
        summary = phases[phase]
        log(
            f"{deployment.name}: {phase}: TTFT p50 {ms(summary['ttft_p50_s'])} ms, "
            f"TPOT p50 {ms(summary['tpot_p50_s'])} ms, KV {ms(summary['kv_transfer_mean_s'])} ms "
            f"({summary['kv_handoffs']:.0f} hand-offs)"
        )
    return {
        "phases": phases,
        "kv_series": kv_by_series(deployment.importers),
        "commands": [host_command(h) for h in deployment.hosts],
        "records": [asdict(r) for r in records],
    }


# ---- report ------------------------------------------------------------------------------------------


def ms(seconds: float | None, digits: int = 1) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.{digits}f}"


def kib(count: float | None) -> str:
    return "n/a" if count is None else f"{count / 1024:.1f} KiB"


def table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| deployment | phase | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | TPOT p90 (ms) "
        "| KV transfer (ms, mean) | KV bytes / request | hand-offs / requests |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        for phase, s in result["phases"].items():
            lines.append(
                f"| {name} | {phase} (c={s['concurrency']}) | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p90_s'])} "
                f"| {ms(s['tpot_p50_s'], 2)} | {ms(s['tpot_p90_s'], 2)} | {ms(s['kv_transfer_mean_s'], 2)} "
                f"| {kib(s['kv_bytes_per_request'])} | {s['kv_handoffs']:.0f} / {s['requests']} |"
            )
    return lines


def token_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| deployment | phase | pieces (min-max) | output tokens | TPOT per token p50 (ms) "
        "| TPOT per token p90 (ms) | e2e p50 (ms) | phase wall (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        for phase, s in result["phases"].items():
            tokens = "/".join(str(t) for t in s["output_tokens"])
            lines.append(
                f"| {name} | {phase} (c={s['concurrency']}) | {s['pieces_min']}-{s['pieces_max']} | {tokens} "
                f"| {ms(s['tpot_token_p50_s'], 2)} | {ms(s['tpot_token_p90_s'], 2)} | {ms(s['e2e_p50_s'])} "
                f"| {s['wall_s']:.1f} |"
            )
    return lines


def signed(delta: float, digits: int = 1) -> str:
    return f"{'+' if delta >= 0 else '-'}{abs(delta) * 1000:.{digits}f} ms"


def reading(results: dict[str, Any]) -> str:
    """A paragraph of the differences, computed from the tables' own numbers."""
    single, multi = results["single"]["phases"], results["multihost"]["phases"]
    parts = []
    for phase in ("idle", "loaded"):
        s, m = single[phase], multi[phase]
        keys = ("ttft_p50_s", "tpot_p50_s", "tpot_token_p50_s", "kv_transfer_mean_s", "pieces_median")
        if any(s[k] is None or m[k] is None for k in keys):
            parts.append(f"{phase}: a figure is missing (see the JSON), no comparison.")
            continue
        dttft = m["ttft_p50_s"] - s["ttft_p50_s"]
        dtpot = m["tpot_p50_s"] - s["tpot_p50_s"]
        dtoken = m["tpot_token_p50_s"] - s["tpot_token_p50_s"]
        dkv = m["kv_transfer_mean_s"] - s["kv_transfer_mean_s"]
        gaps = m["pieces_median"] - 1
        parts.append(
            f"{phase.capitalize()} (concurrency {s['concurrency']}): the multi-host TTFT p50 is "
            f"{ms(m['ttft_p50_s'])} ms against {ms(s['ttft_p50_s'])} ms ({signed(dttft)}, "
            f"{dttft / s['ttft_p50_s'] * 100:+.0f} %) and its TPOT p50 {ms(m['tpot_p50_s'], 2)} ms against "
            f"{ms(s['tpot_p50_s'], 2)} ms ({signed(dtpot, 2)} per piece, "
            f"{dtpot / s['tpot_p50_s'] * 100:+.0f} %; per token {ms(m['tpot_token_p50_s'], 2)} against "
            f"{ms(s['tpot_token_p50_s'], 2)} ms, {signed(dtoken, 2)}); the decode side's KV import takes "
            f"{ms(m['kv_transfer_mean_s'], 2)} ms over NIXL/UCX-TCP against {ms(s['kv_transfer_mean_s'], 2)} "
            f"ms over shm ({signed(dkv, 2)} for {kib(m['kv_bytes_per_request'])} per request), which, "
            f"spread over the {gaps:.0f} inter-piece gaps TPOT averages (median), is {signed(dkv / gaps, 3)} "
            f"per piece, {abs(dkv / gaps) / abs(dtpot) * 100 if dtpot else 0:.1f} % of the TPOT difference."
        )
    tail = (
        "The orchestrator sends the first piece as soon as the prefill pool returns it, before the decode "
        "pool imports the KV (disagg.serving.orchestrator._disaggregated), so the import is not in TTFT: "
        "the TTFT difference is what the multi-host path adds before the first piece (the frontend's gRPC "
        "call to the prefill host and its answer, with three servers' processes on the machine's cores "
        "instead of one server's); the import lands between the first and the second piece, inside TPOT, "
        "and the rest of the TPOT difference is what the multi-host path adds per piece (the decode "
        "host's tokens relayed over gRPC through the frontend, on the same shared cores). This benchmark "
        "splits the difference no further than that."
    )
    if "single-nixl" in results:
        nixl = results["single-nixl"]["phases"]
        steps = []
        for phase in ("idle", "loaded"):
            s, n, m = single[phase], nixl[phase], multi[phase]
            if any(x["tpot_token_p50_s"] is None or x["ttft_p50_s"] is None for x in (s, n, m)):
                continue
            steps.append(
                f"{phase}: TPOT per token p50 {ms(s['tpot_token_p50_s'], 2)} ms (shm) -> "
                f"{ms(n['tpot_token_p50_s'], 2)} ms (NIXL, one server) -> {ms(m['tpot_token_p50_s'], 2)} ms "
                f"(three servers), TTFT p50 {ms(s['ttft_p50_s'])} -> {ms(n['ttft_p50_s'])} -> "
                f"{ms(m['ttft_p50_s'])} ms"
            )
        tail += (
            " The single server with its pools' KV over NIXL (single-nixl) separates the two: "
            + "; ".join(steps)
            + ". The step from shm to NIXL on one server is the transport's cost on these two cores "
            "(the pools run NIXL without its progress thread unless nixl_progress_thread is set: see "
            "docs/kv-handoff.md); the step from one server to three is the gRPC hop and the extra "
            "servers."
        )
    return " ".join([*parts, tail])


def machine_facts() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    model = next((line for line in cpuinfo if line.startswith("model name")), "")
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return {
        "nproc": int(nproc) if nproc.isdigit() else None,
        "cpu_model_line": model,
        "amx": any(flag.startswith("amx") for flag in flags.split(":", 1)[-1].split()),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def write_reports(out_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "multihost_bench.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    w = report["workload"]
    facts = report["machine"]
    md = [
        "# Multi-host vs single-server deployment",
        "",
        f"Model `{w['model_dir']}`; `{MODEL}` streaming over gRPC from the root namespace; prompts of "
        f"{w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens (unique text each), exactly "
        f"{w['max_tokens']} output tokens; {WARMUP} warm-up requests, then {w['requests']} requests one at "
        f"a time (idle) and {w['requests']} at concurrency {w['concurrency']} (loaded). Machine: "
        f"{facts['cpu_model_line'].split(':', 1)[-1].strip()}, nproc {facts['nproc']}, "
        f"AMX {'yes' if facts['amx'] else 'no'}. Prefill (and the frontend's steps) on core 0, decode on "
        f"core 1 in both deployments; each server in a network namespace of its own.",
        "",
        "- **single**: one `disagg serve --model-repository REPO` (default `Layout()`, KV over shm).",
        "- **multihost**: frontend (`--role frontend --remote-pools ...`), prefill (`--role prefill`) and "
        "decode (`--role decode`) hosts; pools reached over gRPC, KV over NIXL/UCX (TCP only) on veth "
        "links.",
        "",
        "TTFT and TPOT are client-side (TPOT = (last piece - first piece) / (pieces - 1)); KV transfer "
        "is the decode server's `disagg_kv_transfer_seconds` mean over the phase (verify + copy on the "
        "importing side), bytes from `disagg_kv_transfer_bytes_total`, both per hand-off.",
        "",
        *table(report["results"]),
        "",
        "Pieces against tokens: a token whose text is empty (part of a character) goes out with the next "
        "piece, so a request streams fewer pieces than its tokens; TPOT per token divides the same span "
        "(first to last piece) by the tokens the server reports between them (`num_output_tokens`).",
        "",
        *token_table(report["results"]),
        "",
        report["reading"],
        "",
        f"Command: `{report['command']}`. Numbers, per-request records and the servers' exact commands: "
        "`multihost_bench.json`.",
        "",
    ]
    md_path = out_dir / "multihost_bench.md"
    md_path.write_text("\n".join(md))
    return json_path, md_path


# ---- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: .models/tiny)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "perf" / "results" / "multihost")
    parser.add_argument("--requests", type=int, default=20, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=4, help="of the loaded phase")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument(
        "--only",
        choices=("single", "single-nixl", "multihost"),
        default=None,
        help="run one deployment (no comparison)",
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.prompt_tokens < 1 or args.max_tokens < 2:
        parser.error("--requests, --concurrency, --prompt-tokens must be >= 1 and --max-tokens >= 2")
    return args


def make_prompts(model_dir: Path, args: argparse.Namespace) -> dict[str, list]:
    """The same prompts for both deployments (each server has its own caches; prefix caching is off)."""
    tokenizer = Tokenizer(model_dir)
    counts = {"warmup": WARMUP, "idle": args.requests, "loaded": args.requests}
    return {
        phase: [make_prompt(tokenizer, f"{phase}-{i}", args.prompt_tokens) for i in range(n)]
        for phase, n in counts.items()
    }


def run(args: argparse.Namespace, model_dir: Path, on_exit: list[Callable[[], None]]) -> dict[str, Any]:
    topology = Topology(secrets.token_hex(3), HOSTS, subnet=SUBNET)
    on_exit.append(topology.close)
    workdir = Path(tempfile.mkdtemp(prefix="multihost_bench-"))
    on_exit.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    secret = secrets.token_hex(32)
    started: list[Host] = []
    results: dict[str, Any] = {}
    statuses: dict[str, Any] = {}

    def stop_started() -> None:
        if started:
            statuses.update(stop_all(started))

    on_exit.append(stop_started)
    prompts = make_prompts(model_dir, args)
    names = [args.only] if args.only else ["single", "single-nixl", "multihost"]
    starters = {"single": start_single, "single-nixl": start_single_nixl, "multihost": start_multihost}
    for name in names:
        log(f"{name}: starting")
        began = time.monotonic()
        try:
            deployment = starters[name](topology, workdir, secret, started)
        except BaseException:
            for host in started:
                log(f"log of {host.address} ({host.log}):\n{host.tail()}")
            raise
        log(f"{name}: ready after {time.monotonic() - began:.1f} s")
        try:
            result = measure(deployment, args, prompts)
        except BaseException:
            for host in started:
                log(f"log tail of {host.address}:{host.config.http_url}:\n{host.tail()[-2000:]}")
            raise
        result["ready_s"] = time.monotonic() - began
        result["prompt_tokens"] = [t for phase in prompts.values() for _, t in phase]
        log(f"{name}: stopping")
        result["exit_statuses"] = stop_all(started)
        if any(status != 0 for status in result["exit_statuses"].values()):
            log(f"{name}: a server exited unclean: {result['exit_statuses']}")
        results[name] = result
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = netns_unavailable()
    if reason is not None:
        print(f"multihost_bench: network namespaces unavailable ({reason}); run as root", file=sys.stderr)
        return 2
    model_dir = (args.model or REPO_ROOT / ".models" / "tiny").resolve()
    if not (model_dir / "config.json").is_file():
        print(f"multihost_bench: {model_dir} holds no checkpoint (config.json)", file=sys.stderr)
        return 2
    os.environ["MODEL_DIR"] = str(model_dir)  # the servers' engines read it (start_host passes environ)
    out_dir = args.out_dir if args.out_dir.is_absolute() else Path.cwd() / args.out_dir

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # through the finally below: servers stopped, namespaces removed

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    on_exit: list[Callable[[], None]] = []
    started = time.monotonic()
    try:
        results = run(args, model_dir, on_exit)
    except Exception as exc:
        traceback.print_exc()
        print(f"multihost_bench: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for action in reversed(on_exit):
            try:
                action()
            except Exception as exc:
                log(f"teardown step failed: {exc!r}")
    tokens = [t for r in results.values() for t in r["prompt_tokens"]]
    env_keys = ("UCX_TLS", "UCX_NET_DEVICES", "HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "MODEL_DIR")
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "argv": sys.argv,
        "cwd": str(Path.cwd()),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "server_env": {
            "set_by_start_host": "DISAGG_SECRET (random, shared), UCX_TLS=tcp, UCX_NET_DEVICES=<host veth>, "
            "HTTP_PORT=8000, GRPC_PORT=8001, METRICS_PORT=8002, PYTHONUNBUFFERED=1",
            "MODEL_DIR": str(model_dir),
            "inherited": {k: os.environ[k] for k in env_keys if k in os.environ},
        },
        "workload": {
            "model": MODEL,
            "model_dir": str(model_dir),
            "warmup": WARMUP,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "prompt_tokens_target": args.prompt_tokens,
            "prompt_tokens_min": min(tokens),
            "prompt_tokens_max": max(tokens),
            "max_tokens": args.max_tokens,
            "min_length": args.max_tokens,
            "percentiles": "numpy.percentile, linear interpolation, over completed requests",
        },
        "machine": machine_facts(),
        "duration_s": time.monotonic() - started,
        "results": results,
    }
    both = "single" in results and "multihost" in results
    report["reading"] = reading(results) if both else "One deployment only: no comparison."
    json_path, md_path = write_reports(out_dir, report)
    print("\n".join(table(results)))
    print(f"\n{json_path}\n{md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
