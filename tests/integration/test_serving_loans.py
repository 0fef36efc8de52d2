"""Core loans on a real Triton (`disagg repository --prefill-borrow 1`): while a stream decodes and a
long prompt prefills, the prefill pool's borrowed helper computes on the decode pool's core (its
thread, pinned there, ran on a CPU), the borrowed and lent seconds counters move, and both texts
are the engine's. What lending does to TTFT and TPOT is measured in `perf/` (`make bench`), never here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from serving_support import engine_texts, read_stream, text_inputs
from triton_support import GrpcStream, LeakProbe, TritonFactory, metric_sum, scrape_metrics

from disagg.procfs import stub_pids
from disagg.server import TritonServer, process_group_members
from disagg_tools.repository import main as write_repository

SHORT, LONG_WORDS = "Hello world", 700
STREAM_TOKENS, PROMPT_TOKENS = 96, 4
DECODE_CORE = 1

pytestmark = pytest.mark.skipif(
    not {0, DECODE_CORE} <= os.sched_getaffinity(0), reason="core loans need cores 0 and 1"
)


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    out = tmp_path_factory.mktemp("loans") / "repository"
    # float32: the texts are compared with the engine's token for token on any CPU
    command = ["--out", str(out), "--dtype", "float32", "--prefill-borrow", str(DECODE_CORE)]
    assert write_repository([*command, "--decode-lend-tpot", "0.05"]) == 0
    return triton_factory.start(out, exit_timeout_s=10)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _long_prompt() -> str:
    words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "wizards", "judge")
    return " ".join(words[i % len(words)] for i in range(LONG_WORDS))


def _stub_pid(server: TritonServer, instance: str) -> int:
    for pid in process_group_members(server.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if instance.encode() in argv:
            return pid
    raise AssertionError(f"no stub of {instance}")


def _threads_on(pid: int, core: int) -> dict[int, int]:
    """The threads of ``pid`` pinned to ``core`` alone, with their time on a CPU so far (nanoseconds,
    ``/proc/.../schedstat``: exact, where the ticks of ``stat`` count in 10 ms)."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) != {core}:
                continue
            times[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ProcessLookupError):
            continue
    return times


def _counter(server: TritonServer, name: str, **labels: str) -> float:
    return metric_sum(scrape_metrics(server.config.metrics_url), name, **labels)


def test_a_long_prompt_borrows_the_decode_core_while_a_stream_decodes(server: TritonServer) -> None:
    long_prompt = _long_prompt()
    expected = engine_texts([SHORT], STREAM_TOKENS, dtype="float32")[SHORT]
    expected_long = engine_texts([long_prompt], PROMPT_TOKENS, dtype="float32")[long_prompt]
    prefill = _stub_pid(server, "prefill_0_0")
    before = _threads_on(prefill, DECODE_CORE)
    assert before, "the prefill stub has a thread pinned to the decode pool's core (its borrowed helper)"
    borrowed = _counter(server, "disagg_borrowed_core_seconds_total", model="prefill")
    lent = _counter(server, "disagg_lent_core_seconds_total", model="decode")

    with GrpcStream(server.config.grpc_url) as stream, GrpcStream(server.config.grpc_url) as prompt:
        stream.send("llm", text_inputs(SHORT, STREAM_TOKENS, stream=True))
        first = stream.next(60)  # the stream decodes ...
        assert first.error is None and not first.final, first
        prompt.send("llm", text_inputs(long_prompt, PROMPT_TOKENS, stream=True))  # ... a long prompt comes
        long_result = read_stream(prompt, 120)
        result = read_stream(stream, 120)
    assert long_result.error is None and long_result.final, long_result
    assert result.error is None and result.final, result
    output = first.result.as_numpy("text_output")
    pieces = [*([] if output is None else [output.reshape(-1)[0].decode()]), *result.pieces]
    assert "".join(pieces) == expected, "the stream's text is the engine's"
    assert "".join(long_result.pieces) == expected_long, "the borrowed prefill gives the engine's text"

    after = _threads_on(prefill, DECODE_CORE)
    assert any(after.get(tid, 0) > ticks for tid, ticks in before.items()), (
        "the helper ran on the decode core"
    )
    assert _counter(server, "disagg_borrowed_core_seconds_total", model="prefill") > borrowed
    assert _counter(server, "disagg_lent_core_seconds_total", model="decode") > lent


def test_the_orchestrators_run_on_the_entry_points_core_and_the_text_steps_on_any(
    server: TritonServer,
) -> None:
    # entry_points.cores (core 0, here and by default) pins the orchestrators, every thread; the text
    # steps are left on every core the server may use (a burst's tokenization then takes both)
    def placed(model: str) -> set[frozenset[int]]:
        (pid,) = stub_pids(server.pid, model)
        return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}

    for model in ("orchestrator", "llm"):
        assert placed(model) == {frozenset({0})}, model
    anywhere = frozenset(os.sched_getaffinity(server.pid))
    for model in ("preprocessing", "postprocessing"):
        assert placed(model) == {anywhere}, model
