"""The checkpoint's tokenizer (``tokenizer.json``), used exactly as written: its post-processor
decides about BOS; nothing is added by hand."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from disagg.engine.errors import CheckpointError


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise CheckpointError("checkpoint folder has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, in one call: the library encodes them on its own threads, without
        the per-text offsets ``encode`` computes. A batch of 64 300-token prompts took 17 ms on two
        cores (34 ms on one) against 50-56 ms one by one (``preprocessing``'s dynamic batches)."""
        return [encoding.ids for encoding in self._tok.encode_batch_fast(texts)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
