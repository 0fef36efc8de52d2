"""The `disagg_*` families on a live server's /metrics against what clients measured (issue 5).

Requests are streamed over gRPC so the client can time its first and last piece. The client's times
include gRPC and, for `ensemble`, the pre/postprocessing steps, so:

- server TTFT <= client TTFT for every request (the server's clock starts later and stops earlier),
  and the client's excess is bounded (`DELIVERY_S` per request);
- TPOT: both sides divide a first-to-last span by (tokens - 1); the spans differ only by the delivery
  delays of the first and the last piece, so |client - server| <= DELIVERY_S / (tokens - 1) per request.

`min_length` = `max_tokens` makes every request produce exactly `max_tokens` tokens, so counts and
token sums are exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator

import pytest
from triton_support import (
    REPO_ROOT,
    GrpcStream,
    LeakProbe,
    TimedStream,
    TritonFactory,
    http_json,
    metric_series,
    metric_sum,
    scrape_metrics,
    shm_entries,
    stop_checked,
    text_request,
    timed_stream,
    wait_until,
)

from disagg.engine.tokenizer import Tokenizer
from disagg.paths import resolve_model_dir
from disagg.server import TritonServer
from disagg_tools.autoscaler.contract import METRIC_NAMES

TOKENS = 16
DELIVERY_S = 0.5
"""Bound on the client-side excess per request (gRPC, ensemble steps, a loaded 2-core machine)."""

DISAGG = {"model": "llm", "path": "disaggregated"}
HISTOGRAMS = (
    "disagg_time_to_first_token_seconds",
    "disagg_time_per_output_token_seconds",
    "disagg_request_latency_seconds",
    "disagg_prompt_tokens",
    "disagg_output_tokens",
)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def resolved(dtype: str) -> str:
    """A configured dtype as the engine resolves it (``auto`` by its fixed rule)."""
    from disagg.engine.device import auto_dtype

    return auto_dtype("cpu") if dtype == "auto" else dtype


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory) -> Iterator[TritonServer]:
    server = triton_factory.start(REPO_ROOT / "model_repository", exit_timeout_s=10)
    triton_factory.release(server)  # `llm` is reloaded here: its exit is checked by stop_checked
    try:
        yield server
    finally:
        stop_checked(server)


def http(server: TritonServer, path: str) -> str:
    return f"http://{server.config.http_url}{path}"


def model_config(server: TritonServer, model: str) -> dict:
    status, config = http_json(http(server, f"/v2/models/{model}/config"))
    assert status == 200, config
    return config


def block_bytes(server: TritonServer) -> tuple[int, int]:
    """(tokens per block, bytes per block) of the prefill pool: 2 (k, v) x layers x kv heads x head dim
    x dtype bytes x block size, from the checkpoint's config.json and the pool's parameters."""
    params = {k: v["string_value"] for k, v in model_config(server, "prefill")["parameters"].items()}
    hf = json.loads((resolve_model_dir() / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    block = int(params["kv.block_size"])
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim
    return block, per_token * DTYPE_BYTES[resolved(params.get("kv.dtype", params["dtype"]))] * block


def pool_baseline(samples: dict) -> dict:
    """The pool gauges that must come back once the server is idle."""
    names = (
        "disagg_kv_blocks_used",
        "disagg_kv_blocks_free",
        "disagg_prefill_queue_requests",
        "disagg_prefill_pending_tokens",
        "disagg_decode_active_sequences",
    )
    return {key: value for key, value in samples.items() if key[0] in names}


def run_streams(server: TritonServer, model: str, prompts: list[str]) -> list[TimedStream]:
    """One request after another on one stream (sequential: the times are not queueing behind each other)."""
    out = []
    with GrpcStream(server.config.grpc_url) as stream:
        for prompt in prompts:
            timed = timed_stream(stream, model, text_request(prompt, TOKENS))
            assert timed.error is None, timed.error
            assert timed.first is not None and timed.final is not None
            out.append(timed)
    return out


def test_exports_every_contract_family(server: TritonServer) -> None:
    """Every family is there; the borrowed seconds' series once the prefill pool has read its lender's
    name from their loan segment (the two pools load side by side: within a metrics interval)."""
    wanted = {f"{family}_count" if kind == "histogram" else family for family, kind in METRIC_NAMES.items()}

    def missing() -> set[str]:
        return wanted - {name for name, _ in scrape_metrics(server.config.metrics_url)}

    wait_until(lambda: not missing(), 30, "every contract family exported")
    assert not missing()


def test_each_pool_instance_says_what_its_engine_resolved_to(server: TritonServer) -> None:
    """disagg_engine_info: one series set to 1 per pool instance, labelled with its configured compute
    and KV dtypes (``auto`` resolved) and the projection and attention paths its engine chose on this
    CPU."""
    from disagg.engine import fp32kernel, kernel
    from disagg.engine.device import onednn_bf16

    samples = scrape_metrics(server.config.metrics_url)
    infos = [
        dict(labels)
        for (name, labels), value in samples.items()
        if name == "disagg_engine_info" and value == 1
    ]
    loads = {
        dict(labels)["instance"]: value
        for (name, labels), value in samples.items()
        if name == "disagg_pool_load_seconds"
    }
    for pool in ("prefill", "decode", "colocated"):
        params = {k: v["string_value"] for k, v in model_config(server, pool)["parameters"].items()}
        mine = [info for info in infos if info["model"] == pool]
        # each instance says how long it took to load (its warm-up prompt alone takes milliseconds)
        assert all(0 < loads[info["instance"]] < 600 for info in mine), (pool, loads)
        assert len(mine) == model_config(server, pool)["instance_group"][0].get("count", 1), mine
        dtype = resolved(params["dtype"])
        bf16 = dtype == "bfloat16"
        kernels = bf16 and kernel.library() is not None
        # fp32 (what `auto` is without AVX-512-BF16) on AVX2: the fp32 kernels; the test model's random
        # weights are no block code, so every row goes through the fp32 tiles
        fp32_kernels = dtype == "float32" and fp32kernel.library() is not None
        projections = (
            "kernel" if kernels
            else "onednn-packed" if bf16 and onednn_bf16()
            else "fp32-kernel" if fp32_kernels
            else "torch"
        )  # fmt: skip
        fp32_cache = resolved(params.get("kv.dtype", params["dtype"])) == "float32"
        for info in mine:
            assert info["dtype"] == dtype
            assert info["kv_dtype"] == resolved(params.get("kv.dtype", params["dtype"]))
            assert info["projections"] == projections
            assert info["attention"] == ("kernel" if kernels or (fp32_kernels and fp32_cache) else "torch")


def test_histograms_counters_and_gauges_agree_with_the_client(server: TritonServer) -> None:
    url = server.config.metrics_url
    started = time.monotonic()
    before = scrape_metrics(url)
    tokenizer = Tokenizer(resolve_model_dir())
    block, bytes_per_block = block_bytes(server)

    disagg_prompts = [f"Metrics probe {i}: the quick brown fox jumps over the lazy dog" for i in range(4)]
    ensemble_prompts = [f"Ensemble probe {i}: pack my box with five dozen liquor jugs" for i in range(2)]
    colocated_prompts = ["Colocated probe: sphinx of black quartz, judge my vow"]
    timed = {
        ("llm", "disaggregated"): run_streams(server, "llm", disagg_prompts),
        ("orchestrator", "disaggregated"): run_streams(server, "ensemble", ensemble_prompts),
        ("orchestrator_colocated", "colocated"): run_streams(server, "ensemble_colocated", colocated_prompts),
    }
    prompts = {
        ("llm", "disaggregated"): disagg_prompts,
        ("orchestrator", "disaggregated"): ensemble_prompts,
        ("orchestrator_colocated", "colocated"): colocated_prompts,
    }
    # A refused request: counted by outcome, absent from the latency histograms.
    with GrpcStream(server.config.grpc_url) as stream:
        refused = timed_stream(stream, "llm", text_request("refused", TOKENS, beam_width=2))
    assert refused.error is not None and "beam_width" in str(refused.error)

    # KV bytes: every disaggregated request hands over the whole blocks of its prompt, once.
    disagg_token_counts = [
        len(tokenizer.encode(p)) for key in timed if key[1] == "disaggregated" for p in prompts[key]
    ]
    expected_bytes = sum(math.ceil(n / block) for n in disagg_token_counts) * bytes_per_block
    baseline = pool_baseline(before)

    def settled() -> dict | None:
        # Pool gauges and transfer counters are published by a reporter thread (every 0.25 s).
        now = scrape_metrics(url)
        moved = metric_sum(now, "disagg_kv_transfer_bytes_total", model="decode") - metric_sum(
            before, "disagg_kv_transfer_bytes_total", model="decode"
        )
        prefilled = metric_sum(now, "disagg_engine_steps_total", model="prefill") - metric_sum(
            before, "disagg_engine_steps_total", model="prefill"
        )
        counted = moved >= expected_bytes and prefilled >= len(disagg_token_counts)
        # every pool's reporter has published since its last request (a short colocated request can
        # end between two reports, its gauges never leaving the baseline)
        published = all(
            metric_sum(now, "disagg_engine_busy_seconds_total", model=pool)
            > metric_sum(before, "disagg_engine_busy_seconds_total", model=pool)
            for pool in ("prefill", "decode", "colocated")
        )
        return now if counted and published and pool_baseline(now) == baseline else None

    after = wait_until(settled, timeout_s=15, what="pool gauges back to baseline and KV bytes counted")

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("disagg_kv_transfer_bytes_total", model="decode") == expected_bytes
    assert delta("disagg_kv_transfer_bytes_total", model="colocated") == 0
    assert delta("disagg_kv_transfer_failures_total") == 0
    assert delta("disagg_kv_transfer_seconds_count", model="decode") == len(disagg_token_counts)
    # engine calls: one prefill per disaggregated prompt; decode steps are shared by the streams of a
    # batch, so between one stream's worth and every stream's; busy time within the test's wall time
    n_disagg = len(disagg_token_counts)
    assert delta("disagg_engine_steps_total", model="prefill") == n_disagg
    assert TOKENS - 1 <= delta("disagg_engine_steps_total", model="decode") <= n_disagg * (TOKENS - 1)
    for pool in ("prefill", "decode", "colocated"):
        assert 0 < delta("disagg_engine_busy_seconds_total", model=pool) < time.monotonic() - started

    report = {}
    for (model, path), runs in timed.items():
        labels = {"model": model, "path": path}
        n = len(runs)
        for family in HISTOGRAMS:
            assert delta(f"{family}_count", **labels) == n, (family, labels)
        assert delta("disagg_requests_total", outcome="ok", **labels) == n
        assert delta("disagg_output_tokens_sum", **labels) == n * TOKENS
        assert delta("disagg_prompt_tokens_sum", **labels) == sum(
            len(tokenizer.encode(p)) for p in prompts[(model, path)]
        )
        server_ttft = delta("disagg_time_to_first_token_seconds_sum", **labels)
        client_ttft = sum(r.ttft for r in runs)  # type: ignore[misc]
        server_tpot = delta("disagg_time_per_output_token_seconds_sum", **labels)
        client_tpot = sum((r.final - r.first) / (TOKENS - 1) for r in runs)  # type: ignore[operator]
        report[model] = (server_ttft, client_ttft, server_tpot, client_tpot)
        assert 0 < server_ttft <= client_ttft <= server_ttft + n * DELIVERY_S, report[model]
        assert abs(client_tpot - server_tpot) <= n * DELIVERY_S / (TOKENS - 1), report[model]
        # every bucket count is cumulative and ends at the count
        inf = metric_series(after, "disagg_time_to_first_token_seconds_bucket", le="+Inf", **labels)
        assert sum(inf.values()) == metric_sum(after, "disagg_time_to_first_token_seconds_count", **labels)

    assert delta("disagg_requests_total", outcome="invalid_arg", **DISAGG) == 1
    assert delta("disagg_requests_total", outcome="ok", **DISAGG) == len(disagg_prompts)
    print("server vs client (ttft sum, tpot sum):", json.dumps(report))


# ---- SLO targets through a reload with a config override --------------------------------------------


def reload_llm(server: TritonServer, parameters: dict[str, str]) -> None:
    """Load `llm` again with its live config, `parameters` laid over its own (the model-repository API
    with a config override, as the triton actuator uses it)."""
    config = model_config(server, "llm")
    config["parameters"] = {**config["parameters"], **{k: {"string_value": v} for k, v in parameters.items()}}
    status, body = http_json(
        http(server, "/v2/repository/models/llm/load"),
        {"parameters": {"config": json.dumps(config)}},
        headers=server.config.admin_headers("http"),
        timeout_s=120,
    )
    assert status == 200, body
    live = model_config(server, "llm")["parameters"]
    assert all(live[k]["string_value"] == v for k, v in parameters.items())


def slo_gauges(server: TritonServer) -> tuple[float, float]:
    samples = scrape_metrics(server.config.metrics_url)
    return (
        metric_sum(samples, "disagg_slo_attainment_ratio", **DISAGG),
        metric_sum(samples, "disagg_goodput_requests_per_second", **DISAGG),
    )


@pytest.mark.slow
def test_attainment_and_goodput_fall_when_the_targets_are_tightened(
    server: TritonServer, leak_probe: LeakProbe
) -> None:
    """Generous targets: every request attains them; the same requests after `llm` is reloaded with
    impossible ones (1 microsecond): none does, attainment 0, goodput 0. The window is the model's, so
    a reload starts an empty one (attainment 1.0 while empty: nothing missed)."""
    window_s = 30.0
    prompts = [f"SLO probe {i}: how vexingly quick daft zebras jump" for i in range(3)]
    try:
        started = time.monotonic()
        reload_llm(server, {"slo.ttft_s": "30", "slo.tpot_s": "5", "slo.window_s": str(window_s)})
        loaded = time.monotonic()
        # a new, empty window; the replaced instance (same labels) takes its share out as it unloads
        wait_until(lambda: slo_gauges(server) == (1.0, 0.0), 15, "the new instance's gauges alone")
        runs = run_streams(server, "llm", prompts)
        attainment, goodput = slo_gauges(server)
        read = time.monotonic()
        assert attainment == 1.0
        # goodput = attaining requests / the window, or the time since the model started if shorter;
        # published when the last request ended (after it was sent) or later (before it was read)
        longest, shortest = min(window_s, read - started), runs[-1].sent - loaded
        assert len(prompts) / longest <= goodput <= len(prompts) / shortest, (goodput, longest, shortest)

        reload_llm(server, {"slo.ttft_s": "1e-6", "slo.tpot_s": "1e-6"})
        run_streams(server, "llm", prompts)
        wait_until(lambda: slo_gauges(server) == (0.0, 0.0), 15, "attainment and goodput 0")
        tight = slo_gauges(server)
        print(f"attainment/goodput: generous ({attainment}, {goodput:.3f}) -> impossible {tight}")
    finally:
        try:
            # back to the orchestrator's defaults (docs/metrics.md); the repository sets none of them
            reload_llm(server, {"slo.ttft_s": "1.0", "slo.tpot_s": "0.1", "slo.window_s": "60"})
        finally:
            # A reload replaces the model's Python backend stub, and with it the stub's shared-memory
            # region (named after the server's prefix). Those are the server's, removed when it stops
            # (checked by the factory at the end of the module): not this test's leak.
            replaced = shm_entries(server.config.shm_prefix)
            leak_probe.before = dataclasses.replace(leak_probe.before, shm=leak_probe.before.shm | replaced)
