"""A pool's measured latencies and the simple models fitted to them.

    prefill step  t = a + b * T + c * S      T: prompt tokens in the step, S: the sum of their squares
    decode step   t = d + e * B + f * C      B: sequences in the batch, C: their total context tokens

Both are linear in their coefficients and fitted by least squares on the relative error
(``numpy.linalg.lstsq``, each point weighted by 1 / its time); ``Fit`` keeps the mean and worst
relative error on the measured points. The quadratic term is attention over the prompt; the context
term is attention over the cache while decoding.
A profile says which engine, dtype and cores it was measured on: it predicts that pool only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    prompts: tuple[int, ...]  # prompt lengths prefilled together in one step
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int  # total context tokens of the batch
    seconds: float


@dataclass(frozen=True)
class Fit:
    coefficients: tuple[float, float, float]
    mean_error: float  # mean |predicted - measured| / measured over the points
    max_error: float


def _fit(rows: list[tuple[float, float, float]], seconds: list[float]) -> Fit:
    x = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-9)  # relative error: short steps count as much as long ones
    coef, *_ = np.linalg.lstsq(x * weight[:, None], y * weight, rcond=None)
    predicted = x @ coef
    errors = np.abs(predicted - y) / np.maximum(y, 1e-9)
    return Fit(tuple(float(c) for c in coef), float(errors.mean()), float(errors.max()))  # type: ignore[arg-type]


def prefill_row(prompts: Sequence[int]) -> tuple[float, float, float]:
    return (1.0, float(sum(prompts)), float(sum(p * p for p in prompts)))


def decode_row(batch: int, context: int) -> tuple[float, float, float]:
    return (1.0, float(batch), float(context))


@dataclass(frozen=True)
class Profile:
    """One pool's fitted step times, with the points and where they were measured."""

    prefill: Fit
    decode: Fit
    cores: tuple[int, ...] = ()
    model: str = ""
    dtype: str = ""
    kv_bytes_per_token: int = 0  # the KV hand-off's size: 2 x layers x KV heads x head dim x bytes
    prefill_points: tuple[PrefillPoint, ...] = field(default=(), repr=False)
    decode_points: tuple[DecodePoint, ...] = field(default=(), repr=False)

    @classmethod
    def fitted(
        cls,
        prefill: Sequence[PrefillPoint],
        decode: Sequence[DecodePoint],
        **about: Any,
    ) -> Profile:
        if len(prefill) < 3 or len(decode) < 3:
            raise ValueError("a profile needs at least 3 prefill and 3 decode points")
        p = _fit([prefill_row(pt.prompts) for pt in prefill], [pt.seconds for pt in prefill])
        d = _fit([decode_row(pt.batch, pt.context) for pt in decode], [pt.seconds for pt in decode])
        return cls(p, d, prefill_points=tuple(prefill), decode_points=tuple(decode), **about)

    def prefill_s(self, prompts: Sequence[int]) -> float:
        """Predicted seconds of one prefill step of these prompts (never below 0)."""
        a, b, c = self.prefill.coefficients
        _, t, s = prefill_row(prompts)
        return max(0.0, a + b * t + c * s)

    def decode_s(self, batch: int, context: int) -> float:
        """Predicted seconds of one decode step of ``batch`` sequences holding ``context`` tokens."""
        d, e, f = self.decode.coefficients
        return max(0.0, d + e * batch + f * context)

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("version", None) != VERSION:
            raise ValueError("not a profile of this version")
        try:
            return cls(
                prefill=Fit(tuple(data["prefill"]["coefficients"]), *_errors(data["prefill"])),
                decode=Fit(tuple(data["decode"]["coefficients"]), *_errors(data["decode"])),
                cores=tuple(data.get("cores", ())),
                model=data.get("model", ""),
                dtype=data.get("dtype", ""),
                kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
                prefill_points=tuple(
                    PrefillPoint(tuple(p["prompts"]), float(p["seconds"]))
                    for p in data.get("prefill_points", ())
                ),
                decode_points=tuple(
                    DecodePoint(int(p["batch"]), int(p["context"]), float(p["seconds"]))
                    for p in data.get("decode_points", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile is malformed ({exc})") from None

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_json(Path(path).read_text())


def _errors(data: dict[str, Any]) -> tuple[float, float]:
    return float(data["mean_error"]), float(data["max_error"])
