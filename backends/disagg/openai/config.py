"""The one validated configuration of an OpenAI front end (from ``disagg openai``'s command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 9000
ENV_PORT = "OPENAI_PORT"


@dataclass(frozen=True)
class FrontendConfig:
    """``triton_url``: Triton's gRPC ``host:port``; ``model_id``: the name clients send as ``model``
    (the checkpoint folder's name); ``model_dir``: where the chat template is read; ``chat_template``:
    a template file used instead of the model's own; ``default_max_tokens``: when a request names none;
    ``drain_s``: on shutdown, how long requests in flight may go on before they are cancelled;
    ``api_key``: the key every ``/v1/*`` request must bear (``disagg.openai.auth``), None: open."""

    triton_url: str
    model_id: str
    model_dir: Path
    chat_template: Path | None = None
    default_max_tokens: int = 256
    drain_s: float = 5.0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Values and ranges; the types are trusted (``disagg openai``'s command line, typed by its
        parser, builds it in code)."""
        host, _, port = self.triton_url.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"triton_url must be host:port, got {self.triton_url!r}")
        if not self.model_id or "/" in self.model_id:
            raise ValueError("model_id must be a non-empty name without '/'")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError("chat_template must name an existing file")
        if not 1 <= self.default_max_tokens < (1 << 31):
            raise ValueError("default_max_tokens must be >= 1 (below 2**31)")
        if not 0 <= self.drain_s <= 3600:
            raise ValueError("drain_s must be in [0, 3600]")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty, or None")


def parse_port(text: str | None, default: int = DEFAULT_PORT) -> int:
    """A port number from a flag or ``OPENAI_PORT`` (0: the front end is off); None or "" gives
    ``default``. Raises ValueError naming the variable."""
    if text is None or text == "":
        return default
    try:
        port = int(text, 10)
    except ValueError:
        raise ValueError(f"{ENV_PORT} / --openai-port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_PORT} / --openai-port must be in 0..65535 (0: off), got {port}")
    return port
