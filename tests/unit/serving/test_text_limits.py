"""Bounded parsing of list inputs: a request carrying megabytes of stop words (or bad words) is refused
from its tensor's shape and element sizes, before any word is decoded."""

from __future__ import annotations

import numpy as np
import pytest

from disagg.protocol.errors import INVALID_ARG, ServingError
from disagg.serving import text_api
from disagg.serving.text_api import MAX_STOP_WORD_BYTES, MAX_STOP_WORDS, parse_text_request

BASE = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32)}
MIB = 1 << 20


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The inputs `_text` decoded, by name."""
    names: list[str] = []
    real = text_api._text

    def counting(name, raw):
        names.append(name)
        return real(name, raw)

    monkeypatch.setattr(text_api, "_text", counting)
    return names


def _refused(values) -> str:
    with pytest.raises(ServingError) as refused:
        parse_text_request({**BASE, **values}, {})
    assert refused.value.code == INVALID_ARG
    return refused.value.message


@pytest.mark.parametrize("name", ["stop_words", "bad_words"])
def test_64_mib_of_words_are_refused_before_one_is_decoded(name: str, decoded: list[str]) -> None:
    many = np.array([[b"w" * 1024] * (64 * 1024)], dtype=object)  # 64 MiB in 65,536 words
    assert "holds more than" in _refused({name: many}) and name in _refused({name: many})
    one = np.array([[b"w" * (64 * MIB)]], dtype=object)  # 64 MiB in one word
    assert f"longer than {MAX_STOP_WORD_BYTES} bytes" in _refused({name: one})
    assert name not in decoded


def test_words_within_the_bounds_are_parsed() -> None:
    words = [b"x" * MAX_STOP_WORD_BYTES, "é" * (MAX_STOP_WORD_BYTES // 2), b""] + [b"s"] * (
        MAX_STOP_WORDS - 3
    )
    text = parse_text_request({**BASE, "stop_words": np.array([words], dtype=object)}, {})
    assert len(text.stop_words) == MAX_STOP_WORDS - 1  # the empty one dropped
    over = np.array([["é" * (MAX_STOP_WORD_BYTES // 2 + 1)]], dtype=object)  # 258 bytes in 129 chars
    assert "longer than" in _refused({"stop_words": over})
    assert "holds more than" in _refused(
        {"stop_words": np.array([[b"s"] * (MAX_STOP_WORDS + 1)], dtype=object)}
    )


def test_unimplemented_inputs_at_their_neutral_value_still_pass() -> None:
    neutral = {
        "beam_width": np.array([[1]], dtype=np.int32),
        "repetition_penalty": np.array([[1.0]], dtype=np.float32),
        "bad_words": np.array([[b""]], dtype=object),
    }
    assert parse_text_request({**BASE, **neutral}, {}).prompt == "hi"
    assert "not supported" in _refused({"beam_width": np.array([[2]], dtype=np.int32)})
    assert "not supported" in _refused({"bad_words": np.array([[b"no"]], dtype=object)})
