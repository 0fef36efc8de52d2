"""Errors the engine raises. The serving layer maps each to a Triton error code."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """A request or one of its parameters is invalid (maps to INVALID_ARG)."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint folder cannot be loaded: missing file, unsupported field, bad tensor."""


class OutOfBlocks(EngineError):
    """The KV block pool has too few free blocks for the request (maps to UNAVAILABLE)."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV cache full: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


class BatchFull(EngineError):
    """The decode batch holds ``max_batch_size`` sequences: a capacity limit, like ``OutOfBlocks``
    (the caller waits for a sequence to finish, or refuses with UNAVAILABLE), never bad input."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"decode batch is full ({limit} sequences)")
        self.limit = limit


class SequenceFailed(EngineError):
    """``decode_step`` could not advance the sequences ``seq_ids`` (an engine that runs each request
    on its own, e.g. TensorRT-LLM, lost their streams): they are freed, the other sequences' tokens of
    that step come with the next ``decode_step``. An engine fault that loses every sequence is any
    other exception."""

    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"the engine failed sequence(s) {seq_ids}")
        self.seq_ids = seq_ids


class UnknownSequence(EngineError, KeyError):
    """A sequence id that the engine does not hold (finished, aborted or never known)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"
