"""A recording Responder for orchestrator tests (imported by test files; not a conftest)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.protocol.errors import ServingError


@dataclass
class Recorder:
    """A Responder that records what the client would see; can cancel after N pieces."""

    cancel_after: int | None = None
    pieces: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per piece: tokens generated since the previous
    finish_reason: str | None = None  # of the final piece
    finals: int = 0
    error: ServingError | None = None

    def send(self, text: str, final: bool, tokens: int = 0, finish_reason: str | None = None) -> None:
        self.pieces.append(text)
        self.tokens.append(tokens)
        if final:
            self.finish_reason = finish_reason
        self.finals += final

    def fail(self, error: ServingError) -> None:
        self.error = error
        self.finals += 1

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.pieces) >= self.cancel_after

    @property
    def text(self) -> str:
        return "".join(self.pieces)
