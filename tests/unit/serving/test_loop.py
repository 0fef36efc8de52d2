"""Engine loop lifecycle: draining before an instance goes away."""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from disagg.engine.engine import EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.kv.settings import KVSettings
from disagg.pool.instance import PoolConfig, build_instance
from disagg.protocol.errors import UNAVAILABLE, ServingError
from disagg.protocol.messages import DecodeJob, Failed, Prefilled, PrefillJob, Token


class Sink:
    def __init__(self) -> None:
        self.events: list[object] = []
        self.done = threading.Event()

    def emit(self, event: object, final: bool) -> None:
        self.events.append(event)
        if final:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


@pytest.fixture
def pools(tiny_model_dir):
    secret, prefix = secrets.token_bytes(32), f"drain{secrets.token_hex(3)}"
    built = {}
    for role in ("prefill", "decode"):
        engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=32, block_size=16)
        built[role] = build_instance(
            PoolConfig(role=role, engine=engine, prefix=prefix, kv=KVSettings(lease_ttl_s=30.0)), secret
        )
    loops = {role: loop.start() for role, (loop, _) in built.items()}
    yield loops
    for loop in loops.values():
        loop.shutdown()
    for _, transport in built.values():
        transport.close()


def test_drain_waits_for_exported_kv_to_be_pulled(pools):
    prefill, decode = pools["prefill"], pools["decode"]
    sink = Sink()
    prefill.submit(PrefillJob("r1", sink, Request((1, 5, 6, 7), SamplingParams(max_tokens=4))))
    assert sink.done.wait(30)
    first = sink.events[-1]
    assert isinstance(first, Prefilled) and prefill.stats().held_leases == 1

    assert prefill.drain(0.2) is False, "a held lease keeps the instance from draining"
    assert prefill.drain(0.2, leases=False) is True, "at exit nothing can import: leases do not count"
    assert prefill.stats().held_leases == 1, "the lease stays until it is pulled, acked or expires"
    with pytest.raises(ServingError) as refused:
        prefill.submit(PrefillJob("r2", Sink(), Request((1, 2), SamplingParams(max_tokens=2))))
    assert refused.value.code == UNAVAILABLE

    drained = []
    waiter = threading.Thread(target=lambda: drained.append(prefill.drain(20.0)))
    waiter.start()
    out = Sink()
    decode.submit(DecodeJob("r1", out, first.state, first.descriptor))
    assert out.done.wait(30) and isinstance(out.events[-1], Token) and out.events[-1].finished
    waiter.join(30)
    assert drained == [True], "the importer's ack released the lease and the drain completed"
    assert prefill.engine.kv.free_blocks == prefill.engine.kv.num_blocks


def test_a_prefill_loop_waits_while_leases_hold_its_blocks(tiny_model_dir):
    """Every block of a prefill pool exported and held under leases, one more prompt queued: nothing
    can run until an importer acks, and the loop waits for that message instead of spinning (which
    held the GIL against every other thread of the pool process). Measured over half a second: a
    waiting loop wakes every ``idle_wait_s`` (50 ms), a spinning one ran thousands of iterations."""
    secret, prefix = secrets.token_bytes(32), f"stall{secrets.token_hex(3)}"
    engine = EngineConfig(model_dir=tiny_model_dir, num_blocks=2, block_size=16)
    loop, transport = build_instance(PoolConfig(role="prefill", engine=engine, prefix=prefix), secret)
    loop.start()
    try:
        for handle in ("a", "b"):  # one block each, exported and held
            sink = Sink()
            loop.submit(PrefillJob(handle, sink, Request((1, 5, 6), SamplingParams(max_tokens=4))))
            assert sink.done.wait(30) and isinstance(sink.events[-1], Prefilled)
        queued = Sink()
        loop.submit(PrefillJob("c", queued, Request((1, 2, 3), SamplingParams(max_tokens=4))))
        before = loop.iterations
        assert not queued.done.wait(0.5), "no block is free: the third prompt waits"
        assert loop.stats().queued == 1 and loop.stats().held_leases == 2
        assert loop.iterations - before < 40, f"{loop.iterations - before} iterations while stalled"
    finally:
        loop.shutdown()
        transport.close()


def test_engine_calls_are_counted_with_their_time(pools):
    """The counters behind `disagg_engine_steps_total` / `disagg_engine_busy_seconds_total`: one call
    per prompt prefilled, one per decode batch step, and the seconds spent inside them."""
    prefill, decode = pools["prefill"], pools["decode"]
    warmed = prefill.stats()  # the prefill pool's warm-up: one prompt prefilled before serving
    assert (warmed.engine_steps, warmed.prompt_tokens_done) == (1, 256) and warmed.engine_busy_s > 0
    assert decode.stats().engine_steps == 0, "a decode pool has no prompt to warm up with"
    assert prefill.engine.kv.free_blocks == prefill.engine.kv.num_blocks, "the warm-up's KV is back"
    sink = Sink()
    params = SamplingParams(max_tokens=5, min_length=5)
    prefill.submit(PrefillJob("r1", sink, Request((1, 5, 6, 7), params)))
    assert sink.done.wait(30)
    first = sink.events[-1]
    out = Sink()
    decode.submit(DecodeJob("r1", out, first.state, first.descriptor))
    assert out.done.wait(30) and out.events[-1].finished
    prefilled, decoded = prefill.stats(), decode.stats()
    assert prefilled.engine_steps == warmed.engine_steps + 1
    assert decoded.engine_steps == 4, "tokens 2..5, one decode step each"
    assert prefilled.engine_busy_s > warmed.engine_busy_s and decoded.engine_busy_s > 0
    load = decoded.load()  # what a ping answers: the orchestrator's adaptive hot-group cap reads them
    assert (load.engine_steps, load.busy_s) == (4, decoded.engine_busy_s)
    # decode steps are no prefill time (admission's prefill throughput); every prefill call is
    assert load.prefill_busy_s == 0.0
    assert prefill.stats().load().prefill_busy_s == prefilled.engine_busy_s


@pytest.mark.parametrize("failing", [1, 3], ids=["the step of the plan that imports", "a later step"])
def test_engine_fault_mid_step_fails_the_batch_and_refuses_new_work(pools, failing):
    """RELIABILITY D3: the decode engine raises during a step. Every sequence it held ends with
    UNAVAILABLE naming the pool (no hang), the loop reports unhealthy (its stats, hence the metrics),
    and new jobs are refused at once instead of queueing behind a dead engine. The first step runs in
    the plan that imports the jobs, whose results the scheduler was still waiting for: they end too."""
    prefill, decode = pools["prefill"], pools["decode"]
    firsts = []
    for i in range(2):
        sink = Sink()
        prefill.submit(PrefillJob(f"r{i}", sink, Request((1, 5, 6, 7 + i), SamplingParams(max_tokens=50))))
        assert sink.done.wait(30)
        firsts.append(sink.events[-1])
    steps = []
    real_step = decode.engine.decode_step

    def failing_step():
        steps.append(1)
        if len(steps) == failing:
            raise RuntimeError("simulated engine fault")
        return real_step()

    decode.engine.decode_step = failing_step
    outs = [Sink() for _ in firsts]
    for i, (first, out) in enumerate(zip(firsts, outs, strict=True)):
        decode.submit(DecodeJob(f"r{i}", out, first.state, first.descriptor))
    for out in outs:
        assert out.done.wait(30), "a sequence of the failed batch never ended"
        failed = out.events[-1]
        assert isinstance(failed, Failed) and failed.error.code == UNAVAILABLE
        assert "decode pool failed" in failed.error.message
    assert decode.healthy is False and decode.stats().healthy is False
    with pytest.raises(ServingError) as refused:
        decode.submit(DecodeJob("r9", Sink(), firsts[0].state, firsts[0].descriptor))
    assert refused.value.code == UNAVAILABLE and "not serving" in refused.value.message


def test_decode_imports_beyond_the_batch_cap_wait_for_a_slot(tiny_model_dir):
    """More hand-offs than `max_batch_size` at once: the extra ones wait in FIFO order for a sequence to
    finish, and every request completes (RELIABILITY E3), instead of the extra ones failing with
    INVALID_ARG as if the client's input were bad."""
    secret, prefix = secrets.token_bytes(32), f"cap{secrets.token_hex(3)}"
    built = {
        role: build_instance(
            PoolConfig(
                role=role,
                engine=EngineConfig(model_dir=tiny_model_dir, num_blocks=64, block_size=16, max_batch_size=2),
                prefix=prefix,
                kv=KVSettings(lease_ttl_s=30.0),
            ),
            secret,
        )
        for role in ("prefill", "decode")
    }
    loops = {role: loop.start() for role, (loop, _) in built.items()}
    try:
        prefill, decode = loops["prefill"], loops["decode"]
        firsts = []
        for n in range(5):
            sink = Sink()
            prefill.submit(PrefillJob(f"r{n}", sink, Request((1, 5 + n, 6), SamplingParams(max_tokens=6))))
            assert sink.done.wait(30)
            firsts.append(sink.events[-1])
        assert all(isinstance(first, Prefilled) for first in firsts)
        outs = [Sink() for _ in firsts]
        for n, (first, out) in enumerate(zip(firsts, outs, strict=True)):
            decode.submit(DecodeJob(f"r{n}", out, first.state, first.descriptor))
        for out in outs:
            assert out.done.wait(60)
            assert not any(isinstance(e, Failed) for e in out.events), out.events
            tokens = [e for e in out.events if isinstance(e, Token)]
            assert tokens[-1].finished and len(tokens) == 5  # max_tokens 6: one from prefill, five here
        assert decode.engine.kv.free_blocks == decode.engine.kv.num_blocks
        assert prefill.stats().held_leases == 0
    finally:
        for loop in loops.values():
            loop.shutdown()
        for _, transport in built.values():
            transport.close()


def test_a_kv_lease_is_renewed_while_its_import_waits_for_decode_blocks(tiny_model_dir, tmp_path):
    """RELIABILITY E2: the decode pool's blocks are all taken by a long sequence, so the next import
    waits past its 8 s lease. The decode loop renews the lease, the prefill pool keeps the KV,
    and once the long sequence is stopped the waiting import is pulled and decoded: nothing expired.

    The long sequence asks for 8000 tokens (a copy of the tiny model with an 8192-token context, its
    weights linked), so it outlasts the two renewals however fast the machine decodes: at 240
    tokens, a quiet machine ended it within a second, before any renewal."""
    model = tmp_path / "long-context"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "config.json":
            (model / path.name).symlink_to(path.resolve())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    secret, prefix = secrets.token_bytes(32), f"renew{secrets.token_hex(3)}"
    built = {
        role: build_instance(
            PoolConfig(
                role=role,
                engine=EngineConfig(model_dir=model, num_blocks=blocks, block_size=16),
                prefix=prefix,
                kv=KVSettings(lease_ttl_s=8.0),
            ),
            secret,
        )
        for role, blocks in (("prefill", 520), ("decode", 501))
    }
    prefill, decode = (built[role][0].start() for role in ("prefill", "decode"))
    exporter, importer = built["prefill"][1], built["decode"][1]
    try:
        handed = {}
        for handle, max_tokens in (("long", 8000), ("waits", 8)):  # all 501 blocks for the first, 1 more
            sink = Sink()
            prefill.submit(
                PrefillJob(handle, sink, Request((1, 5, 6, 7), SamplingParams(max_tokens=max_tokens)))
            )
            assert sink.done.wait(30) and isinstance(sink.events[-1], Prefilled)
            handed[handle] = sink.events[-1]
        long_out, waiting_out = Sink(), Sink()
        decode.submit(DecodeJob("long", long_out, handed["long"].state, handed["long"].descriptor))
        decode.submit(DecodeJob("waits", waiting_out, handed["waits"].state, handed["waits"].descriptor))

        deadline = time.monotonic() + 30
        while exporter.stats.snapshot().lease_renewals < 2:  # renewed at about 4 s and 8 s of waiting
            assert time.monotonic() < deadline and not waiting_out.done.is_set(), (
                f"no renewal, or no wait: {waiting_out.events}, {len(long_out.events)} tokens of the long one"
            )
            long_out.done.wait(0.05)
        assert not waiting_out.events and decode.stats().queued == 1, "still waiting for blocks"
        decode.stop("long")  # its blocks come back; the waiting import takes them
        assert waiting_out.done.wait(30)
        assert isinstance(waiting_out.events[-1], Token) and waiting_out.events[-1].finished
        snap = exporter.stats.snapshot()
        assert snap.lease_expiries == 0 and snap.acks == 2, "both leases ended by their importer's ack"
        assert importer.stats.snapshot().renewals_sent == snap.lease_renewals
    finally:
        for loop in (prefill, decode):
            loop.shutdown()
        for _, transport in built.values():
            transport.close()


def test_the_batch_tuner_raises_a_slot_bound_limit_and_the_stats_show_it(tiny_model_dir):
    """A decode pool whose tuner starts at a batch of 2, six hand-offs at once: four wait for a slot
    with their blocks free, so the first interval that ends grows the limit to the demand; every
    request completes, and the limit and the decisions are in the pool's stats (its /metrics)."""
    secret, prefix = secrets.token_bytes(32), f"tune{secrets.token_hex(3)}"
    built = {
        role: build_instance(
            PoolConfig(
                role=role,
                engine=EngineConfig(
                    model_dir=tiny_model_dir, num_blocks=128, block_size=16, max_batch_size=8
                ),
                prefix=prefix,
                kv=KVSettings(lease_ttl_s=30.0),
                **(
                    {"batch_tpot_slo_s": 10.0, "batch_start": 2, "batch_interval_s": 0.05}
                    if role == "decode"
                    else {}
                ),
            ),
            secret,
        )
        for role in ("prefill", "decode")
    }
    loops = {role: loop.start() for role, (loop, _) in built.items()}
    try:
        prefill, decode = loops["prefill"], loops["decode"]
        assert decode.stats().batch_limit == 2
        firsts = []
        for n in range(6):
            sink = Sink()
            prefill.submit(PrefillJob(f"t{n}", sink, Request((1, 7 + n, 6), SamplingParams(max_tokens=100))))
            assert sink.done.wait(30)
            firsts.append(sink.events[-1])
        outs = [Sink() for _ in firsts]
        for n, (first, out) in enumerate(zip(firsts, outs, strict=True)):
            decode.submit(DecodeJob(f"t{n}", out, first.state, first.descriptor))
        for out in outs:
            assert out.done.wait(60)
            assert not any(isinstance(e, Failed) for e in out.events), out.events
        stats = decode.stats()
        decisions = {(action, reason): n for action, reason, n in stats.batch_decisions}
        assert decisions.get(("grow", "under_slo"), 0) >= 1, decisions
        assert decode.engine.kv.free_blocks == decode.engine.kv.num_blocks
    finally:
        for loop in loops.values():
            loop.shutdown()
        for _, transport in built.values():
            transport.close()
