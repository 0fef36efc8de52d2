"""Token-length distributions, shared by the planner's simulator and the benchmarks' workloads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CONTEXT_LEN = 2048
"""Context of the default model: prompt + output never exceed it."""


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: `fixed` (a), `uniform` integers in [a, b], or `lognormal` with median a
    and shape sigma b; every draw is clipped to [lo, hi]."""

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = CONTEXT_LEN

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError("kind must be fixed, uniform or lognormal")
        if not 1 <= self.lo <= self.hi <= CONTEXT_LEN:
            raise ValueError(f"need 1 <= lo <= hi <= {CONTEXT_LEN}")
        if self.kind == "uniform" and not self.a <= self.b:
            raise ValueError("uniform needs a <= b")
        if self.kind == "lognormal" and not (self.a > 0 and self.b > 0):
            raise ValueError("lognormal needs a positive median and sigma")

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        if self.kind == "fixed":
            raw = np.full(count, self.a)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b), size=count, endpoint=True)
        else:
            raw = rng.lognormal(math.log(self.a), self.b, size=count)
        return [int(x) for x in np.clip(np.rint(raw), self.lo, self.hi)]

    def median(self) -> int:
        """The distribution's median (before any joint clipping), used to calibrate idle TTFT."""
        centre = {"fixed": self.a, "uniform": (self.a + self.b) / 2, "lognormal": self.a}[self.kind]
        return int(min(max(round(centre), self.lo), self.hi))


def parse_lengths(text: str) -> LengthDist:
    """``fixed:300``, ``uniform:100:500`` or ``lognormal:300:0.5`` (median, sigma)."""
    kind, _, rest = text.partition(":")
    try:
        values = [float(v) for v in rest.split(":") if v]
        return LengthDist(kind, *values)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"lengths {text!r}: fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA ({exc})"
        ) from None
