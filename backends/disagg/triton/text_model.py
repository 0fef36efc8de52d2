"""Adapters of the ensemble's text steps: ``preprocessing`` (validate, tokenize) and
``postprocessing`` (format). Detokenization happens in the orchestrator, which holds each request's
state across its streamed pieces; postprocessing only passes each piece on as ``text_output``."""

from __future__ import annotations

from typing import Any

import numpy as np

from disagg.engine.tokenizer import Tokenizer
from disagg.paths import resolve_model_dir
from disagg.protocol.errors import INVALID_ARG, classify, invalid
from disagg.serving.text_api import INPUT_NAMES, OUTPUT_NAME, TextRequest, parse_text_request
from disagg.triton import glue, wire
from disagg.triton.metrics import Families


class PreprocessingModel:
    def __init__(self, args: dict[str, Any], pb_utils: Any) -> None:
        self._pb = pb_utils
        params = glue.model_parameters(args)
        self.tokenizer = Tokenizer(resolve_model_dir(params.get("model_dir") or None))
        # Requests refused here never reach an orchestrator: count them under this model's name.
        self._families = Families(pb_utils)
        self._refused = self._families.metric(
            "disagg_requests_total", {"model": args["model_name"], "path": "none", "outcome": "invalid_arg"}
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        """A dynamic batch: each request parsed, the valid prompts tokenized together, one response each
        (an error for a request that is invalid alone; the others are unaffected)."""
        parsed = [self._parse(r) for r in requests]
        texts = [p.prompt for p in parsed if isinstance(p, TextRequest)]
        try:
            encoded = iter(self.tokenizer.encode_many(texts) if texts else [])
        except Exception:  # the tokenizer failed on one of them: each alone, so only that one fails
            return [self._respond_alone(p) if isinstance(p, TextRequest) else p for p in parsed]
        return [self._respond(p, next(encoded)) if isinstance(p, TextRequest) else p for p in parsed]

    def _respond_alone(self, text: TextRequest) -> Any:
        try:
            ids = self.tokenizer.encode(text.prompt)
        except Exception as exc:
            return self._error(exc)
        return self._respond(text, ids)

    def _parse(self, request: Any) -> Any:
        """The request's ``TextRequest``, or the error response to send it."""
        try:
            return parse_text_request(
                glue.input_arrays(self._pb, request, INPUT_NAMES), glue.request_parameters(request)
            )
        except Exception as exc:
            return self._error(exc)

    def _respond(self, text: TextRequest, ids: list[int]) -> Any:
        pb = self._pb
        if not ids:
            return self._error(invalid("input 'text_input' encodes to 0 tokens"))
        return pb.InferenceResponse(
            output_tensors=[
                pb.Tensor("input_ids", np.asarray([ids], dtype=np.int32)),
                glue.bytes_tensor(pb, "request", wire.encode_text_request(text), shape=(1, 1)),
            ]
        )

    def _error(self, exc: Exception) -> Any:
        error = classify(exc)
        if error.code == INVALID_ARG:
            self._refused.increment(1)
        return self._pb.InferenceResponse(error=glue.triton_error(self._pb, error))

    def finalize(self) -> None:
        pass


class PostprocessingModel:
    def __init__(self, args: dict[str, Any], pb_utils: Any) -> None:
        self._pb = pb_utils

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self._pb
        out = []
        for request in requests:
            piece = pb.get_input_tensor_by_name(request, "text_piece").as_numpy()
            out.append(
                pb.InferenceResponse(output_tensors=[pb.Tensor(OUTPUT_NAME, piece.astype(np.object_))])
            )
        return out

    def finalize(self) -> None:
        pass
