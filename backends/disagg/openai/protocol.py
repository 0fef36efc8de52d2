"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, validated into a ``Generation``.

What is accepted, besides ``model`` (required, the served model's id):

- both: ``max_tokens``, ``temperature`` (default 1, in [0, 2]; 0 is greedy), ``top_p`` (default 1, in
  (0, 1]), ``seed``, ``stop`` (a string or up to 4), ``n`` (1 only), ``stream``, ``stream_options``
  (``include_usage`` only, and only with ``stream``), ``user`` (accepted and not used: it labels the
  caller in OpenAI's own service), and vLLM's ``min_tokens`` (the fewest tokens before an end token may
  end the output), ``ignore_eos`` (true: the end token never ends the output, so it runs to
  ``max_tokens`` unless a stop string ends it; the same as ``min_tokens`` = ``max_tokens``) and
  ``priority`` (an integer in [-100, 100], 0 by default; negative is refused first when the server is
  over capacity);
- completions: ``prompt`` (a string, or a list holding one string; token ids are refused);
- chat: ``messages`` (roles system, developer, user, assistant; content a string or text parts) and
  ``max_completion_tokens`` (the newer name of ``max_tokens``).

Fields of the OpenAI API that this server does not implement (penalties, logprobs, tools, ...) are
accepted only at the value that turns them off (null, 0, false, ...); any other value, and any field
the API does not have, is refused with 400 naming it. Nothing is silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from disagg.openai.errors import bad_request

MAX_SEED = (1 << 64) - 1
MAX_PRIORITY = 100  # text_api.MAX_PRIORITY: llm refuses a priority beyond it
MAX_TOKENS = (1 << 31) - 1  # llm's max_tokens is INT32; the server refuses what exceeds its own cap
MAX_STOP = 4  # OpenAI's limit
MAX_STOP_BYTES = 256  # text_api.MAX_STOP_WORD_BYTES: refused here with the parameter's name
ROLES = ("system", "developer", "user", "assistant")

_COMMON = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options"}
    | {"user", "min_tokens", "ignore_eos", "priority"}
)
_COMPLETION = _COMMON | {"prompt"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}

# Unimplemented fields: the values that leave them off (None is always accepted).
_NEUTRAL_COMMON: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
}
_NEUTRAL_COMPLETION = {**_NEUTRAL_COMMON, "echo": (False,), "best_of": (1,), "suffix": (), "logprobs": ()}
_NEUTRAL_CHAT = {
    **_NEUTRAL_COMMON,
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
}


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template reads it."""
        data = {"role": self.role, "content": self.content}
        if self.name is not None:
            data["name"] = self.name
        return data


@dataclass(frozen=True)
class Generation:
    """One validated generation request. ``seed`` None: the client gave none (a fresh one is drawn)."""

    kind: Literal["completion", "chat"]
    model: str
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    priority: int = 0  # negative: sheddable (vLLM's field; llm's request parameter ``disagg_priority``)
    prompt: str = ""  # completions
    messages: tuple[Message, ...] = ()  # chat


def requested_model(body: Any) -> str:
    """The ``model`` field of a request body (checked first: an unknown model is a 404)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    return model


def parse_completion(body: Any, default_max_tokens: int) -> Generation:
    """Validate a ``/v1/completions`` body; raises ApiError(400) naming the first bad field."""
    model = requested_model(body)
    _check_fields(body, _COMPLETION, _NEUTRAL_COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise bad_request("'prompt' must be one string (a batch of prompts is not supported)", "prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' is required and must be a string (token ids are not accepted)", "prompt")
    if not prompt:
        raise bad_request("'prompt' is empty", "prompt")
    return Generation(kind="completion", model=model, prompt=prompt, **_sampling(body, default_max_tokens))


def parse_chat(body: Any, default_max_tokens: int) -> Generation:
    """Validate a ``/v1/chat/completions`` body; raises ApiError(400) naming the first bad field."""
    model = requested_model(body)
    _check_fields(body, _CHAT, _NEUTRAL_CHAT)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    messages = tuple(_message(item, f"messages[{i}]") for i, item in enumerate(raw))
    old, new = body.get("max_tokens"), body.get("max_completion_tokens")
    if old is not None and new is not None and old != new:
        raise bad_request(
            "'max_tokens' and 'max_completion_tokens' differ; send one", "max_completion_tokens"
        )
    fields = dict(body)
    if new is not None:
        fields["max_tokens"] = new
    sampling = _sampling(
        fields, default_max_tokens, max_name="max_completion_tokens" if new is not None else "max_tokens"
    )
    return Generation(kind="chat", model=model, messages=messages, **sampling)


def _check_fields(
    body: Mapping[str, Any], known: frozenset[str], neutral: Mapping[str, tuple[Any, ...]]
) -> None:
    for name in sorted(body):
        if name in known:
            continue
        if name not in neutral:
            raise bad_request(f"unknown parameter '{name}'", name, "unsupported_parameter")
        value = body[name]
        if value is not None and not any(_same(value, v) for v in neutral[name]):
            raise bad_request(
                f"parameter '{name}' is not supported by this server (only its default is accepted)",
                name,
                "unsupported_parameter",
            )


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind: 0 matches 0.0 but not False."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral and type(value) in (type(neutral), int, float)


def _sampling(
    body: Mapping[str, Any], default_max_tokens: int, max_name: str = "max_tokens"
) -> dict[str, Any]:
    max_tokens = _integer(body, "max_tokens", 1, MAX_TOKENS, default_max_tokens, shown=max_name)
    min_tokens = _integer(body, "min_tokens", 0, max_tokens, 0)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    if ignore_eos:
        min_tokens = max_tokens
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise bad_request(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    seed = _integer(body, "seed", 0, MAX_SEED, None)
    priority = _integer(body, "priority", -MAX_PRIORITY, MAX_PRIORITY, 0)
    if _integer(body, "n", 1, None, 1) != 1:
        raise bad_request("only n=1 is supported", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    return {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "priority": priority,
        "stop": _stop(body.get("stop")),
        "stream": bool(stream),
        "include_usage": _include_usage(body.get("stream_options"), bool(stream)),
    }


def _integer(
    body: Mapping[str, Any], name: str, low: int, high: int | None, default: Any, shown: str | None = None
) -> Any:
    value = body.get(name)
    shown = shown or name
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{shown}' must be an integer", shown)
    if value < low or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad_request(f"'{shown}' must be {bounds}, got {value}", shown)
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", name)
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    words = [value] if isinstance(value, str) else value
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(words) > MAX_STOP:
        raise bad_request(f"'stop' holds more than {MAX_STOP} sequences", "stop")
    if any(not w for w in words):
        raise bad_request("'stop' must not hold an empty string", "stop")
    if any(len(w.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES for w in words):
        raise bad_request(f"'stop' has a sequence longer than {MAX_STOP_BYTES} bytes", "stop")
    return tuple(words)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_request(f"unknown parameter 'stream_options.{unknown[0]}'", f"stream_options.{unknown[0]}")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    return bool(usage)


def _message(item: Any, where: str) -> Message:
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", where)
    for key in sorted(item):
        if key not in ("role", "content", "name") and item[key] is not None:
            raise bad_request(f"'{where}.{key}' is not supported by this server", f"{where}.{key}")
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'{where}.name' must be a string", f"{where}.name")
    return Message(role, _content(item.get("content"), f"{where}.content"), name)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{i}]' must be a text part (other content is not supported)", where)
        if set(part) - {"type", "text"}:
            raise bad_request(f"'{where}[{i}]' has fields other than type and text", where)
        texts.append(part["text"])
    return "".join(texts)
