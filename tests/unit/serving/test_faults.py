"""Injected faults (disagg.pool.faults): the list read from the environment only with the test flag,
and the backend that strikes only the requests of a fault's seed."""

from __future__ import annotations

from typing import Any

import pytest
from unit.scheduling.scheduler_fakes import FakeBackend

from disagg.engine.backend import Imported
from disagg.engine.errors import SequenceFailed
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request, SequenceState
from disagg.kv.faulty import FaultConfig, FaultHooks
from disagg.kv.hooks import TransferHooks
from disagg.pool.faults import ENV_ALLOW, ENV_FAULTS, EngineFault, Fault, FaultError, FaultyBackend, parse
from disagg.pool.faults import from_environment as faults_from
from disagg.role import Role


def state(seed: int, max_tokens: int = 8) -> SequenceState:
    return SequenceState((1, 2, 3, 4), (100,), SamplingParams(max_tokens=max_tokens, seed=seed))


def test_a_list_of_faults_is_read_one_per_seed() -> None:
    faults = parse(
        " 11=drop_ack, 12=fail_copy,13=corrupt,14=delay:1.5,15=step_error,16=step_fatal,17=slow_prefill:2"
    )
    assert faults == {
        11: Fault(11, "drop_ack"),
        12: Fault(12, "fail_copy"),
        13: Fault(13, "corrupt"),
        14: Fault(14, "delay", 1.5),
        15: Fault(15, "step_error"),
        16: Fault(16, "step_fatal"),
        17: Fault(17, "slow_prefill", 2.0),
    }
    assert faults[11].kv == FaultConfig(drop_ack=True)
    assert faults[12].kv == FaultConfig(fail_after_run=0)
    assert faults[13].kv == FaultConfig(corrupt=True)
    assert faults[14].kv == FaultConfig(delay_s=1.5)
    assert faults[15].kv is None and faults[16].kv is None and faults[17].kv is None
    assert parse("") == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("x=drop_ack", "seed must be a positive integer"),
        ("0=drop_ack", "seed must be a positive integer"),
        ("-3=drop_ack", "seed must be a positive integer"),
        ("5=melt", "unknown fault 'melt'"),
        ("5=delay", "take seconds"),
        ("5=slow_prefill", "take seconds"),
        ("5=corrupt:2", "take seconds"),
        ("5=delay:soon", "could not convert"),
        ("5=delay:61", "delay_s must be in [0, 60]"),
        ("5=drop_ack,5=corrupt", "seed 5 has a fault already"),
    ],
)
def test_an_entry_that_cannot_be_read_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(FaultError, match=r"DISAGG_FAULTS entry") as caught:
        parse(text)
    assert says in str(caught.value)


def test_faults_need_the_test_flag() -> None:
    assert faults_from(Role.DECODE, {}) == {}
    with pytest.raises(FaultError, match="DISAGG_ALLOW_FAULTS=1 is not"):
        faults_from(Role.DECODE, {ENV_FAULTS: "5=corrupt"})
    with pytest.raises(FaultError):
        faults_from(Role.DECODE, {ENV_FAULTS: "5=corrupt", ENV_ALLOW: "yes"})
    assert faults_from(Role.DECODE, {ENV_FAULTS: "5=corrupt", ENV_ALLOW: "1"}) == {5: Fault(5, "corrupt")}
    # refused by a pool the faults do not strike too: the flag guards the server, not one pool
    with pytest.raises(FaultError):
        faults_from(Role.PREFILL, {ENV_FAULTS: "5=corrupt@decode"})


def test_a_fault_may_strike_the_pools_of_one_role_only() -> None:
    env = {ENV_FAULTS: "5=step_fatal@decode,6=step_error", ENV_ALLOW: "1"}
    assert faults_from(Role.DECODE, env) == {
        5: Fault(5, "step_fatal", 0.0, Role.DECODE),
        6: Fault(6, "step_error"),
    }
    assert faults_from(Role.COLOCATED, env) == {6: Fault(6, "step_error")}
    with pytest.raises(FaultError, match="role must be one of"):
        parse("5=corrupt@everywhere")


def test_a_fault_prints_as_its_entry_reads() -> None:
    """What a pool logs as it strikes (a live test cues on it) reads back to the same fault."""
    for entry in ("911=delay:3", "5=step_fatal@decode", "6=drop_ack", "9=slow_prefill:0.25"):
        (fault,) = parse(entry).values()
        assert str(fault) == entry
        assert parse(str(fault)) == {fault.seed: fault}


def test_step_error_loses_only_its_sequence_and_the_batch_carries_on() -> None:
    inner = FakeBackend()
    backend = FaultyBackend(inner, parse("7=step_error"))
    struck = backend.import_sequence(state(7), b"d", object()).seq_id
    clean = backend.import_sequence(state(0), b"d", object()).seq_id
    with pytest.raises(SequenceFailed) as caught:
        backend.decode_step()
    assert caught.value.seq_ids == [struck]
    assert struck not in inner.seqs and clean in inner.seqs  # the lost one freed, as the contract says
    outputs = backend.decode_step()
    assert [o.seq_id for o in outputs] == [clean]
    assert [o.seq_id for o in backend.decode_step()] == [clean]  # struck once only


def test_a_started_sequence_is_struck_only_once_it_joined_the_batch() -> None:
    inner = FakeBackend()
    backend = FaultyBackend(inner, parse("7=step_error"))
    seq_id = backend.start(Request((1, 2, 3, 4), SamplingParams(max_tokens=4, seed=7)), decode=True)
    assert backend.decode_step() == []  # still prefilling: nothing to strike
    assert backend.prefill_chunk(seq_id, 2) is None
    assert backend.decode_step() == []
    assert backend.prefill_chunk(seq_id, 2) is not None  # prefilled: it joins the batch
    with pytest.raises(SequenceFailed):
        backend.decode_step()
    # a prefill pool's sequence (held for export, never decoded here) is never struck
    held = backend.start(Request((1, 2), SamplingParams(max_tokens=4, seed=7)), decode=False)
    assert backend.prefill_chunk(held, 2) is not None
    assert backend.decode_step() == []


def test_a_fused_step_strikes_after_the_chunk_that_completed_its_prompt() -> None:
    inner = FakeBackend(fused=True)
    backend = FaultyBackend(inner, parse("7=step_error"))
    seq_id = backend.start(Request((1, 2, 3, 4), SamplingParams(max_tokens=4, seed=7)), decode=True)
    outputs, firsts = backend.step([(seq_id, 4)])
    assert outputs == [] and firsts[0] is not None
    with pytest.raises(SequenceFailed):
        backend.step([], decode=True)
    assert backend.step([], decode=False) == ([], [])


def test_step_fatal_breaks_the_step_and_a_freed_sequence_is_forgotten() -> None:
    inner = FakeBackend()
    backend = FaultyBackend(inner, parse("8=step_fatal"))
    finished = backend.import_sequence(state(8), b"d", object()).seq_id
    assert backend.free(finished)  # gone before any step (finished, or cancelled): nothing to strike
    assert backend.decode_step() == []
    backend.import_sequence(state(8), b"d", object())
    with pytest.raises(EngineFault, match="step_fatal"):
        backend.decode_step()


class Transport:
    def __init__(self) -> None:
        self.hooks: TransferHooks = TransferHooks()


class Recording(FakeBackend):
    """Records the transport's hooks as each import sees them; fails the imports it is told to."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.seen: list[TransferHooks] = []
        self.fail = fail

    def import_sequence(self, state: SequenceState, descriptor: bytes, transport: Any) -> Imported:
        self.seen.append(transport.hooks)
        if self.fail:
            raise RuntimeError("copy failed")
        return super().import_sequence(state, descriptor, transport)


@pytest.mark.parametrize("fail", [False, True])
def test_kv_faults_hook_only_their_own_import(fail: bool) -> None:
    inner, transport = Recording(fail), Transport()
    plain = transport.hooks
    backend = FaultyBackend(inner, parse("5=drop_ack,6=delay:0.5"), sleep=lambda s: None)
    for seed in (5, 6, 0):
        try:
            backend.import_sequence(state(seed), b"d", transport)
        except RuntimeError:
            assert fail
        assert transport.hooks is plain  # put back, whatever the import did
    dropped, delayed, clean = inner.seen
    assert isinstance(dropped, FaultHooks) and dropped.faults == FaultConfig(drop_ack=True)
    assert isinstance(delayed, FaultHooks) and delayed.faults == FaultConfig(delay_s=0.5)
    assert clean is plain


def test_slow_prefill_waits_before_each_prefill_call_of_its_sequence_only() -> None:
    slept: list[float] = []
    backend = FaultyBackend(FakeBackend(fused=True), parse("9=slow_prefill:0.5"), sleep=slept.append)
    slow = backend.start(Request((1, 2, 3, 4), SamplingParams(max_tokens=4, seed=9)), decode=False)
    clean = backend.start(Request((1, 2, 3, 4), SamplingParams(max_tokens=4)), decode=True)
    backend.prefill_chunk(clean, 4)
    assert slept == []
    backend.prefill_chunk(slow, 2)
    backend.step([(slow, 2)], decode=False)
    assert slept == [0.5, 0.5]
    backend.free(slow)
    backend.step([], decode=True)
    assert slept == [0.5, 0.5]
