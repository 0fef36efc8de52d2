"""The model's chat template: found in its checkpoint folder, rendered with jinja2 the way Hugging Face
``transformers`` renders chat templates (``apply_chat_template(..., add_generation_prompt=True)``).

Where the template comes from, first found: an explicit file (``--chat-template``), the folder's
``chat_template.jinja``, the ``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of
named templates of which ``default`` is used). The template runs in jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` filter that keeps non-ASCII text, and
the globals templates rely on: ``raise_exception``, ``strftime_now``, and the special tokens of the
tokenizer config (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from disagg.openai.errors import bad_request
from disagg.openai.protocol import Message

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None

    @classmethod
    def find(cls, model_dir: Path, override: Path | None = None) -> ChatTemplate | None:
        """The template of the checkpoint in ``model_dir`` (or ``override``'s text), None when it has none.

        Raises ValueError for a tokenizer config or template that cannot be read or compiled.
        """
        config = _read_config(Path(model_dir) / "tokenizer_config.json")
        tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        if override is not None:
            return cls(Path(override).read_text(encoding="utf-8"), tokens)
        jinja_file = Path(model_dir) / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError("tokenizer_config.json has a chat_template that is not a string")
        return cls(source, tokens)

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt for ``messages``, ending with the assistant's turn opened. A template that refuses
        the conversation (``raise_exception``) or fails on it is a bad request (ApiError 400)."""
        try:
            return self._template.render(
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except TemplateError as exc:
            raise bad_request(f"the model's chat template refused the messages: {exc}", "messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise bad_request(
                f"the model's chat template failed on the messages: {exc}", "messages"
            ) from None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer_config.json cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("tokenizer_config.json is not a JSON object")
    return data


def _token_text(value: Any) -> str:
    """A special token as saved by transformers: its text, or an object holding it as ``content``."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return str(value)
