"""Process faults on the project's model repository (RELIABILITY.md D1, D2), each on a server of its
own: `kill -9` of the decode instance's stub mid-stream, of the prefill instance's stub with requests
arriving, and of tritonserver itself (its stubs must not outlive it).

Seen on Triton 2.51: the Python backend does not restart the stub of a decoupled model, and the
requests the dead stub held never get a response from Triton. The orchestrator notices an overdue
pool (a liveness probe, `disagg.triton.bls`) and ends those streams UNAVAILABLE; afterwards requests
needing the dead pool fail fast with an error naming it, and `ensemble_colocated` keeps serving.

Also seen on Triton 2.51 (about 1 kill in 10, `disagg_tools.repro.stub_kill_stress`): a stub killed while
it holds the lock of its shared-memory message queue makes tritonserver itself abort (`boost::interprocess::
lock_exception`), and every stream ends with the socket closed. That is Triton's defect; `disagg serve`
starts such a server again (`disagg.restart`, tested in test_server_startup.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from serving_support import (
    NO_ADMISSION,
    REPOSITORY,
    engine_texts,
    generate,
    read_stream,
    repository_with_parameters,
    text_inputs,
)
from triton_support import (
    TRITON_ABORTS,
    GrpcStream,
    LeakProbe,
    TritonFactory,
    live_group_members,
    metric_series,
    metric_sum,
    scrape_metrics,
    shm_entries,
    wait_until,
)

from disagg.kv.secret import load_secret
from disagg.procfs import stub_pids
from disagg.protocol.messages import Prefilled
from disagg.server import TritonServer
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.triton import wire

ERROR_BOUND_S = 30.0  # probe after 5 s overdue, probe deadline 10 s, plus slack for a loaded CI machine
# Streams cut mid-way by a killed decode stub: long enough to outlive the kill by far (the kill comes
# after each stream's first two responses), short enough that three of them finish on the fallback rung
# in seconds (about 7 ms a token each there on the tiny model).
LONG_STREAM = 400


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory) -> TritonServer:
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)  # a server that lost a stub is stopped and checked by the test
    yield server
    server.stop(grace_s=5)


@pytest.fixture(autouse=True)
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


def _stream_tokens(stream: GrpcStream, timeout_s: float) -> tuple[list[str], int, str | None, str | None]:
    """Drain one request of ``stream``: its pieces, the tokens its responses counted (llm's optional
    ``num_output_tokens``), its finish reason and its error."""
    pieces, tokens, reason = [], 0, None
    for event in stream.until_final(timeout_s):
        if event.error is not None:
            return pieces, tokens, reason, str(event.error)
        for name in ("text_output", "num_output_tokens", "finish_reason"):
            value = event.result.as_numpy(name)
            if value is None:
                continue
            item = value.reshape(-1)[0]
            if name == "text_output":
                pieces.append(item.decode("utf-8"))
            elif name == "num_output_tokens":
                tokens += int(item)
            elif item:
                reason = item.decode()
    return pieces, tokens, reason, None


def _triton_aborted(server: TritonServer, errors: list[str | None], test: str) -> bool:
    """Whether tritonserver itself went down with the killed stub (streams ended "Socket closed"). Only
    Triton 2.51's own abort (SIGABRT, `boost::interprocess::lock_exception`) is accepted; it is counted
    in TRITON_ABORTS (reported at the end of the run)."""
    if not any(error and "Socket closed" in error for error in errors):
        return False
    status = wait_until(lambda: server.returncode, 10, "tritonserver exited")
    assert status == -signal.SIGABRT, server.log_tail()
    assert "boost::interprocess::lock_exception" in server.log_tail(200), server.log_tail()
    TRITON_ABORTS.append(test)
    return True


def _served_after_restart(triton_factory: TritonFactory, aborted: TritonServer, expected: str) -> None:
    """After Triton's abort: nothing of the aborted server is left (processes, shared memory, KV
    regions), and a server started again on the same repository, as `disagg serve` does
    (`disagg.restart`, test_server_startup.py), serves the next request."""
    kv_regions = {name for name in shm_entries("disagg-")}
    aborted.stop(grace_s=5)
    assert not live_group_members(aborted.pid), "processes of the aborted server left"
    assert not shm_entries(aborted.config.shm_prefix), "the aborted server's shared memory left"
    restarted = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(restarted)
    try:
        status, reply = generate(restarted, "llm", {"text_input": "Hello world", "max_tokens": 8})
        assert status == 200 and reply["text_output"] == "Hello world" + expected, reply
    finally:
        assert restarted.stop(grace_s=5) == 0, restarted.log_tail()
    assert not live_group_members(restarted.pid) and not shm_entries(restarted.config.shm_prefix)
    left = shm_entries("disagg-") - kv_regions
    assert not left, f"KV regions left after the restarted server stopped: {left}"


def _series(server: TritonServer, name: str, **labels: str) -> dict[frozenset, float]:
    return metric_series(scrape_metrics(server.config.metrics_url), name, **labels)


def _counted(server: TritonServer, name: str, at_least: float, **labels: str) -> dict[frozenset, float]:
    """The series of counter `name` once they add up to `at_least`. An entry point counts a request
    after sending its final response, so a client that has just read the final may be ahead of it."""

    def series() -> dict[frozenset, float] | None:
        found = _series(server, name, **labels)
        return found if sum(found.values()) >= at_least else None

    return wait_until(series, 10, f"{name} {labels} reaching {at_least}")


def test_kill_decode_stub_mid_stream_streams_migrate_and_the_pool_is_restarted(
    server: TritonServer, triton_factory: TritonFactory
) -> None:
    """RELIABILITY D1: `kill -9` of the decode stub with streams in flight. Each stream continues on the
    ladder's next rung (the colocated pool, tried before the prefill pool's local decode while decode is
    gone): no error, one final, every requested token counted once. New requests are served meanwhile;
    the watcher of `llm` restarts the pool through model control, and traffic returns to the
    disaggregated path."""
    expected = engine_texts(["Hello world"], 8)["Hello world"]
    (decode_pid,) = stub_pids(server.pid, "decode")
    streams = [GrpcStream(server.config.grpc_url) for _ in range(3)]
    extra = {"return_num_output_tokens": True, "return_finish_reason": True}
    try:
        for stream, model in zip(streams, ("llm", "ensemble", "llm"), strict=True):
            values = text_inputs("Hello world", LONG_STREAM, stream=True, **(extra if model == "llm" else {}))
            stream.send(model, values)
        before = []  # per stream: the output tokens its first two responses counted
        for stream in streams:
            counted = 0
            for _ in range(2):
                event = stream.next(30)
                assert event.error is None, event
                value = event.result.as_numpy("num_output_tokens")
                counted += 0 if value is None else int(value.reshape(-1)[0])
            before.append(counted)
        # the pool has published the streams' blocks: the killed stub leaves that share in the series
        # (it never retires), which the restarted instance must take over and bring back to 0
        wait_until(
            lambda: sum(_series(server, "disagg_kv_blocks_used", pool="decode").values()) > 0,
            10,
            "the decode pool publishing the streams' blocks",
        )
        os.kill(decode_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [_stream_tokens(stream, ERROR_BOUND_S + 60) for stream in streams]
        ended_after = time.monotonic() - killed_at
    finally:
        for stream in streams:
            stream.close()
    assert ended_after < ERROR_BOUND_S + 60  # every stream ended, with its final or an error
    if _triton_aborted(server, [error for *_, error in results], "D1"):
        _served_after_restart(triton_factory, server, expected)
        return
    for (pieces, tokens, reason, error), model, counted in zip(
        results, ("llm", "ensemble", "llm"), before, strict=True
    ):
        assert error is None, error
        assert pieces, "the stream went on after the kill"
        if model == "llm":
            # the colocated rung has no output cap: the whole output, each token counted once
            assert reason == "length" and counted + tokens == LONG_STREAM, (reason, counted, tokens)
    _counted(server, "disagg_migrations_total", 3)
    fell = _counted(server, "disagg_fallbacks_total", 3, to="colocated")
    assert all(dict(k)["from"] == "disaggregated" for k in fell), fell

    # new requests are served (the colocated rung, or disaggregated again once the pool is back)
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
    assert status == 200 and reply["text_output"] == "Hello world" + expected, reply

    # the watcher restarts the decode pool; both entry points see it healthy and serve normally again
    def recovered() -> bool:
        health = _series(server, "disagg_pool_health", pool="decode")
        mode = _series(server, "disagg_serving_mode", mode="disaggregated", path="disaggregated")
        return (
            bool(stub_pids(server.pid, "decode"))
            and len(health) >= 2
            and not any(health.values())
            and all(v == 1 for v in mode.values())
        )

    wait_until(recovered, 120, "the decode pool restarted and healthy in every entry point's view")
    assert stub_pids(server.pid, "decode") != [decode_pid]
    assert sum(_series(server, "disagg_pool_restarts_total", pool="decode").values()) >= 1
    recovery = _series(server, "disagg_pool_recovery_seconds_count", pool="decode")
    assert sum(recovery.values()) >= 1, recovery
    steps = sum(_series(server, "disagg_engine_steps_total", model="decode").values())
    status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
    assert status == 200 and reply["text_output"] == "Hello world" + expected, reply
    wait_until(
        lambda: sum(_series(server, "disagg_engine_steps_total", model="decode").values()) > steps,
        10,
        "the restarted decode pool serving again",
    )
    # the killed stub's last published blocks are not counted as in use by the restarted pool
    wait_until(
        lambda: sum(_series(server, "disagg_kv_blocks_used", pool="decode").values()) == 0,
        10,
        "the decode pool's blocks in use back to 0 after its restart",
    )


def test_server_with_a_dead_stub_still_stops_without_leftovers(server: TritonServer) -> None:
    server.stop(grace_s=5)  # SIGTERM to the group; SIGKILL after the exit timeout if it must
    wait_until(lambda: not live_group_members(server.pid), 10, "no process of the server left")
    assert not shm_entries(server.config.shm_prefix)


def test_sigterm_with_an_unclaimed_kv_lease_exits_without_waiting_for_it(
    triton_factory: TritonFactory,
) -> None:
    """A stream caught between its prefill and its decode call at SIGTERM: Triton refuses the decode
    call ("Server not ready"), and the prefill pool holds a lease on KV that nothing can pull any more.
    The exit must not wait for it (lease TTL 30 s; a drain waiting for it spent the 10 s exit timeout
    and the server exited 1). Made deterministic by calling the prefill pool as the orchestrator does,
    with a token minted from the deployment secret, and never calling decode."""
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)
    token = TokenSigner(load_secret()).mint(wire.call_subject("unclaimed-1", None))
    job = {
        "input_ids": np.array([1, 42, 305, 7, 9], dtype=np.int32),
        "sampling": np.array([json.dumps({"max_tokens": 8}).encode()], dtype=np.object_),
        "handle": np.array([b"unclaimed-1"], dtype=np.object_),
    }
    try:
        with GrpcStream(server.config.grpc_url) as stream:
            stream.send("prefill", job, parameters={PARAMETER: token})
            responses = [event for event in stream.until_final(30) if event.result is not None]
        assert responses and all(event.error is None for event in responses), responses
        # the pool's first response is its acceptance, with no outputs; the answer comes after it
        assert responses[0].result.as_numpy("event") is None, "the job was not accepted first"
        answers = [event for event in responses if event.result.as_numpy("event") is not None]
        assert len(answers) == 1, answers
        first = answers[0].result
        event = wire.decode_event(first.as_numpy("event")[0], first.as_numpy("descriptor")[0])
        assert isinstance(event, Prefilled) and event.descriptor and event.lease_id, event
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        status = server.wait(server.config.exit_timeout_s + 20)
        exited_after = time.monotonic() - signalled
    finally:
        server.stop(grace_s=5)
    assert status == 0, server.log_tail()
    assert exited_after < server.config.exit_timeout_s, f"the exit took {exited_after:.1f} s"
    wait_until(lambda: not live_group_members(server.pid), 10, "no process of the server left")
    assert not shm_entries(server.config.shm_prefix)


def test_stubs_exit_when_their_server_dies_unreaped(triton_factory: TritonFactory) -> None:
    """`kill -9` of tritonserver itself, with nobody reaping it yet (it stays a zombie): the stubs'
    own parent check (`kill(pid, 0)`) still sees it; the project's watch (`disagg.triton.watchdog`)
    ends them and the pools unlink their KV regions."""
    kv_before = shm_entries("disagg-")
    server = triton_factory.start(REPOSITORY, exit_timeout_s=10)
    triton_factory.release(server)
    try:
        stubs = live_group_members(server.pid) - {server.pid}
        assert len(stubs) >= 5, stubs
        assert shm_entries("disagg-") - kv_before, "the pools created no KV region"
        os.kill(server.pid, signal.SIGKILL)  # not waited for: the server stays a zombie meanwhile
        wait_until(lambda: not live_group_members(server.pid), 20, "every stub gone after the server died")
        assert not shm_entries("disagg-") - kv_before, "KV regions outlived their pools"
    finally:
        server.stop(grace_s=5)  # reaps the zombie, removes the Python backend's regions
    assert not shm_entries(server.config.shm_prefix)


def test_kill_prefill_stub_requests_move_to_colocated_and_nothing_is_left(
    triton_factory: TritonFactory, tmp_path: Path
) -> None:
    """RELIABILITY D2: `kill -9` of the prefill instance's stub with requests arriving. The requests
    caught in prefill migrate to the colocated pool (the ladder's rung without prefill) and finish;
    later ones are served there too; the decode pool holds no KV block; the prefill pool is restarted;
    once the server stops, the dead pool's KV region is gone too (the launcher sweeps regions of dead
    owners)."""
    expected = engine_texts(["Hello world"], 8)["Hello world"]
    kv_before = shm_entries("disagg-")
    # admission off: the colocated pool's speed is not measured yet when the prompts fall to it, and a
    # cold pool admits a 2,048-token backlog (the refusal would be right, but this tests the fallback)
    server = triton_factory.start(repository_with_parameters(tmp_path, NO_ADMISSION), exit_timeout_s=10)
    triton_factory.release(server)
    streams = [GrpcStream(server.config.grpc_url) for _ in range(3)]
    try:
        (prefill_pid,) = stub_pids(server.pid, "prefill")
        prompt = "The quick brown fox jumps over the lazy dog. " * 40
        for stream in streams:
            stream.send("llm", text_inputs(prompt, 64, stream=True))
        os.kill(prefill_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [read_stream(stream, timeout_s=ERROR_BOUND_S + 60) for stream in streams]
        assert time.monotonic() - killed_at < ERROR_BOUND_S + 60
        if _triton_aborted(server, [result.error for result in results], "D2"):
            assert all(result.final or result.error for result in results), results
            _served_after_restart(triton_factory, server, expected)
            return
        for result in results:
            assert result.error is None and result.final and result.pieces, result

        status, reply = generate(server, "llm", {"text_input": "Hello world", "max_tokens": 8})
        assert status == 200 and reply["text_output"] == "Hello world" + expected, reply
        fell = _counted(server, "disagg_fallbacks_total", 1, to="colocated")
        assert all(dict(k)["from"] == "disaggregated" for k in fell), fell

        def decode_blocks_used() -> float:
            return metric_sum(
                scrape_metrics(server.config.metrics_url), "disagg_kv_blocks_used", pool="decode"
            )

        wait_until(lambda: decode_blocks_used() == 0, 15, "decode KV blocks all free")
        wait_until(
            lambda: (
                stub_pids(server.pid, "prefill")
                and not any(_series(server, "disagg_pool_health", pool="prefill").values())
            ),
            120,
            "the prefill pool restarted and healthy",
        )
    finally:
        for stream in streams:
            stream.close()
        server.stop(grace_s=5)
    assert not live_group_members(server.pid)
    assert not shm_entries(server.config.shm_prefix)
    assert not shm_entries("disagg-") - kv_before, "the dead prefill pool's KV region is still there"
