"""Response bodies of the OpenAI API: unary completions and chat completions, their stream chunks, and
``usage``. Pure functions of what the request produced; ``Reply`` holds one request's identity."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from disagg.openai.protocol import Generation


@dataclass(frozen=True)
class Usage:
    """Tokens of one request: the prompt's and every one the engine generated (an end token included)."""

    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class Reply:
    """Shapes the bodies of one request's response (one id and creation time for all its chunks)."""

    generation: Generation
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.chat else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    @property
    def chat(self) -> bool:
        return self.generation.kind == "chat"

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def unary(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole response of a request with ``stream`` false."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**body, "choices": [choice], "usage": usage.body()}

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        """One stream chunk carrying ``text`` (and ``finish_reason`` on the last one). A chat stream's
        first chunk also names the role."""
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text}
            body = self._head("text_completion")
        choice.update(logprobs=None, finish_reason=finish_reason)
        body["choices"] = [choice]
        if self.generation.include_usage:
            body["usage"] = None  # every chunk but the last, as OpenAI sends them with include_usage
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The stream's last chunk with ``stream_options.include_usage``: no choice, the usage."""
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(object_), "choices": [], "usage": usage.body()}


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as JSON (or the literal ``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
