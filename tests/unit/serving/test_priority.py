"""The sheddable priority of a request: parsed from the request parameter ``disagg_priority``, carried
from preprocessing to the orchestrator, and what admission by capacity refuses first."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from recorder import Recorder

from disagg.engine.params import SamplingParams
from disagg.protocol.errors import INVALID_ARG, UNAVAILABLE, ServingError
from disagg.protocol.messages import PoolLoad
from disagg.serving.orchestrator import Orchestrator, OrchestratorConfig
from disagg.serving.settings import AdmissionSettings
from disagg.serving.telemetry import SloConfig
from disagg.serving.text_api import TextRequest, parse_text_request
from disagg.triton import wire

VALUES = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32)}


@pytest.mark.parametrize(("given", "expected"), [(None, 0), (-5, -5), ("7", 7), ("-100", -100)])
def test_priority_is_parsed_from_its_request_parameter(given, expected):
    parameters = {} if given is None else {"disagg_priority": given}
    text = parse_text_request(VALUES, parameters)
    assert text.priority == expected
    assert wire.decode_text_request(wire.encode_text_request(text).encode()).priority == expected


@pytest.mark.parametrize("bad", [101, 1.5, "high", True])
def test_a_bad_priority_is_refused_by_name(bad):
    with pytest.raises(ServingError) as refused:
        parse_text_request(VALUES, {"disagg_priority": bad})
    assert refused.value.code == INVALID_ARG and "disagg_priority" in refused.value.message


class _NoPools:
    """Pools that must never be called: admission refuses before any of them."""

    def __getattr__(self, name):
        raise AssertionError(f"a refused request reached the pools ({name})")


def test_over_capacity_a_sheddable_request_is_refused_before_any_pool_is_called():
    config = OrchestratorConfig(
        admission=AdmissionSettings(margin=2.0, sheddable_margin=0.5), slo=SloConfig(ttft_s=1.0)
    )
    orchestrator = Orchestrator(config, _NoPools(), lambda ids: "", deployed=("prefill", "decode"))
    orchestrator.admission.observe("prefill", PoolLoad(0, 0, 0, 0, 10, 0, 0.0))
    orchestrator.admission.observe(
        "prefill", PoolLoad(2, 900, 0, 0, 10, 1000, 1.0)
    )  # 1 k tok/s, 0.9 s queued
    recorder = Recorder()
    text = TextRequest("x", SamplingParams(max_tokens=4), priority=-1)
    outcome = asyncio.run(orchestrator.serve([1] * 300, text, recorder))  # predicted 1.2 s > 0.5 s
    assert recorder.error.code == UNAVAILABLE and "over capacity" in recorder.error.message
    assert "retry after 1 s" in recorder.error.message and outcome.first_token_at is None


class _CountingRecorder(Recorder):
    checks = 0

    def is_cancelled(self) -> bool:
        self.checks += 1
        return super().is_cancelled()


def test_a_refusal_is_answered_without_a_cancellation_check_and_without_yielding_to_the_loop():
    """A burst's refusals are answered one after another as the requests arrive: a refusal neither
    asks whether its client left (on Triton a round trip through the stub's queue, behind every token
    relayed) nor waits for the event loop's next turn (it did, twice, behind every other request's
    work, while the request ran in a task of its own)."""
    config = OrchestratorConfig(admission=AdmissionSettings(margin=1.0), slo=SloConfig(ttft_s=1.0))
    orchestrator = Orchestrator(config, _NoPools(), lambda ids: "", deployed=("prefill", "decode"))
    orchestrator.admission.observe("prefill", PoolLoad(0, 0, 0, 0, 10, 0, 0.0))
    orchestrator.admission.observe("prefill", PoolLoad(2, 1500, 0, 0, 10, 1000, 1.0))  # 1.5 s queued
    recorder = _CountingRecorder()

    async def refused_within_one_turn() -> bool:
        others_ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(others_ran.set)  # runs at the loop's next turn
        await orchestrator.serve([1] * 300, TextRequest("x", SamplingParams(max_tokens=4)), recorder)
        return not others_ran.is_set()

    assert asyncio.run(refused_within_one_turn()), "the refusal waited for the event loop's next turn"
    assert recorder.error.code == UNAVAILABLE and "over capacity" in recorder.error.message
    assert recorder.checks == 0
