"""The role schedulers alone, over a pure-Python backend: admission order, capacity limits, waiting,
the prefill token budget, cancellation, and exact block accounting."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from scheduler_fakes import FakeBackend, decode_job, generate_job, prefill_job

from disagg.engine.errors import SequenceFailed
from disagg.pool.runner import Runner
from disagg.protocol.errors import INVALID_ARG, UNAVAILABLE, Reason, ServingError
from disagg.protocol.messages import Failed, Prefilled, Token
from disagg.scheduling import (
    ColocatedScheduler,
    DecodeScheduler,
    PrefillScheduler,
    Scheduler,
    SchedulerConfig,
    create_scheduler,
)


def _drive(scheduler: Scheduler, backend: FakeBackend, steps: int = 1) -> list:
    """``steps`` iterations of the engine loop, without threads; returns every emission."""
    runner = Runner(backend)
    out = []
    for _ in range(steps):
        plan = scheduler.schedule()
        out.extend(scheduler.postprocess(runner.run(plan)))
        assert scheduler.ledger.reserved == backend.usage().used, "the ledger mirrors the engine"
    return out


def _finals(emissions) -> list[str]:
    return [e.job.handle for e in emissions if e.final]


# ----------------------------------------------------------------------------------- decode


def test_decode_batch_full_means_wait_then_run():
    """max_batch_size=2, three hand-offs: the third waits (no error), then runs when a slot frees."""
    backend = FakeBackend(max_batch_size=2)
    scheduler = DecodeScheduler(backend.limits)
    jobs = [decode_job("a", max_tokens=3), decode_job("b", max_tokens=5), decode_job("c", max_tokens=3)]
    for job in jobs:
        assert scheduler.add(job) is None
    first = scheduler.schedule()
    assert [j.handle for j in first.imports] == ["a", "b"] and first.decode
    emissions = scheduler.postprocess(Runner(backend).run(first))
    assert scheduler.num_waiting == 1 and scheduler.num_running == 2
    assert not any(isinstance(e.event, Failed) for e in emissions)
    emissions = _drive(scheduler, backend, steps=1)  # "a" reaches max_tokens (its 3rd token)
    assert _finals(emissions) == ["a"] and scheduler.num_waiting == 1
    plan = scheduler.schedule()
    assert [j.handle for j in plan.imports] == ["c"], "the freed slot goes to the waiting job"
    emissions = scheduler.postprocess(Runner(backend).run(plan))
    emissions += _drive(scheduler, backend, steps=5)
    assert sorted(_finals(emissions)) == ["b", "c"]
    assert all(isinstance(e.event, Token) for e in emissions)
    assert scheduler.idle and backend.usage().used == 0


def test_decode_waits_on_full_kv_in_fifo_order():
    backend = FakeBackend(num_blocks=4, block_size=4, max_batch_size=8)
    scheduler = DecodeScheduler(backend.limits)
    # each needs blocks_for(4 + 4) = 2 blocks: two fit, the third and fourth wait, in order
    for name in "abcd":
        scheduler.add(decode_job(name))
    plan = scheduler.schedule()
    assert [j.handle for j in plan.imports] == ["a", "b"]
    scheduler.postprocess(Runner(backend).run(plan))
    emissions = _drive(scheduler, backend, steps=2)  # tokens 3 and 4 of 4
    assert _finals(emissions) == ["a", "b"] and scheduler.num_waiting == 2
    plan = scheduler.schedule()
    assert [j.handle for j in plan.imports] == ["c", "d"]


def test_small_jobs_pass_a_head_that_waits_for_blocks_a_bounded_number_of_times():
    """RELIABILITY E2: the head waits for KV blocks; small imports behind it that fit go first, at
    most ``max_overtakes`` times, then nothing passes it until it is admitted; 0 keeps strict FIFO."""
    backend = FakeBackend(num_blocks=8, block_size=4)
    scheduler = DecodeScheduler(backend.limits, SchedulerConfig(max_overtakes=2))
    scheduler.add(decode_job("big", prompt_len=12, max_tokens=8))  # 5 blocks, for 7 more steps
    _drive(scheduler, backend)
    scheduler.add(decode_job("huge", prompt_len=16, max_tokens=4))  # 5 blocks: waits for "big"
    for name in ("s1", "s2", "s3"):
        scheduler.add(decode_job(name, prompt_len=1, max_tokens=2))  # 1 block each
    plan = scheduler.schedule()
    assert [j.handle for j in plan.imports] == ["s1", "s2"], "two pass the waiting head, no more"
    scheduler.postprocess(Runner(backend).run(plan))
    assert scheduler.schedule().imports == (), "s3 fits but waits behind huge now"
    admitted = []
    for _ in range(12):
        plan = scheduler.schedule()
        admitted += [j.handle for j in plan.imports]
        scheduler.postprocess(Runner(backend).run(plan))
    assert admitted == ["huge", "s3"], "huge gets big's blocks first, then s3 goes"
    assert scheduler.idle and backend.usage().used == 0

    fifo = DecodeScheduler(FakeBackend(num_blocks=6, block_size=4).limits, SchedulerConfig(max_overtakes=0))
    fifo.add(decode_job("big", prompt_len=12, max_tokens=4))
    fifo.ledger.reserve("big", 4)  # as if admitted and running
    fifo._waiting.popleft()
    fifo.add(decode_job("huge", prompt_len=16, max_tokens=4))  # 5 blocks: waits
    fifo.add(decode_job("small", prompt_len=1, max_tokens=3))  # 1 block would fit
    assert fifo.schedule().imports == (), "max_overtakes 0: FIFO, nothing overtakes the head"


def test_check_refuses_what_could_never_fit_and_foreign_operations():
    backend = FakeBackend(num_blocks=4, block_size=4)
    scheduler = DecodeScheduler(backend.limits)
    with pytest.raises(ServingError) as too_big:
        scheduler.check(decode_job("x", prompt_len=20, max_tokens=4))
    assert too_big.value.code == INVALID_ARG and "needs 6 KV blocks" in too_big.value.message
    with pytest.raises(ServingError) as foreign:
        scheduler.check(prefill_job("y"))
    assert foreign.value.code == INVALID_ARG and "does not run prefill jobs" in foreign.value.message


def test_queue_bound_refuses_unavailable():
    scheduler = DecodeScheduler(FakeBackend().limits, SchedulerConfig(max_queue=2))
    assert scheduler.add(decode_job("a")) is None and scheduler.add(decode_job("b")) is None
    refusal = scheduler.add(decode_job("c"))
    assert refusal is not None and refusal.final
    assert isinstance(refusal.event, Failed) and refusal.event.error.code == UNAVAILABLE
    assert "queue is full (2)" in refusal.event.error.message and scheduler.num_waiting == 2
    assert refusal.event.error.reason is Reason.FULL  # saturated, not gone, to the orchestrator


def test_duplicate_handle_is_refused():
    scheduler = DecodeScheduler(FakeBackend().limits)
    scheduler.add(decode_job("a"))
    refusal = scheduler.add(decode_job("a"))
    assert refusal is not None and refusal.event.error.code == INVALID_ARG


def test_cancel_while_queued_and_while_running():
    backend = FakeBackend(max_batch_size=1)
    scheduler = DecodeScheduler(backend.limits)
    scheduler.add(decode_job("run", max_tokens=8))
    scheduler.add(decode_job("queued"))
    _drive(scheduler, backend)
    queued = scheduler.remove("queued")
    assert queued is not None and queued.job.handle == "queued" and queued.seq_id is None
    running = scheduler.remove("run")
    assert running is not None and running.seq_id is not None
    assert scheduler.ledger.reserved == 0, "a removed sequence's blocks are released in the ledger"
    backend.free(running.seq_id)
    assert scheduler.idle and backend.usage().used == 0
    assert scheduler.remove("run") is None, "removal is idempotent"


# ----------------------------------------------------------------------------------- prefill


def test_prefill_one_prompt_per_step_fifo_and_blocks_held_by_lease():
    backend = FakeBackend(num_blocks=4, block_size=4)
    scheduler = PrefillScheduler(backend.limits)
    for name in "abc":
        scheduler.add(prefill_job(name, prompt_len=8))  # 2 blocks each (prompt only)
    handed = _drive(scheduler, backend, steps=2)
    assert _finals(handed) == ["a", "b"] and all(isinstance(e.event, Prefilled) for e in handed)
    assert scheduler.held_leases == 2 and scheduler.ledger.free == 0
    assert _drive(scheduler, backend) == [], "c waits while leases hold every block"
    seq_id = scheduler.lease_released(handed[0].event.lease_id)
    assert seq_id is not None
    backend.free(seq_id)
    assert _finals(_drive(scheduler, backend)) == ["c"]
    assert backend.calls == ["chunk 8"] * 3, "whole prompts: one chunk each"


def test_prefill_stop_after_export_aborts_the_lease():
    backend = FakeBackend()
    scheduler = PrefillScheduler(backend.limits)
    scheduler.add(prefill_job("a"))
    (handed,) = _drive(scheduler, backend)
    assert scheduler.idle and scheduler.held_leases == 1, "a held lease is not work: the loop waits"
    assert scheduler.schedule().empty
    removal = scheduler.remove("a")
    assert removal is not None and removal.job is None and removal.lease_id == handed.event.lease_id
    assert scheduler.held_leases == 1, "the lease ends when the transport reports it"
    backend.free(scheduler.lease_released(removal.lease_id))
    assert scheduler.idle and scheduler.ledger.reserved == 0 == backend.usage().used


def test_prefill_first_token_that_ends_the_sequence_holds_nothing():
    backend = FakeBackend()
    scheduler = PrefillScheduler(backend.limits)
    scheduler.add(prefill_job("a", max_tokens=1))
    (emission,) = _drive(scheduler, backend)
    assert (
        isinstance(emission.event, Prefilled) and emission.event.finished and emission.event.lease_id is None
    )
    assert scheduler.idle and scheduler.held_leases == 0


# ----------------------------------------------------------------------------------- colocated


def test_colocated_prefill_token_budget_admits_at_least_one_prompt():
    backend = FakeBackend(num_blocks=256)
    scheduler = ColocatedScheduler(backend.limits, SchedulerConfig(max_prefill_tokens=10))
    scheduler.add(generate_job("long", prompt_len=40))  # over the budget alone: still admitted
    scheduler.add(generate_job("x", prompt_len=4))
    plan = scheduler.schedule()
    assert [c.job.handle for c in plan.prefill] == ["long"]
    scheduler.postprocess(Runner(backend).run(plan))
    scheduler.add(generate_job("y", prompt_len=4))
    scheduler.add(generate_job("z", prompt_len=4))
    plan = scheduler.schedule()
    assert [c.job.handle for c in plan.prefill] == ["x", "y"], "4 + 4 tokens fit the budget of 10; z waits"
    assert plan.decode


def test_colocated_batch_slots_and_first_tokens():
    backend = FakeBackend(num_blocks=256, max_batch_size=2)
    scheduler = ColocatedScheduler(backend.limits)
    for name in "abc":
        scheduler.add(generate_job(name, max_tokens=2))
    emissions = _drive(scheduler, backend)
    # a and b prefilled (first tokens) and stepped once (their last tokens); c waited for a slot
    assert [(e.job.handle, e.final) for e in emissions] == [
        ("a", False),
        ("b", False),
        ("a", True),
        ("b", True),
    ]
    assert _finals(_drive(scheduler, backend)) == ["c"]
    assert scheduler.idle and backend.usage().used == 0


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_random_workload_keeps_exact_accounting(role):
    """Random arrivals, lengths and cancellations: the ledger always equals the engine's usage, no
    capacity error ever reaches a job, and everything is given back at the end."""
    rng = random.Random(7)
    backend = FakeBackend(num_blocks=40, block_size=4, max_batch_size=5)
    scheduler = create_scheduler(role, backend.limits)
    make = decode_job if role == "decode" else generate_job
    runner, finals, submitted = Runner(backend), set(), 0
    for _ in range(400):
        if submitted < 150 and rng.random() < 0.5:
            job = make(f"r{submitted}", prompt_len=rng.randrange(1, 30), max_tokens=rng.randrange(2, 12))
            scheduler.check(job)
            assert scheduler.add(job) is None
            submitted += 1
        if submitted and rng.random() < 0.1:
            removal = scheduler.remove(f"r{rng.randrange(submitted)}")
            if removal is not None:
                finals.add(removal.job.handle)
                if removal.seq_id is not None:
                    backend.free(removal.seq_id)
        for emission in scheduler.postprocess(runner.run(scheduler.schedule())):
            assert not isinstance(emission.event, Failed), emission.event
            if emission.final:
                assert emission.job.handle not in finals, "exactly one final per job"
                finals.add(emission.job.handle)
        assert scheduler.ledger.reserved == backend.usage().used <= backend.limits.num_blocks
        assert scheduler.num_running <= backend.limits.max_batch_size
    while not scheduler.idle:
        for emission in scheduler.postprocess(runner.run(scheduler.schedule())):
            if emission.final:
                finals.add(emission.job.handle)
    assert len(finals) == submitted == 150
    assert backend.usage().used == 0 and scheduler.ledger.reserved == 0


def test_a_sequence_the_engine_loses_fails_alone():
    """decode_step raising SequenceFailed (an engine that runs each request on its own lost one):
    that job ends INTERNAL, the rest of the batch keeps decoding."""

    class Losing(FakeBackend):
        lose: int | None = None

        def decode_step(self):
            if self.lose is not None:
                lost, self.lose = self.lose, None
                self.free(lost)
                raise SequenceFailed([lost])
            return super().decode_step()

    backend = Losing()
    scheduler = DecodeScheduler(backend.limits)
    scheduler.add(decode_job("a", max_tokens=4))
    scheduler.add(decode_job("b", max_tokens=4))
    _drive(scheduler, backend)
    backend.lose = scheduler._seq_of["a"]
    (failed,) = _drive(scheduler, backend)
    assert failed.job.handle == "a" and failed.final and failed.event.error.code == "INTERNAL"
    emissions = _drive(scheduler, backend, steps=2)
    assert _finals(emissions) == ["b"] and scheduler.idle and backend.usage().used == 0


# ----------------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_fills_the_budget_and_decodes_between_chunks():
    backend = FakeBackend(num_blocks=256)
    config = SchedulerConfig(max_prefill_tokens=10, chunked_prefill=True)
    scheduler = ColocatedScheduler(backend.limits, config)
    scheduler.add(generate_job("short", prompt_len=2, max_tokens=20))
    _drive(scheduler, backend)  # "short" is decoding now
    scheduler.add(generate_job("long", prompt_len=25, max_tokens=3))
    scheduler.add(generate_job("next", prompt_len=8, max_tokens=3))
    backend.calls.clear()
    firsts: dict[str, int] = {}  # handle -> step of its first token
    for step in range(3):
        for emission in _drive(scheduler, backend):
            firsts.setdefault(emission.job.handle, step)
    # 10 + 10 + (5 of long, 5 of next); next's last 3 run in the fourth step
    assert backend.calls == ["chunk 10", "decode", "chunk 10", "decode", "chunk 5", "chunk 5", "decode"]
    assert firsts == {"short": 0, "long": 2}, "a prompt's first token comes with its last chunk"
    assert scheduler.num_prefilling == 1 and scheduler.queued_prompt_tokens == 3
    backend.calls.clear()
    emissions = _drive(scheduler, backend)
    assert backend.calls == ["chunk 3", "decode"] and "next" in [e.job.handle for e in emissions]


def test_unchunked_budget_takes_whole_prompts_at_least_one():
    backend = FakeBackend(num_blocks=256)
    scheduler = ColocatedScheduler(backend.limits, SchedulerConfig(max_prefill_tokens=10))
    scheduler.add(generate_job("long", prompt_len=25))
    scheduler.add(generate_job("x", prompt_len=4))
    _drive(scheduler, backend)
    assert backend.calls == ["chunk 25", "decode"], "whole prompt, over the budget, alone in its step"


def test_cancel_while_prefilling_gives_the_blocks_back():
    backend = FakeBackend(num_blocks=256)
    scheduler = ColocatedScheduler(
        backend.limits, SchedulerConfig(max_prefill_tokens=4, chunked_prefill=True)
    )
    scheduler.add(generate_job("a", prompt_len=12))
    _drive(scheduler, backend)
    assert scheduler.num_prefilling == 1 and backend.usage().used > 0
    removal = scheduler.remove("a")
    assert removal is not None and removal.job.handle == "a" and removal.seq_id is not None
    backend.free(removal.seq_id)
    assert scheduler.idle and scheduler.ledger.reserved == 0 == backend.usage().used
    assert _drive(scheduler, backend) == []


def test_prefill_role_chunks_one_prompt_at_a_time():
    backend = FakeBackend(num_blocks=256)
    scheduler = PrefillScheduler(backend.limits, SchedulerConfig(max_prefill_tokens=5, chunked_prefill=True))
    scheduler.add(prefill_job("a", prompt_len=12))
    scheduler.add(prefill_job("b", prompt_len=3))
    handed = _drive(scheduler, backend, steps=4)
    assert backend.calls == ["chunk 5", "chunk 5", "chunk 2", "chunk 3"], "FIFO: b waits for a's last chunk"
    assert _finals(handed) == ["a", "b"] and scheduler.held_leases == 2


def test_an_engine_without_chunking_gets_whole_prompts():
    backend = FakeBackend(num_blocks=256)
    limits = replace(backend.limits, chunked_prefill=False)
    scheduler = ColocatedScheduler(limits, SchedulerConfig(max_prefill_tokens=4, chunked_prefill=True))
    assert scheduler.config.chunked_prefill is False
    scheduler.add(generate_job("a", prompt_len=12))
    (chunk,) = scheduler.schedule().prefill
    assert chunk.tokens == 12


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_random_chunked_workload_keeps_exact_accounting(role):
    rng = random.Random(11)
    backend = FakeBackend(num_blocks=60, block_size=4, max_batch_size=4)
    config = SchedulerConfig(max_prefill_tokens=7, chunked_prefill=True)
    scheduler = create_scheduler(role, backend.limits, config)
    make = prefill_job if role == "prefill" else generate_job
    runner, finals, submitted = Runner(backend), set(), 0
    for _ in range(500):
        if submitted < 120 and rng.random() < 0.4:
            scheduler.add(
                make(f"r{submitted}", prompt_len=rng.randrange(1, 30), max_tokens=rng.randrange(2, 9))
            )
            submitted += 1
        if submitted and rng.random() < 0.1:
            removal = scheduler.remove(f"r{rng.randrange(submitted)}")
            if removal is not None and removal.job is not None:
                finals.add(removal.job.handle)
            if removal is not None and removal.seq_id is not None:
                backend.free(removal.seq_id)
            if removal is not None and removal.lease_id is not None:
                backend.free(scheduler.lease_released(removal.lease_id))
        for emission in scheduler.postprocess(runner.run(scheduler.schedule())):
            assert not isinstance(emission.event, Failed), emission.event
            if emission.final:
                assert emission.job.handle not in finals
                finals.add(emission.job.handle)
                lease = getattr(emission.event, "lease_id", None)
                if lease is not None:  # the importer acks at once
                    backend.free(scheduler.lease_released(lease))
        assert scheduler.ledger.reserved == backend.usage().used <= backend.limits.num_blocks
    while not scheduler.idle:
        for emission in scheduler.postprocess(runner.run(scheduler.schedule())):
            finals.add(emission.job.handle)
            lease = getattr(emission.event, "lease_id", None)
            if lease is not None:
                backend.free(scheduler.lease_released(lease))
    assert len(finals) == submitted == 120 and backend.usage().used == 0 == scheduler.ledger.reserved


def test_fused_steps_run_chunks_and_decode_in_one_call():
    """On an engine with fused steps, a chunked colocated step is one engine call: the chunks, then the
    decode rows of the sequences already decoding; a completed prompt decodes from the next step."""
    backend = FakeBackend(num_blocks=256, fused=True)
    config = SchedulerConfig(max_prefill_tokens=10, chunked_prefill=True)
    scheduler = ColocatedScheduler(backend.limits, config)
    scheduler.add(generate_job("short", prompt_len=2, max_tokens=6))
    scheduler.add(generate_job("long", prompt_len=14, max_tokens=3))
    first = _drive(scheduler, backend)
    assert backend.calls == ["step [2, 8] decode=True"]
    assert [(e.job.handle, e.final) for e in first] == [("short", False)], "short's first token only"
    _drive(scheduler, backend)
    assert backend.calls[-1] == "step [6] decode=True"
    emissions = _drive(scheduler, backend, steps=4)
    assert backend.calls[-1] == "decode" and sorted(_finals(emissions)) == ["long", "short"]
    assert scheduler.idle and backend.usage().used == 0


# ----------------------------------------------------------------------------------- local generate


def test_a_prefill_pool_with_local_generate_decodes_between_prompts():
    """The decode pool is gone: whole requests run in the prefill pool, one decode step over them per
    iteration beside the next prompt, while prefill jobs still export under their leases."""
    backend = FakeBackend(num_blocks=16, block_size=4)
    scheduler = PrefillScheduler(backend.limits, SchedulerConfig(local_generate=True))
    local = generate_job("g", prompt_len=4, max_tokens=3)
    scheduler.check(local)
    scheduler.add(local)
    scheduler.add(prefill_job("p", prompt_len=4))
    emitted = _drive(scheduler, backend, steps=3)
    tokens = [e.event.token_id for e in emitted if e.job.handle == "g"]
    assert tokens == [100, 101, 102] and _finals(emitted) == ["p", "g"]
    assert isinstance(next(e.event for e in emitted if e.job.handle == "p"), Prefilled)
    assert backend.calls == ["chunk 4", "chunk 4", "decode", "decode"]
    assert scheduler.held_leases == 1 and scheduler.ledger.reserved == 1, "only p's lease holds blocks"


def test_local_generate_needs_a_batch_slot_and_nothing_overtakes_it():
    backend = FakeBackend(num_blocks=16, block_size=4, max_batch_size=1)
    scheduler = PrefillScheduler(backend.limits, SchedulerConfig(local_generate=True))
    for job in (generate_job("a", max_tokens=2), generate_job("b", max_tokens=2), prefill_job("c")):
        scheduler.add(job)
    finals = _finals(_drive(scheduler, backend, steps=2))
    assert finals == ["a"], "b waits for a's slot, and c behind b"
    assert sorted(_finals(_drive(scheduler, backend, steps=2))) == ["b", "c"]
    assert backend.calls == ["chunk 4", "decode", "chunk 4", "chunk 4", "decode"], "c only after b"


def test_a_prefill_pool_without_local_generate_refuses_generate_jobs():
    scheduler = PrefillScheduler(FakeBackend().limits)
    with pytest.raises(ServingError) as refused:
        scheduler.check(generate_job("g"))
    assert refused.value.code == INVALID_ARG and "does not run generate jobs" in refused.value.message
    assert refused.value.reason is Reason.UNSUPPORTED  # the orchestrator's cue to skip the local rung


# ----------------------------------------------------------------------------------- conditional


def test_a_decode_pool_with_local_prefill_prefills_short_prompts_beside_its_batch():
    """Conditional disaggregation: a short prompt sent whole to the decode pool is prefilled there in
    its FIFO turn and decoded with the imported sequences, its blocks and slot accounted like theirs."""
    backend = FakeBackend(num_blocks=16, block_size=4)
    scheduler = DecodeScheduler(backend.limits, SchedulerConfig(local_prefill_tokens=8))
    local = generate_job("g", prompt_len=4, max_tokens=3)
    scheduler.check(local)
    scheduler.add(decode_job("d", max_tokens=3))
    scheduler.add(local)
    emitted = _drive(scheduler, backend, steps=3)
    assert [e.event.token_id for e in emitted if e.job.handle == "g"] == [100, 101, 102]
    assert sorted(_finals(emitted)) == ["d", "g"]
    assert backend.calls[:2] == ["import", "chunk 4"], "the import at the head first, then the prompt"
    assert scheduler.idle and backend.usage().used == 0


def test_a_decode_pool_refuses_prompts_longer_than_its_local_prefill_and_all_without_it():
    limited = DecodeScheduler(FakeBackend().limits, SchedulerConfig(local_prefill_tokens=8))
    with pytest.raises(ServingError) as refused:
        limited.check(generate_job("long", prompt_len=9))
    assert refused.value.code == INVALID_ARG and "at most 8 tokens" in refused.value.message
    with pytest.raises(ServingError) as off:
        DecodeScheduler(FakeBackend().limits).check(generate_job("g", prompt_len=4))
    assert off.value.code == INVALID_ARG and "does not run generate jobs" in off.value.message


def test_an_import_waits_behind_a_local_prompt_at_the_head():
    """One FIFO queue for both kinds: a generate job at the head that cannot get a slot yet is not
    overtaken by the import behind it."""
    backend = FakeBackend(num_blocks=16, block_size=4, max_batch_size=1)
    scheduler = DecodeScheduler(backend.limits, SchedulerConfig(local_prefill_tokens=8))
    for job in (
        decode_job("a", max_tokens=2),
        generate_job("g", max_tokens=2),
        decode_job("b", max_tokens=2),
    ):
        scheduler.add(job)
    assert _finals(_drive(scheduler, backend, steps=6)) == ["a", "g", "b"], "one slot, in FIFO order"
    assert backend.calls.index("chunk 4") < backend.calls.index("import", 1), "g prefilled before b"
