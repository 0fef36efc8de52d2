"""The ensemble's preprocessing step over a dynamic batch: the valid prompts are tokenized in one call,
each exactly as alone, and a bad request gets its own error without failing the others."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from disagg.engine.tokenizer import Tokenizer
from disagg.triton import wire
from disagg.triton.text_model import PreprocessingModel


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Request:
    def __init__(self, **inputs: Any) -> None:
        self.inputs = inputs

    def parameters(self) -> str:
        return ""


class _Error:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

    def __init__(self, message: str, code: int) -> None:
        self.message, self.code = message, code


class _Metric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self.count = labels, 0

    def increment(self, value: float) -> None:
        self.count += value


def _pb(metrics: list[_Metric]) -> Any:
    """A stand-in for ``triton_python_backend_utils``: the metrics it creates go into ``metrics``."""

    class Family:
        COUNTER = "counter"

        def __init__(self, name: str, description: str, kind: str) -> None:
            pass

        def Metric(self, labels: dict[str, str]) -> _Metric:  # pb_utils' name
            metrics.append(_Metric(labels))
            return metrics[-1]

    def get_input_tensor_by_name(request: _Request, name: str) -> _Tensor | None:
        value = request.inputs.get(name)
        return None if value is None else _Tensor(name, value)

    return SimpleNamespace(
        get_input_tensor_by_name=get_input_tensor_by_name,
        Tensor=_Tensor,
        TritonError=_Error,
        MetricFamily=Family,
        InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(
            outputs={t.name: t.array for t in output_tensors or []}, error=error
        ),
    )


def _model(model_dir: Path, metrics: list[_Metric] | None = None) -> PreprocessingModel:
    config = {"parameters": {"model_dir": {"string_value": str(model_dir)}}}
    args = {"model_config": json.dumps(config), "model_name": "preprocessing"}
    return PreprocessingModel(args, _pb([] if metrics is None else metrics))


def _request(prompt: bytes, max_tokens: int = 8) -> _Request:
    return _Request(
        text_input=np.array([[prompt]], dtype=np.object_),
        max_tokens=np.array([[max_tokens]], dtype=np.int32),
    )


def test_a_batch_is_tokenized_as_each_prompt_alone(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    prompts = [b"The capital of France is", b"def add(a, b):\n    return", "Zürich, née 1890 ?".encode()]
    responses = model.execute([_request(p, max_tokens=4 + i) for i, p in enumerate(prompts)])
    tokenizer = Tokenizer(tiny_model_dir)
    assert len(responses) == len(prompts)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        assert response.error is None
        assert response.outputs["input_ids"].tolist() == [tokenizer.encode(prompt.decode())]
        text = wire.decode_text_request(response.outputs["request"].reshape(-1)[0])
        assert (text.prompt, text.params.max_tokens) == (prompt.decode(), 4 + i)


def test_a_bad_request_fails_alone_and_is_counted(tiny_model_dir: Path) -> None:
    metrics: list[_Metric] = []
    model = _model(tiny_model_dir, metrics)
    batch = [_request(b"Hello there"), _Request(max_tokens=np.array([[4]], dtype=np.int32)), _request(b"Bye")]
    good, bad, last = model.execute(batch)
    assert good.error is None and last.error is None
    assert last.outputs["input_ids"].tolist() == [Tokenizer(tiny_model_dir).encode("Bye")]
    assert bad.error.code == _Error.INVALID_ARG and "text_input" in bad.error.message
    assert not bad.outputs
    [refused] = metrics
    assert refused.labels["outcome"] == "invalid_arg" and refused.count == 1


def test_a_batch_with_no_valid_prompt_answers_each_with_its_error(tiny_model_dir: Path) -> None:
    metrics: list[_Metric] = []
    model = _model(tiny_model_dir, metrics)
    wrong_type = _request(b"x")
    wrong_type.inputs["max_tokens"] = np.array([[4.0]], dtype=np.float32)
    responses = model.execute([_request(b""), wrong_type])
    assert [r.error.code for r in responses] == [_Error.INVALID_ARG, _Error.INVALID_ARG]
    assert "empty" in responses[0].error.message and "max_tokens" in responses[1].error.message
    assert metrics[0].count == 2


def test_a_prompt_the_tokenizer_fails_on_fails_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tiny_model_dir)
    encode = model.tokenizer.encode

    def fragile(text: str) -> list[int]:
        if "poison" in text:
            raise RuntimeError("tokenizer failed")
        return encode(text)

    def fragile_many(texts: list[str]) -> list[list[int]]:
        return [fragile(t) for t in texts]

    monkeypatch.setattr(model.tokenizer, "encode", fragile)
    monkeypatch.setattr(model.tokenizer, "encode_many", fragile_many)
    good, bad = model.execute([_request(b"Hello"), _request(b"poison")])
    assert good.outputs["input_ids"].tolist() == [encode("Hello")]
    assert bad.error.code == _Error.INTERNAL and not bad.outputs
