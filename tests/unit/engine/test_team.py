"""The kernels' thread team (kernels/team.c): a call split over helpers gives the bits one thread
gives, callers at once and a forked child are served, and an engine step hands torch's threads to
the kernels and back."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable

import pytest
import torch

from disagg.engine import fp32kernel, kernel
from disagg.engine.device import auto_dtype, kernel_threads
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request

Projection = tuple[Callable[..., torch.Tensor], object, torch.Tensor]


def _projection(seed: int, rows: int = 40) -> Projection:
    """A projection big enough to be split, on whichever kernel this CPU has: (gemm, weight, x)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(3000, 576, generator=generator)
    x = torch.randn(rows, 576, generator=generator)
    if kernel.gemm() is not None:
        return kernel.gemm(), kernel.pack(weight.bfloat16()), x.bfloat16()
    if fp32kernel.gemm() is not None:
        return fp32kernel.gemm(), fp32kernel.pack(weight), x
    pytest.skip("no native kernel on this CPU")


@pytest.fixture
def team_threads():
    """Set the kernels' thread count for one test; torch's pool and the kernels' own count restored."""
    before = torch.get_num_threads()
    yield kernel.use_threads
    kernel.use_threads(0)
    torch.set_num_threads(before)


def test_a_call_split_over_helpers_gives_the_bits_of_one_thread(team_threads) -> None:
    gemm, weight, x = _projection(1)
    team_threads(1)
    alone = gemm(x, weight, None)
    for count in (2, 3, 8):  # more threads than cores too: late helpers leave their parts to others
        team_threads(count)
        for _ in range(20):
            assert torch.equal(gemm(x, weight, None), alone)
    assert kernel.team_helpers() >= 1  # the calls were split: helpers were started


def test_callers_at_once_each_get_their_own_result(team_threads) -> None:
    """ctypes drops the GIL in a call: a second caller runs its job alone while the first holds the team."""
    team_threads(2)
    cases = [_projection(seed) for seed in range(4)]
    expected = [gemm(x, weight, None) for gemm, weight, x in cases]
    wrong: list[int] = []

    def call(index: int) -> None:
        gemm, weight, x = cases[index]
        for _ in range(25):
            if not torch.equal(gemm(x, weight, None), expected[index]):
                wrong.append(index)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(len(cases))]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert wrong == []


def _child(gemm_case: Projection, expected: torch.Tensor, answer) -> None:
    torch.set_num_threads(1)  # the child touches no OpenMP pool (the parent's is not fork-safe)
    kernel.use_threads(2)
    gemm, weight, x = gemm_case
    answer.send((torch.equal(gemm(x, weight, None), expected), kernel.team_helpers()))


def test_a_forked_child_starts_helpers_of_its_own(team_threads) -> None:
    team_threads(2)
    case = _projection(5)
    gemm, weight, x = case
    expected = gemm(x, weight, None)
    assert kernel.team_helpers() >= 1
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(case, expected, send))
    child.start()
    try:
        assert receive.poll(60), "the child did not answer"
        same, helpers = receive.recv()
    finally:
        child.join(30)
    assert child.exitcode == 0
    assert same
    assert helpers >= 1  # its own, started after the fork (the parent's were not copied)


def test_kernel_threads_hands_torchs_threads_to_the_kernels_and_back(team_threads) -> None:
    torch.set_num_threads(2)
    with kernel_threads():
        assert torch.get_num_threads() == 1
        assert kernel.team_threads() == 2
    assert torch.get_num_threads() == 2
    assert kernel.team_threads() == 2  # following torch's pool again
    torch.set_num_threads(3)
    assert kernel.team_threads() == 3
    with pytest.raises(RuntimeError), kernel_threads():
        raise RuntimeError("a fault in a step")
    assert torch.get_num_threads() == 3
    team_threads(4)  # a count set for the kernels stays theirs, inside and after
    with kernel_threads():
        assert (torch.get_num_threads(), kernel.team_threads()) == (1, 4)
    assert (torch.get_num_threads(), kernel.team_threads()) == (3, 4)


def test_a_negative_thread_count_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0"):
        kernel.use_threads(-1)


def test_an_engine_step_runs_torch_on_one_thread_and_gives_it_back(
    make_engine, team_threads, monkeypatch
) -> None:
    engine = make_engine("mistral", dtype=auto_dtype("cpu"))  # head_dim 32: the attention kernel takes it
    if not engine.native_step(engine.describe()):
        pytest.skip("this CPU's engine computes its steps with torch")
    seen: list[tuple[int, int]] = []
    forward = engine.model.step

    def spy(*args: object) -> object:
        seen.append((torch.get_num_threads(), kernel.team_threads()))
        return forward(*args)

    monkeypatch.setattr(engine.model, "step", spy)
    torch.set_num_threads(2)
    engine.prefill([Request((1, 5, 9, 12, 7), SamplingParams(max_tokens=4))])
    engine.decode_step()
    assert seen == [(1, 2), (1, 2)]  # the prompt's step and the decode step
    assert torch.get_num_threads() == 2
