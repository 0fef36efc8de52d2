"""Expectations derived from the engine's own tokens (imported by test files; not a conftest)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def stop_string(
    decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], start: int = 10
) -> tuple[str, int]:
    """A 3-character stop string taken from the text of ``token_ids`` at ``start`` or after, and how many
    tokens the engine generates until it appears: the first prefix whose text holds it.

    Only a place where that prefix's text ends on a whole character qualifies: a stop string completed
    by a token that also begins a multi-byte character shows only once the character is whole, one or
    more tokens later (the streamed text never splits a character), so the count would be ambiguous.
    """
    text = decode(token_ids)
    for at in range(start, len(text) - 3):
        stop = text[at : at + 3]
        if REPLACEMENT in stop or text.index(stop) != at:
            continue
        needed = next(n for n in range(1, len(token_ids) + 1) if stop in decode(token_ids[:n]))
        if not decode(token_ids[:needed]).endswith(REPLACEMENT):
            return stop, needed
    raise AssertionError("no unambiguous stop string in this output: pick another prompt")
