"""The one way to turn a plain mapping into a frozen config dataclass, typed by its annotations.

    config = build(PoolConfig, {"role": "prefill", "engine": {"model_dir": "/m"}})
    config = build(OrchestratorConfig, glue.model_parameters(args), strings=True)  # config.pbtxt

:func:`build` reads the dataclass's annotations (``typing.get_type_hints``) and converts each value to
its field's type, recursing into nested dataclasses. Unknown keys, missing required keys and wrongly
typed values are refused with a :class:`ConfigError` whose message starts with the key path
(``pools[0].role``, ``kv.block_size``). Range and consistency checks stay in each dataclass's own
``__post_init__``; a ``ValueError`` raised there comes out as a ``ConfigError`` prefixed with the path of
the dataclass (joined to the field's own path when the message starts with one: ``cores: ...``).
Values are never echoed in messages (a value may be a path or a secret).

Supported annotations: ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``Path``, ``Literal[...]``,
``Enum`` subclasses (by value), ``X | None``, ``tuple[X, ...]`` and fixed ``tuple[X, Y]``, nested
dataclasses, and ``Any`` (passed through unchecked). Strictness: ``bool`` is not an ``int``; an ``int``
is accepted for a ``float``; floats must be finite; a ``str`` must be non-empty unless the field's
default is ``""``.

``strings=True`` is for config.pbtxt parameters, where every value is a string: ``"1"``, ``"true"``,
``"yes"`` / ``"0"``, ``"false"``, ``"no"`` (any case) for ``bool``; numbers parsed; comma-separated lists
for tuples; ``""`` means ``None`` for an optional field, ``()`` for a tuple and "not given" (the default)
for any other field. Values that are not strings are checked as in the default mode.

A nested section's fields may also be given as dotted keys (``hot_prompts.group_rate``: how
config.pbtxt, a flat map, spells them). A dataclass that renamed a key declares ``RENAMED:
ClassVar[dict[str, str]]`` (old name -> new, which may be dotted): the old name still works for one
release, with a warning naming the new one (both at once are refused).

Torch-free on purpose: the autoscaler and the command line use it too.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = ["ConfigError", "build"]

T = TypeVar("T")

log = logging.getLogger(__name__)

TRUE_WORDS = ("1", "true", "yes")
FALSE_WORDS = ("0", "false", "no")


class ConfigError(ValueError):
    """Invalid configuration; the message starts with the offending key path."""


def build(cls: type[T], data: Mapping[str, Any], *, strings: bool = False, where: str = "") -> T:
    """Instantiate frozen dataclass ``cls`` from ``data``, validated; see the module docstring.

    ``where`` is the key path of ``data`` itself (prefixed to every message); ``strings`` parses
    config.pbtxt-style string values. Raises :class:`ConfigError`.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"build() needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(_at(where, "must be a mapping"))
    data = _renamed(cls, data, where)
    hints = typing.get_type_hints(cls)
    settable = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = _dotted(data, settable, hints, where)
    unknown = sorted(str(k) for k in data if k not in settable)
    if unknown:
        raise ConfigError(_at(where, f"unknown key(s) {', '.join(unknown)}"))
    kwargs: dict[str, Any] = {}
    for name, f in settable.items():
        key = f"{where}.{name}" if where else name
        hint = hints[name]
        present = name in data
        value = data.get(name)
        if present and strings and value == "" and not (_optional(hint) or _is_tuple(hint)):
            present = False  # an empty parameter is an unset one
        if present:
            if value == "" and f.default == "":
                kwargs[name] = ""
            else:
                kwargs[name] = _convert(value, hint, key, strings)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:  # the dataclass's own range checks
        raise ConfigError(_within(where, str(exc), settable)) from exc


def _renamed(cls: type, data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """``data`` with the keys ``cls`` renamed (its ``RENAMED``) under their new names, each old one
    warned about; ConfigError when a key is given under both names."""
    renamed = getattr(cls, "RENAMED", None) or {}
    old = [k for k in renamed if k in data]
    if not old:
        return data
    out = dict(data)
    for key in old:
        new = renamed[key]
        if new in data:
            raise ConfigError(_at(where, f"{key} and {new} are one key (renamed {new}): give {new} only"))
        path = f"{where}.{key}" if where else key
        log.warning("%s is deprecated and goes in the next release: it is now %s", path, new)
        out[new] = out.pop(key)
    return out


def _dotted(
    data: Mapping[str, Any], settable: Mapping[str, Any], hints: Mapping[str, Any], where: str
) -> Mapping[str, Any]:
    """``data`` with each dotted key (``hot_prompts.group_rate``, as config.pbtxt spells a nested
    section's field) moved into its section's mapping; a section given both whole and by dotted keys,
    or a dotted key under a field that is not a section, is refused."""
    dotted = [k for k in data if isinstance(k, str) and "." in k]
    if not dotted:
        return data
    out = {k: v for k, v in data.items() if k not in dotted}
    for key in dotted:
        head, rest = key.split(".", 1)
        hint = hints.get(head) if head in settable else None
        if hint is None or not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise ConfigError(_at(where, f"unknown key(s) {key}"))
        section = out.setdefault(head, {})
        if not isinstance(section, dict) or head in data:
            raise ConfigError(_at(where, f"{head} is given whole and by its keys ({key}): give one"))
        section[rest] = data[key]
    return out


def _at(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message


def _within(where: str, message: str, names: Mapping[str, Any]) -> str:
    """A dataclass check's message at ``where``; one that starts with the path of its own field
    (``"cores: ..."``, ``"decode.cores: ..."``) has that path joined to ``where``."""
    head, sep, rest = message.partition(": ")
    if sep and where and head.split(".")[0].split("[")[0] in names:
        return f"{where}.{head}: {rest}"
    return _at(where, message)


def _optional(hint: Any) -> bool:
    return _is_union(hint) and type(None) in typing.get_args(hint)


def _is_union(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    return origin is typing.Union or origin is types.UnionType


def _is_tuple(hint: Any) -> bool:
    return hint is tuple or typing.get_origin(hint) is tuple


def _convert(value: Any, hint: Any, key: str, strings: bool) -> Any:
    """``value`` as type ``hint`` or a ConfigError naming ``key``."""
    text = strings and isinstance(value, str)
    if hint is Any:
        return value
    if _is_union(hint):
        args = typing.get_args(hint)
        if type(None) in args and (value is None or (text and value == "")):
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], key, strings)
        for option in options:  # the first that fits, in annotation order
            try:
                return _convert(value, option, key, strings)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: must be {' or '.join(_describe(o) for o in options)}")
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        for choice in choices:
            if (text and value == str(choice)) or (type(value) is type(choice) and value == choice):
                return choice
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}")
    if _is_tuple(hint):
        return _convert_tuple(value, hint, key, strings)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if value is member or (text and value == str(member.value)):
                return member
            if (
                not isinstance(value, enum.Enum)
                and type(value) is type(member.value)
                and value == member.value
            ):
                return member
        raise ConfigError(f"{key}: must be one of {', '.join(str(m.value) for m in hint)}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        return build(hint, value, strings=strings, where=key)
    if hint is bool:
        if text:
            word = value.strip().lower()
            if word in TRUE_WORDS or word in FALSE_WORDS:
                return word in TRUE_WORDS
            raise ConfigError(f"{key}: must be one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: must be true or false")
        return value
    if hint is int:
        if text:
            try:
                return int(value.strip())
            except ValueError:
                raise ConfigError(f"{key}: must be an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer")
        return value
    if hint is float:
        if text:
            try:
                value = float(value.strip())
            except ValueError:
                raise ConfigError(f"{key}: must be a finite number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: must be a non-empty string")
        return value
    if hint is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ConfigError(f"{key}: must be bytes")
        return bytes(value)
    if hint is Path:
        if isinstance(value, os.PathLike) or (isinstance(value, str) and value):
            return Path(value)
        raise ConfigError(f"{key}: must be a non-empty path")
    raise TypeError(f"{key}: annotation {hint!r} is not supported by disagg.config")  # a bug, not input


def _convert_tuple(value: Any, hint: Any, key: str, strings: bool) -> tuple[Any, ...]:
    if strings and isinstance(value, str):
        items: list[Any] = [v.strip() for v in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{key}: must be a list")
    args = typing.get_args(hint)
    if not args:
        kinds: list[Any] = [Any] * len(items)
    elif len(args) == 2 and args[1] is Ellipsis:
        kinds = [args[0]] * len(items)
    else:
        if len(items) != len(args):
            raise ConfigError(f"{key}: must have {len(args)} items")
        kinds = list(args)
    return tuple(
        _convert(v, k, f"{key}[{i}]", strings) for i, (v, k) in enumerate(zip(items, kinds, strict=True))
    )


def _describe(hint: Any) -> str:
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if _is_tuple(hint):
        return "a list"
    return getattr(hint, "__name__", str(hint))
