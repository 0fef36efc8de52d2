"""The orchestrator's responder: a whole answer is exactly one response with tensors, an empty one
included (HTTP `generate` and the ensemble fail on a final response that carries flags alone); a stream's
last, empty piece is flags alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from disagg.triton.orchestrator_model import TritonResponder

FINAL = 1


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, int]] = []

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.sent.append((response, flags))


def _pb() -> Any:
    return SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        Tensor=lambda name, array: (name, array),
        InferenceResponse=lambda output_tensors: {name: array for name, array in output_tensors},
    )


def _responder(extras: frozenset[str] = frozenset()) -> tuple[TritonResponder, Sender]:
    sender = Sender()
    responder = TritonResponder(_pb(), sender, graveyard=None)
    responder.extra_outputs = extras
    return responder, sender


def test_an_empty_whole_answer_is_one_response_with_an_empty_text() -> None:
    responder, sender = _responder()
    responder.send("", final=True, tokens=0, finish_reason="stop")
    [(response, flags)] = sender.sent
    assert flags == FINAL
    assert response["text_output"].reshape(-1).tolist() == [b""]


def test_an_empty_answer_carries_its_finish_reason_when_asked() -> None:
    responder, sender = _responder(frozenset({"finish_reason", "num_output_tokens"}))
    responder.send("", final=True, tokens=0, finish_reason="stop")
    [(response, _)] = sender.sent
    assert response["finish_reason"].reshape(-1).tolist() == [b"stop"]
    assert np.asarray(response["num_output_tokens"]).reshape(-1).tolist() == [0]


def test_a_streams_empty_last_piece_is_flags_alone() -> None:
    responder, sender = _responder()
    responder.send("Hello", final=False, tokens=1)
    responder.send("", final=True, tokens=0, finish_reason="stop")
    (first, first_flags), (last, last_flags) = sender.sent
    assert first["text_output"].reshape(-1).tolist() == [b"Hello"] and first_flags == 0
    assert last is None and last_flags == FINAL
