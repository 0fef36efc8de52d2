"""Core loans (disagg.engine.loan, kernels/team.c): a borrowed helper works only while the core is lent
and prompts wait, a reclaim waits once for the one part in flight, a paced lender lends nothing
while no prompt waits and stops lending when they are done, and the bits do not change."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from disagg.engine import fp32kernel, kernel, loan
from disagg.engine.loan import BUSY, LENT, WAITER, WANT, Borrower, Lender, LoanError
from disagg.scheduling.pacing import Pacing

PART = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
WAIT_S = 10.0  # bounds every wait on another thread; none is expected to come near it


def _core() -> int:
    return max(os.sched_getaffinity(0))


@pytest.fixture
def pair(tmp_path, monkeypatch) -> Iterator[tuple[Borrower, Lender, loan.Segment]]:
    """A borrower and a lender of one core in this process (segments under tmp_path), torch on one
    thread and the kernels on two (this one and the borrowed helper); all undone after."""
    if kernel.team() is None:
        pytest.skip("the kernels' thread team cannot be built here")
    monkeypatch.setattr(loan, "SHM", tmp_path)
    before = torch.get_num_threads()
    core = _core()
    borrower = Borrower("test", (core,))
    lender = Lender("test", (core,), "decode", Pacing(0.0))
    kernel.use_threads(2)
    torch.set_num_threads(1)
    try:
        yield borrower, lender, lender._segments[core]
    finally:
        kernel.use_threads(0)
        torch.set_num_threads(before)
        borrower.close()
        lender.close()


def _state(segment: loan.Segment) -> int:
    return segment.counters()[0]


def _until(check, what: str) -> None:
    """Wait (bounded) for another thread to reach a state it signals only through the segment."""
    done = threading.Event()
    for _ in range(100000):
        if check():
            return
        done.wait(0.0001)
    raise AssertionError(f"never saw {what}")


def test_the_segment_is_the_size_the_c_side_uses(pair) -> None:
    assert loan.library().loan_segment_bytes() == loan.SEGMENT_BYTES


def test_a_borrowed_helper_runs_on_the_lent_core_and_the_bits_do_not_change(pair) -> None:
    borrower, lender, segment = pair
    if fp32kernel.gemm() is None:
        pytest.skip("no fp32 kernel on this CPU")
    gemm = fp32kernel.gemm()
    generator = torch.Generator().manual_seed(3)
    weight = fp32kernel.pack(torch.randn(1536, 576, generator=generator))
    x = torch.randn(200, 576, generator=generator)
    alone = gemm(x, weight, None)  # not lent: the caller computes every part
    assert segment.counters()[2] == 0
    (tid,) = borrower.threads()
    assert os.sched_getaffinity(tid) == {_core()}
    borrower.step()  # prompts wait
    lender.idle()  # and the decode pool is idle: the core is lent
    assert _state(segment) & (LENT | WANT) == LENT | WANT
    for _ in range(200):
        assert torch.equal(gemm(x, weight, None), alone)
        if segment.counters()[2]:
            break
    assert segment.counters()[2] > 0, "the borrowed helper never took a part"
    (stats,) = borrower.stats()
    assert stats.borrowed_s > 0 and stats.lender == "decode" and stats.core == _core()
    lender.step()  # taken back: no part runs there any more
    parts = segment.counters()[2]
    for _ in range(20):
        assert torch.equal(gemm(x, weight, None), alone)
    assert segment.counters()[2] == parts


def test_no_part_is_borrowed_while_no_prompt_waits(pair) -> None:
    _, lender, segment = pair
    gemm = fp32kernel.gemm()
    if gemm is None:
        pytest.skip("no fp32 kernel on this CPU")
    weight = fp32kernel.pack(torch.randn(1536, 576))
    lender.idle()  # lent, but the borrower says no prompt waits
    for _ in range(50):
        gemm(torch.randn(64, 576), weight, None)
    assert _state(segment) & WANT == 0
    assert segment.counters()[2] == 0


def test_a_reclaim_waits_once_for_the_part_in_flight(pair) -> None:
    """The helper holds a part until told: the reclaim sleeps (WAITER) until then, and counts one wait.

    The process's own team helper (hired by this job, or by an earlier test: helpers stay) joins the
    job too and may claim a part first: three parts on three threads, and it holds its part until the
    borrowed helper is inside one, so that one is left for the borrowed helper."""
    borrower, lender, segment = pair
    team = loan.library()
    team.team_run.argtypes = [PART, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    team.team_run.restype = None
    helper_in, release = threading.Event(), threading.Event()
    (borrowed_tid,) = borrower.threads()

    def part(ctx, index, slot) -> None:
        if threading.get_native_id() == borrowed_tid:
            helper_in.set()
            release.wait(WAIT_S)
        else:  # the caller or an own helper: leave a part to the borrowed helper, wait for it to start
            helper_in.wait(WAIT_S)

    callback = PART(part)
    borrower.step()
    lender.idle()
    job = threading.Thread(target=team.team_run, args=(callback, None, 3, 3))
    job.start()
    assert helper_in.wait(WAIT_S), "the borrowed helper never joined the job"
    assert _state(segment) & BUSY
    reclaim = threading.Thread(target=lender.step)
    reclaim.start()
    _until(lambda: _state(segment) & WAITER, "the lender waiting for the part")
    assert reclaim.is_alive() and not _state(segment) & LENT
    release.set()
    reclaim.join(WAIT_S)
    job.join(WAIT_S)
    assert not reclaim.is_alive() and not job.is_alive()
    _, _, parts, waits, wait_s = segment.counters()
    assert (parts, waits) == (1, 1) and wait_s > 0
    assert _state(segment) & (BUSY | WAITER | LENT) == 0
    lender.step()  # nothing lent: nothing to wait for, no wait counted
    assert segment.counters()[3] == 1


def test_a_paced_lender_never_pauses_while_no_prompt_waits(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loan, "SHM", tmp_path)
    lender = Lender("test", (_core(),), "decode", Pacing(30.0))  # a budget it would spend if it lent
    try:
        lender.step()
        lender.stepped()  # returns at once: a pause here would take the 30 s budget
        (stats,) = lender.stats()
        assert stats.lent_s == 0.0
        assert not lender.wanted()
    finally:
        lender.close()


def test_a_paced_loan_ends_when_the_prompts_are_done(tmp_path, monkeypatch) -> None:
    """Lent for up to the budget after a step, the core comes back as soon as no prompt waits."""
    monkeypatch.setattr(loan, "SHM", tmp_path)
    borrower = Borrower("test", (_core(),))
    lender = Lender("test", (_core(),), "decode", Pacing(30.0))
    try:
        borrower.step()
        lender.step()
        pause = threading.Thread(target=lender.stepped)
        pause.start()
        segment = lender._segments[_core()]
        _until(lambda: _state(segment) & LENT, "the core lent after the step")
        borrower.idle()  # the last prompt is done
        pause.join(WAIT_S)
        assert not pause.is_alive(), "the loan outlived the prompts"
        assert not _state(segment) & LENT
        assert lender.stats()[0].lent_s > 0
    finally:
        borrower.close()
        lender.close()


def test_a_core_this_process_cannot_run_on_cannot_be_borrowed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loan, "SHM", tmp_path)
    missing = max(os.sched_getaffinity(0)) + 4096  # past any machine's cores
    with pytest.raises(LoanError, match=f"core {missing} cannot be borrowed"):
        Borrower("test", (missing,))
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_a_lender_takes_back_a_core_its_dead_borrower_left_busy(tmp_path, monkeypatch) -> None:
    """A borrower killed inside a part never ends it: the lender writes the part off."""
    monkeypatch.setattr(loan, "SHM", tmp_path)
    monkeypatch.setattr(loan, "RECLAIM_SLICE_S", 0.01)
    lender = Lender("test", (_core(),), "decode", Pacing(0.0))
    segment = lender._segments[_core()]
    try:
        lender.idle()
        view = ctypes.c_uint32.from_address(segment.address)
        view.value |= BUSY  # a helper inside a part ...
        ctypes.c_int32.from_address(segment.address + 60).value = 2**31 - 1  # ... of a process that is gone
        lender.step()
        assert _state(segment) & (BUSY | LENT) == 0
    finally:
        del view
        lender.close()


def test_a_side_whose_server_died_removes_the_segment_without_closing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loan, "SHM", tmp_path)
    lender = Lender("test", (_core(),), "decode", Pacing(0.0))
    try:
        lender.abandon()
        assert not list(tmp_path.iterdir())
    finally:
        lender.close()


def test_both_sides_remove_the_segment_when_they_close(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loan, "SHM", tmp_path)
    lender = Lender("test", (_core(),), "decode", Pacing(0.0))
    borrower = Borrower("test", (_core(),))
    assert [p.name for p in tmp_path.iterdir()] == [f"test-loan-core{_core()}"]
    borrower.close()
    lender.close()
    assert not list(tmp_path.iterdir())


def test_pacing_lends_what_the_budget_leaves() -> None:
    pacing = Pacing(0.030, min_lend_s=0.001)
    assert pacing.lend_s(0.010, 0.0005, prompts_waiting=True) == pytest.approx(0.0195)
    assert pacing.lend_s(0.010, 0.0005, prompts_waiting=False) == 0.0  # no pause for nothing
    assert pacing.lend_s(0.0295, 0.0, prompts_waiting=True) == 0.0  # below the smallest loan
    assert pacing.lend_s(0.040, 0.0, prompts_waiting=True) == 0.0  # the step alone spends it
    assert Pacing(0.0).lend_s(0.001, 0.0, prompts_waiting=True) == 0.0  # lends while idle only
    with pytest.raises(ValueError):
        Pacing(-1.0)


def test_pool_settings_of_loans_name_what_is_wrong(tiny_model_dir) -> None:
    from disagg.engine.engine import EngineConfig
    from disagg.pool.instance import PoolConfig

    def engine(*cores: int) -> EngineConfig:
        return EngineConfig(model_dir=tiny_model_dir, cores=cores)

    assert PoolConfig(role="prefill", engine=engine(0), borrow=(1,)).borrow == (1,)
    assert PoolConfig(role="decode", engine=engine(1), lend=(1,), lend_tpot_s=0.03).lend == (1,)
    with pytest.raises(ValueError, match="borrow: core 0 is this pool's own"):
        PoolConfig(role="prefill", engine=engine(0), borrow=(0,))
    with pytest.raises(ValueError, match="lend: core 0 is not this pool's"):
        PoolConfig(role="decode", engine=engine(1), lend=(0,))
    with pytest.raises(ValueError, match="borrow is a prefill pool's setting"):
        PoolConfig(role="decode", engine=engine(1), borrow=(0,))
    with pytest.raises(ValueError, match="lend and lend_tpot_s are a decode pool's settings"):
        PoolConfig(role="prefill", engine=engine(0), lend_tpot_s=0.03)


def test_a_borrowing_pool_reports_its_load_in_its_own_cores_time() -> None:
    """Admission and the autoscaler read a pool's speed from its busy seconds: the seconds its borrowed
    helper computed are added back, so borrowed throughput never counts as the pool's own."""
    from disagg.engine.loan import LoanStats
    from disagg.pool.loop import LoopStats

    borrowed = (LoanStats(1, "decode", 0.4, 10, 0.0, 0, 0.0),)
    fields = dict(queued=0, queued_prompt_tokens=0, active_sequences=0, held_leases=0, blocks_used=0)
    fields |= dict(blocks_free=1, healthy=True, engine_steps=3, engine_busy_s=1.0, loans=borrowed)
    assert LoopStats(role="prefill", **fields).load().busy_s == pytest.approx(1.4)
    assert LoopStats(role="decode", **fields).load().busy_s == pytest.approx(1.0)


def test_two_servers_on_one_machine_never_share_a_loan(monkeypatch) -> None:
    from disagg.loanpath import ENV_SERVER_HTTP, loan_scope
    from disagg.serverconfig import ENV_SERVER_HTTP as SERVER_HTTP

    assert SERVER_HTTP == ENV_SERVER_HTTP  # the launcher's name for it

    monkeypatch.delenv(ENV_SERVER_HTTP, raising=False)
    assert loan_scope("disagg") == "disagg-v1"
    monkeypatch.setenv(ENV_SERVER_HTTP, "127.0.0.1:8000")
    first = loan_scope("disagg")
    assert first != loan_scope("disagg", version=2)  # two versions side by side in a rollout
    monkeypatch.setenv(ENV_SERVER_HTTP, "127.0.0.1:8100")
    assert first != loan_scope("disagg") and "/" not in first


def test_the_launcher_sweeps_a_dead_servers_segments_and_only_its_own(tmp_path) -> None:
    from disagg.loanpath import loan_scope, segment_name, sweep

    mine = [segment_name(loan_scope("disagg", v, "127.0.0.1:8000"), 1) for v in (1, 2)]
    other = segment_name(loan_scope("disagg", 1, "127.0.0.1:8100"), 1)
    for name in (*mine, other, "disagg-1234-0123456789abcdef"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    assert sorted(sweep("disagg", "127.0.0.1:8000", tmp_path)) == sorted(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other, "disagg-1234-0123456789abcdef"])


def test_a_lender_that_cannot_open_its_segment_says_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loan, "SHM", tmp_path / "absent")  # no such folder: the segment cannot be made
    with pytest.raises(FileNotFoundError):
        Lender("test", (_core(),), "decode", Pacing(0.0))
