"""The benchmark's time plan: each part of a run gets a deadline of its own.

A run with one deadline for everything lets its first parts spend the whole budget, and the parts
measured last (the peers) are skipped. A `TimePlan` knows every part the run will take, each with a
weight (a goodput search weighs 1), and hands each part, when it starts, its share of the time left:

    share = (end - now) x weight / (the weight of this part and of every part still to come)

A part that finishes early (a deployment that misses its SLOs alone, a search that stops on a narrow
bracket) leaves its time to the parts after it; one that overruns (a probe started before its deadline
runs to its end) takes from them. A search whose deadline passes stops with the BUDGET reason and
reports the bracket it has, so the report explains every bracket wider than the tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

GOODPUT_WEIGHT = 1.0
"""One goodput search of a workload on a deployment."""
INTERFERENCE_WEIGHT = 1.0
"""The interference pair, every seed (a fixed number of requests: it is skipped, never cut)."""
GRID_CONFIG_WEIGHTS = {"vllm": 1.0}
"""One configuration of a grid, searched with the quick plan, by deployment: its server start included
(vLLM compiles at every start, a minute or two on two cores)."""
GRID_CONFIG_WEIGHT = 0.5
"""The same, for the deployments not in GRID_CONFIG_WEIGHTS."""
MIN_CONFIG_S = 120.0
"""The least time a grid configuration gets, whatever its share: a server start and a few probes."""


def grid_config_weight(deployment: str) -> float:
    return GRID_CONFIG_WEIGHTS.get(deployment, GRID_CONFIG_WEIGHT)


@dataclass
class TimePlan:
    """Deadlines for the named parts of a run that ends at `end` (a `clock()` value)."""

    end: float
    parts: dict[str, float] = field(default_factory=dict)
    """The parts still to come, by name, with their weights (in the order added)."""
    clock: Callable[[], float] = time.monotonic

    def add(self, name: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"part {name!r}: weight must be positive, not {weight}")
        if name in self.parts:
            raise ValueError(f"part {name!r} is planned twice")
        self.parts[name] = weight

    def extend(self, parts: Iterable[tuple[str, float]]) -> None:
        for name, weight in parts:
            self.add(name, weight)

    def start(self, name: str) -> float:
        """The deadline of part `name`, which starts now and leaves the plan. A part not planned
        (or started twice) gets the run's end: nothing after it was planned to need the time."""
        weight = self.parts.pop(name, None)
        now = self.clock()
        left = max(0.0, self.end - now)
        if weight is None:
            return self.end
        return now + left * weight / (weight + sum(self.parts.values()))

    def drop(self, deployment: str) -> None:
        """Forget every part of `deployment` (one that will not be measured)."""
        for name in [n for n in self.parts if n.startswith(f"{deployment}/")]:
            del self.parts[name]

    def remaining_s(self) -> float:
        return max(0.0, self.end - self.clock())


def goodput_part(deployment: str, workload: str) -> str:
    return f"{deployment}/goodput/{workload}"


def interference_part(deployment: str) -> str:
    return f"{deployment}/interference"


def grid_part(deployment: str, stage: str = "") -> str:
    """A deployment's grid (its first stage, or a later `stage`): every configuration still to measure."""
    return f"{deployment}/grid" + (f"/{stage}" if stage else "")


def shares(end: float, count: int, now: float) -> float:
    """The deadline of the first of `count` equal parts that start at `now` and share the time to `end`."""
    if count < 1:
        raise ValueError("count must be at least 1")
    return now + max(0.0, end - now) / count
