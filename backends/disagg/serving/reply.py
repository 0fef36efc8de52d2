"""What the client of one request receives: text pieces, streamed or gathered into one final response,
the token counts each response carries, and exactly one final response or error.

The orchestrator's request (``disagg.serving.orchestrator``) hands each token here once it has
accounted for it (``Outcome.output_tokens``); this turns tokens into text (incremental detokenizing,
stop strings) and sends it through the request's ``Responder``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from disagg.engine.sequence import FINISH_LENGTH, FINISH_STOP
from disagg.protocol.errors import ServingError
from disagg.serving.detokenizer import IncrementalDetokenizer, StopStrings
from disagg.serving.text_api import TextRequest

if TYPE_CHECKING:
    from disagg.serving.orchestrator import Outcome, Responder


class Reply:
    def __init__(
        self,
        out: Responder,
        text: TextRequest,
        decode_text: Callable[[Sequence[int]], str],
        outcome: Outcome,
    ) -> None:
        self.out = out
        self.text = text
        self.outcome = outcome
        self.detok = IncrementalDetokenizer(decode_text)
        self.stops = StopStrings(text.stop_words)
        self.pieces: list[str] = []
        self.sent_tokens = 0  # output tokens accounted for in responses already sent
        self.finished = False  # its final response (or error) is sent

    def add(self, token_id: int) -> bool:
        """Stream (or keep) the text one more token completes; True when a stop string ended the output."""
        piece = self.stops.feed(self.detok.add(token_id))
        if piece:
            if self.text.stream:
                self.out.send(piece, final=False, tokens=self._unsent())
            else:
                self.pieces.append(piece)
        return self.stops.stopped

    def finish(self) -> None:
        """The final response: the text held back, the finish reason (``Outcome.finish_reason``)."""
        if self.finished:
            return
        self.finished = True
        tail = self.stops.feed(self.detok.flush()) + self.stops.flush()
        reason = self.outcome.finish_reason = self._finish_reason()
        if self.text.stream:
            if tail:
                self.out.send(tail, final=False, tokens=self._unsent())
            self.out.send("", final=True, tokens=self._unsent(), finish_reason=reason)
        else:
            body = "".join(self.pieces) + tail
            if not self.text.exclude_input_in_output:
                body = self.text.prompt + body
            self.out.send(body, final=True, tokens=self._unsent(), finish_reason=reason)

    def fail(self, error: ServingError) -> None:
        if self.finished:
            return
        self.finished = True
        self.outcome.error = error
        self.out.fail(error)

    def _unsent(self) -> int:
        """Output tokens not yet reported in a response; from now on they count as reported."""
        count = self.outcome.output_tokens - self.sent_tokens
        self.sent_tokens = self.outcome.output_tokens
        return count

    def _finish_reason(self) -> str:
        """Why the output ended: a stop string or what the engine said, else inferred from the count."""
        if self.stops.stopped:
            return FINISH_STOP
        if self.outcome.finish_reason in (FINISH_STOP, FINISH_LENGTH):
            return self.outcome.finish_reason
        return FINISH_LENGTH if self.outcome.output_tokens >= self.text.params.max_tokens else FINISH_STOP
