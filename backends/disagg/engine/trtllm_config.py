"""Settings of the TensorRT-LLM backend (``disagg.engine.trtllm``), validated at construction.

NOT VERIFIED against a real TensorRT-LLM, like the backend they configure. Torch-free and free of
``tensorrt_llm``: a config can be built and checked on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.config import build

__all__ = ["TRANSCEIVER_BACKENDS", "TrtllmConfig"]

TRANSCEIVER_BACKENDS = ("DEFAULT", "UCX", "NIXL", "MPI")


@dataclass(frozen=True)
class TrtllmConfig:
    """Settings of one TensorRT-LLM backend, validated at construction.

    ``model`` is what ``tensorrt_llm.LLM(model=...)`` takes (a Hugging Face checkpoint folder or a
    built engine dir). ``vocab_size`` / ``max_context`` / ``eos_token_ids`` default to its
    ``config.json`` (``generation_config.json``'s eos ids win). ``secret`` signs descriptors; unset,
    the transport passed to export/import supplies it (``transport.config.secret``).
    """

    model: Path
    max_batch_size: int = 64
    num_blocks: int = 1024
    tokens_per_block: int = 32
    max_context: int | None = None
    max_tokens_cap: int | None = None
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    model_id: str | None = None  # names the model in the descriptor fingerprint; default: folder name
    transceiver_backend: str = "DEFAULT"
    tensor_parallel_size: int = 1
    secret: bytes | None = field(default=None, repr=False)
    ttl_s: float = 30.0
    request_timeout_s: float = 60.0
    step_wait_s: float = 0.05

    def __post_init__(self) -> None:
        """Ranges; the types are ``config.build``'s (``from_dict``; a config built by hand in code is
        trusted to be typed; ``model`` may be given as text, ``eos_token_ids`` as a list)."""
        object.__setattr__(self, "model", Path(self.model))
        for name in ("max_batch_size", "num_blocks", "tokens_per_block", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.tokens_per_block < 2 or self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError("tokens_per_block must be a power of two > 1 (TensorRT-LLM's rule)")
        for name in ("max_context", "max_tokens_cap", "vocab_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive or unset")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.transceiver_backend not in TRANSCEIVER_BACKENDS:
            raise ValueError(f"transceiver_backend must be one of {list(TRANSCEIVER_BACKENDS)}")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("secret must be at least 16 bytes")
        for name in ("ttl_s", "request_timeout_s", "step_wait_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600]")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrtllmConfig:
        """Build from e.g. JSON parameters with :func:`disagg.config.build`: typed, unknown keys are
        errors (``ConfigError``, a ``ValueError``, naming them)."""
        return build(cls, data)
