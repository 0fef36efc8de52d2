"""Adapters of the ensemble's text steps: ``preprocessing`` (validate, tokenize) and
``postprocessing`` (format). Detokenization happens in the orchestrator, which holds each request's
state across its streamed pieces; postprocessing only passes each piece on as ``text_output``."""

from __future__ import annotations

from typing import Any

import numpy as np

from disagg.engine.tokenizer import Tokenizer
from disagg.paths import resolve_model_dir
from disagg.protocol.errors import INVALID_ARG, classify, invalid
from disagg.serving.text_api import INPUT_NAMES, OUTPUT_NAME, parse_text_request
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
        return [self._one(r) for r in requests]

    def _one(self, request: Any) -> Any:
        pb = self._pb
        try:
            values = glue.input_arrays(pb, request, INPUT_NAMES)
            text = parse_text_request(values, glue.request_parameters(request))
            ids = self.tokenizer.encode(text.prompt)
            if not ids:
                raise invalid("input 'text_input' encodes to 0 tokens")
        except Exception as exc:
            error = classify(exc)
            if error.code == INVALID_ARG:
                self._refused.increment(1)
            return pb.InferenceResponse(error=glue.triton_error(pb, error))
        return pb.InferenceResponse(
            output_tensors=[
                pb.Tensor("input_ids", np.asarray([ids], dtype=np.int32)),
                glue.bytes_tensor(pb, "request", wire.encode_text_request(text), shape=(1, 1)),
            ]
        )

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
