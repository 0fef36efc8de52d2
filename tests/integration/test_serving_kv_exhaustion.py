"""KV exhaustion on a real Triton (RELIABILITY E2): the decode pool's cache holds one long request,
so a second long one waits for blocks, past its KV lease's TTL. Short requests keep flowing past it
(bounded overtaking), the waiting import's lease is renewed instead of expiring, and every request
ends on the normal path: no expiry, no fallback, no migration, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serving_support import CLIENT_SCRIPT_PREAMBLE, pool_gauges, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, metric_sum, scrape_metrics, wait_until

from disagg.server import TritonServer
from disagg_tools.repository import main as write_repository

# The first long request holds its blocks until the test cancels it, so nothing here depends on how
# fast the machine decodes. It asks for 4000 tokens (tens of seconds of decode here) from a
# copy of the tiny model with a longer context, and is cancelled once the shorts have passed and the
# waiting import's lease has been renewed. 35 MiB of bf16 KV is 280 blocks of 16 tokens: the first
# takes 251, so the second (600 tokens, 38 blocks) cannot join until the first goes, while the
# shorts (1 block each, sent together) still fit, and the pool stays under the 95 % of its blocks
# that would make the orchestrator call it saturated. A 2 s lease is renewed 1 s before its end.
CONTEXT, KV_CACHE_MB, LEASE_TTL_S = 8192, 35, 2
FIRST_TOKENS, WAITING_TOKENS, SHORT_TOKENS, SHORTS = 4000, 600, 4, 6

# The first request streams from a process of its own, because tritonclient keeps a thread alive after
# a cancelled stream, which the leak probe would count. It prints one line when its first piece
# arrives, cancels when told on stdin, and says whether its request had ended before the cancel.
_HOLDING_CLIENT = (
    CLIENT_SCRIPT_PREAMBLE
    + """
url, max_tokens = sys.argv[1], int(sys.argv[2])
def ended(result, error):
    if error is not None:
        return True
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param
events = queue.Queue()
client = grpcclient.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: events.put((result, error)))
client.async_stream_infer("llm", long_request(max_tokens), enable_empty_final_response=True)
first = events.get(timeout=60)
print(json.dumps({"started": first[1] is None and not ended(*first)}), flush=True)
sys.stdin.readline()
seen = [first]
while not events.empty():
    seen.append(events.get())
client.stop_stream(cancel_requests=True)
client.close()
print(json.dumps({"ended_before_cancel": any(ended(*e) for e in seen), "pieces": len(seen)}), flush=True)
"""
)


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files, linked, with `max_position_embeddings` raised to `CONTEXT`."""
    out = tmp_path_factory.mktemp("long-context-model")
    for path in tiny_model_dir.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return out


@pytest.fixture(scope="module")
def server(
    triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory, long_context_model: Path
) -> TritonServer:
    out = tmp_path_factory.mktemp("exhaustion") / "repository"
    command = ["--out", str(out), "--kv-cache-mb", str(KV_CACHE_MB), "--lease-ttl-s", str(LEASE_TTL_S)]
    command += ["--kv-dtype", "bfloat16"]  # the block counts above, whatever dtype the pools compute in
    assert write_repository(command) == 0
    return triton_factory.start(out, exit_timeout_s=10, model_dir=long_context_model)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _short(i: int) -> dict:
    return text_inputs(
        f"short {i}", SHORT_TOKENS, min_length=np.array([[SHORT_TOKENS]], np.int32), stream=True
    )


def _renewals(server: TritonServer) -> float:
    samples = scrape_metrics(server.config.metrics_url)
    return metric_sum(samples, "disagg_kv_lease_renewals_total", pool="prefill")


def test_a_waiting_import_keeps_its_kv_and_short_requests_pass_it(server: TritonServer) -> None:
    url = server.config.grpc_url
    args = [sys.executable, "-c", _HOLDING_CLIENT, url, str(FIRST_TOKENS)]
    holder = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline() or "{}").get("started"), "the first long request started"
        with GrpcStream(url) as waiting:
            waiting.send("llm", text_inputs("Good morning", WAITING_TOKENS, stream=True))
            prefilled = waiting.next(60)
            assert prefilled.error is None, f"the second long request was prefilled: {prefilled.error}"

            streams = [GrpcStream(url) for _ in range(SHORTS)]
            try:
                for i, short in enumerate(streams):
                    short.send("llm", _short(i))
                shorts = [read_stream(short, 60) for short in streams]
            finally:
                for short in streams:
                    short.close()
            assert all(r.error is None and r.final for r in shorts), shorts
            wait_until(lambda: _renewals(server) >= 1, 30, "the waiting import's lease renewed")
            assert waiting.events.qsize() == 0, "the second long request waited while the shorts passed it"

            out, _ = holder.communicate("cancel\n", timeout=60)
            held = json.loads(out.strip().splitlines()[-1])
            assert not held["ended_before_cancel"], (
                f"premise: the first held its blocks until cancelled {held}"
            )
            assert read_stream(waiting, 180).final, "the second long request ran once the first went"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()

    samples = scrape_metrics(server.config.metrics_url)
    assert metric_sum(samples, "disagg_kv_lease_expired_total") == 0, "no lease expired while waiting"
    assert metric_sum(samples, "disagg_migrations_total", model="llm") == 0
    assert metric_sum(samples, "disagg_fallbacks_total", model="llm", to="local") == 0

    def ended() -> bool:
        samples = scrape_metrics(server.config.metrics_url)
        ok = metric_sum(samples, "disagg_requests_total", model="llm", outcome="ok")
        return (
            ok == SHORTS + 1
            and metric_sum(samples, "disagg_requests_total", model="llm", outcome="cancelled") == 1
        )

    wait_until(ended, 10, f"{SHORTS + 1} requests served and the first counted as cancelled")

    def idle() -> bool:
        return not any(v for k, v in pool_gauges(server).items() if k[0] != "disagg_kv_blocks_free")

    wait_until(idle, 30, "no KV block in use and no sequence active")
