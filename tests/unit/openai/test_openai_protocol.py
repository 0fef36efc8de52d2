"""Validation of OpenAI request bodies (disagg.openai.protocol): what is accepted, and every refusal
naming its parameter with status 400."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.openai.errors import ApiError
from disagg.openai.protocol import MAX_SEED, Message, parse_chat, parse_completion, requested_model

MODEL = "tiny"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def refused(parse: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, 16)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    return info.value


def test_completion_defaults_follow_openai() -> None:
    gen = parse_completion(completion(), 16)
    assert (gen.kind, gen.model, gen.prompt) == ("completion", MODEL, "Hello")
    assert (gen.max_tokens, gen.min_tokens, gen.temperature, gen.top_p) == (16, 0, 1.0, 1.0)
    assert (gen.seed, gen.stop, gen.stream, gen.include_usage) == (None, (), False, False)


def test_completion_takes_every_implemented_parameter() -> None:
    body = completion(
        prompt=["one prompt"],
        max_tokens=7,
        min_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=MAX_SEED,
        stop="\n",
        n=1,
        stream=True,
        stream_options={"include_usage": True},
        user="someone",
    )
    gen = parse_completion(body, 16)
    assert gen.prompt == "one prompt"
    assert (gen.max_tokens, gen.min_tokens, gen.temperature, gen.top_p, gen.seed) == (
        7,
        7,
        0.0,
        0.5,
        MAX_SEED,
    )
    assert (gen.stop, gen.stream, gen.include_usage) == (("\n",), True, True)


def test_ignore_eos_runs_the_output_to_max_tokens() -> None:
    assert parse_completion(completion(max_tokens=9, ignore_eos=True), 16).min_tokens == 9
    assert parse_chat(chat(max_completion_tokens=5, ignore_eos=True), 16).min_tokens == 5
    assert parse_completion(completion(max_tokens=9, min_tokens=2, ignore_eos=False), 16).min_tokens == 2
    assert parse_completion(completion(ignore_eos=None), 16).min_tokens == 0


def test_chat_messages_and_max_completion_tokens() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello", "name": "bot"},
        ],
        max_completion_tokens=9,
        stop=["a", "b"],
    )
    gen = parse_chat(body, 16)
    assert gen.messages == (
        Message("system", "Be brief."),
        Message("user", "Hi there"),
        Message("assistant", "Hello", "bot"),
    )
    assert gen.max_tokens == 9 and gen.stop == ("a", "b")
    assert parse_chat(chat(max_tokens=5, max_completion_tokens=5), 16).max_tokens == 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("logprobs", None),
        ("echo", False),
        ("best_of", 1),
    ],
)
def test_unimplemented_fields_pass_only_at_their_neutral_value(field: str, value: Any) -> None:
    assert parse_completion(completion(**{field: value}), 16).prompt == "Hello"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("logprobs", 2),
        ("echo", True),
        ("best_of", 2),
        ("suffix", "x"),
        ("logit_bias", {"1": 5}),
    ],
)
def test_completion_refuses_unimplemented_values_by_name(field: str, value: Any) -> None:
    error = refused(parse_completion, completion(**{field: value}))
    assert error.param == field and field in error.message and error.code == "unsupported_parameter"


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", True), ("top_logprobs", 3), ("tools", [{"type": "function"}]), ("tool_choice", "auto")],
)
def test_chat_refuses_unimplemented_values_by_name(field: str, value: Any) -> None:
    assert refused(parse_chat, chat(**{field: value})).param == field
    assert parse_chat(chat(**{field: None}), 16).kind == "chat"


def test_priority_is_carried_and_zero_by_default() -> None:
    assert parse_completion(completion(priority=-3), 16).priority == -3
    assert parse_chat(chat(), 16).priority == 0


def test_unknown_fields_are_refused_by_name() -> None:
    error = refused(parse_completion, completion(top_k=5))
    assert error.param == "top_k" and "unknown parameter 'top_k'" in error.message
    assert refused(parse_chat, chat(prompt="x")).param == "prompt"  # a completions field
    assert refused(parse_completion, completion(messages=[])).param == "messages"  # a chat field


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1 << 31}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens of 16
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"n": 2}, "n"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"priority": 101}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": None}, "prompt"),
    ],
)
def test_bad_values_are_refused_naming_the_parameter(fields: dict[str, Any], param: str) -> None:
    assert refused(parse_completion, completion(**fields)).param == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []}],
            "messages[1].tool_calls",
        ),
        ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
    ],
)
def test_bad_messages_are_refused_naming_the_field(messages: Any, param: str) -> None:
    assert refused(parse_chat, chat(messages=messages)).param == param


def test_max_tokens_and_max_completion_tokens_must_agree() -> None:
    assert refused(parse_chat, chat(max_tokens=4, max_completion_tokens=5)).param == "max_completion_tokens"
    assert refused(parse_chat, chat(max_completion_tokens=0)).param == "max_completion_tokens"


def test_model_is_required() -> None:
    with pytest.raises(ApiError) as info:
        requested_model({"prompt": "x"})
    assert info.value.param == "model"
    with pytest.raises(ApiError):
        requested_model(["not", "an", "object"])
    assert requested_model(completion()) == MODEL
