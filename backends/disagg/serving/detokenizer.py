"""Incremental detokenization and stop strings, for streamed text.

Streamed pieces concatenate to exactly the text of the whole output: a piece is emitted only once
the tokens decoded so far end on a complete character (byte-level BPE may split one character over
several tokens), and each token is decoded together with a few tokens before it so that leading
spaces and merges come out as in a full decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens already turned into emitted text

    def add(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return ""  # an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopStrings:
    """Finds the first stop string in streamed text; the output ends before it.

    Text that could still be the start of a stop string is held back until it cannot.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self._words = tuple(w for w in words if w)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text safe to emit now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self._words:
            return piece
        text = self._held + piece
        hits = [i for i in (text.find(w) for w in self._words) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        keep = max((_overlap(text, w) for w in self._words), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, word: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``word``."""
    for size in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-size:]):
            return size
    return 0
