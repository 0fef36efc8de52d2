"""SLOs fixed by rule, from idle single requests to the reference deployment.

The rule (so that no one picks SLOs to flatter a result): per workload,
    TTFT SLO = TTFT_FACTOR x the idle TTFT of the reference deployment at the workload's median prompt length,
    TPOT SLO = TPOT_FACTOR x its idle single-stream TPOT,
with REFERENCE_DEPLOYMENT = `ensemble_colocated` (our continuous-batching baseline). The same absolute
values then judge every deployment, the peer included. "Idle" = requests sent one at a time, each after
the previous one finished, on an otherwise unloaded server; the medians of `reps` such requests are used
after `warmup` discarded ones.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from perf.benchlib.clients import StreamClient
from perf.benchlib.loadgen import LoadConfig, run_trace
from perf.benchlib.metrics import RequestRecord, Slo
from perf.benchlib.workload import PromptFactory, RequestSpec, Workload, new_salt

TTFT_FACTOR = 4.0
TPOT_FACTOR = 2.0
REFERENCE_DEPLOYMENT = "ensemble_colocated"
CALIBRATION_OUTPUT_TOKENS = 32
"""Output length of the idle requests: enough steps for a stable TPOT, short enough to be quick."""


@dataclass(frozen=True)
class Calibration:
    """Idle figures of the reference deployment for one workload, and the SLO derived by the rule."""

    workload: str
    reference: str
    prompt_tokens: int
    idle_ttft_s: float
    idle_tpot_s: float
    slo: Slo
    samples: int

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rule"] = f"TTFT SLO = {TTFT_FACTOR:g} x idle TTFT, TPOT SLO = {TPOT_FACTOR:g} x idle TPOT"
        return out


def slo_from_idle(idle_ttft_s: float, idle_tpot_s: float) -> Slo:
    """The rule itself."""
    return Slo(ttft_s=TTFT_FACTOR * idle_ttft_s, tpot_s=TPOT_FACTOR * idle_tpot_s)


def idle_figures(records: list[RequestRecord]) -> tuple[float, float]:
    """Median TTFT and TPOT of idle records; ValueError when a request failed (a broken reference
    must never silently produce an SLO)."""
    failed = [r for r in records if not r.ok or r.ttft is None or r.tpot is None]
    if failed:
        raise ValueError(f"calibration request failed: {failed[0].error or 'no TPOT (single token)'}")
    return statistics.median(r.ttft for r in records), statistics.median(r.tpot for r in records)  # type: ignore[misc]


async def calibrate(
    client: StreamClient,
    workload: Workload,
    factory: PromptFactory,
    reference: str,
    salt: str = "",
    reps: int = 5,
    warmup: int = 1,
    retokenize: Callable[[str], int] | None = None,
) -> Calibration:
    """Measure idle TTFT/TPOT through `client` at the workload's median prompt length; apply the rule.

    `reference` names the deployment `client` talks to, recorded with the result (it should be
    REFERENCE_DEPLOYMENT; a stand-in must say so in its name). Each request runs alone (a trace of one),
    so none queues behind another.
    """
    if reps < 1 or warmup < 0:
        raise ValueError("need reps >= 1 and warmup >= 0")
    import numpy as np

    salt = salt or new_salt()  # fresh prompts: an earlier calibration must not warm a prefix cache
    length = workload.prompt.median()
    rng = np.random.default_rng(0)
    count = retokenize or factory.count_output
    records = []
    for i in range(warmup + reps):
        prompt = factory.make(length, f"{salt}{i}", rng)
        spec = RequestSpec(0, 0.0, prompt, length, CALIBRATION_OUTPUT_TOKENS, "idle")
        (record,) = await run_trace(client, [spec], LoadConfig(max_duration_s=1, drain_timeout_s=120), count)
        if i >= warmup:
            records.append(record)
    ttft, tpot = idle_figures(records)
    return Calibration(workload.name, reference, length, ttft, tpot, slo_from_idle(ttft, tpot), reps)


# ---- frozen SLOs ----------------------------------------------------------------------------------
#
# The rule's SLOs scale with the reference deployment's own speed, so every speed-up would tighten them
# and no two reports would compare. They are derived once by the rule, per model and workload, and
# committed (perf/slos.json); benchmarks judge by the frozen values, and re-deriving is an explicit
# step (`perf/run_all.py --derive-slos`) that records when and by which command.

SLO_FILE = Path(__file__).resolve().parents[1] / "slos.json"
_ENTRY_FIELDS = (
    "ttft_s",
    "tpot_s",
    "idle_ttft_s",
    "idle_tpot_s",
    "prompt_tokens",
    "reference",
    "derived",
    "command",
)


@dataclass(frozen=True)
class FrozenSlo:
    """One workload's SLO as derived by the rule, with where it came from."""

    ttft_s: float
    tpot_s: float
    idle_ttft_s: float
    idle_tpot_s: float
    prompt_tokens: int
    reference: str
    derived: str  # ISO date and time of the derivation
    command: str

    @property
    def slo(self) -> Slo:
        return Slo(ttft_s=self.ttft_s, tpot_s=self.tpot_s)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FrozenSlo:
        if not isinstance(data, dict) or set(data) != set(_ENTRY_FIELDS):
            raise ValueError(f"{where}: an entry needs exactly the fields {', '.join(_ENTRY_FIELDS)}")
        for name in ("ttft_s", "tpot_s", "idle_ttft_s", "idle_tpot_s"):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where}.{name}: a positive number of seconds, got {value!r}")
        if isinstance(data["prompt_tokens"], bool) or not isinstance(data["prompt_tokens"], int):
            raise ValueError(f"{where}.prompt_tokens: an integer")
        for name in ("reference", "derived", "command"):
            if not isinstance(data[name], str) or not data[name]:
                raise ValueError(f"{where}.{name}: a non-empty string")
        return cls(**data)


def _read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text()) if path.exists() else {"rule": "", "models": {}}
    if not isinstance(data, dict) or set(data) != {"rule", "models"} or not isinstance(data["models"], dict):
        raise ValueError(f"{path}: expected an object with exactly 'rule' and 'models'")
    return data


def load_frozen(path: Path, model: str) -> dict[str, FrozenSlo]:
    """The frozen SLOs of `model` (a checkpoint folder's name) by workload; empty when none. Malformed
    entries are errors that name their place in the file."""
    entries = _read(path)["models"].get(model, {})
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: models.{model} must be an object of workloads")
    return {
        name: FrozenSlo.from_dict(e, f"{path.name}: models.{model}.{name}") for name, e in entries.items()
    }


def freeze(path: Path, model: str, calibrations: dict[str, Calibration], derived: str, command: str) -> None:
    """Record `calibrations` (measured now, by the rule) as `model`'s frozen SLOs, replacing the
    workloads they cover and keeping the others."""
    data = _read(path)
    data["rule"] = (
        f"TTFT SLO = {TTFT_FACTOR:g} x idle TTFT, TPOT SLO = {TPOT_FACTOR:g} x idle TPOT "
        f"of {REFERENCE_DEPLOYMENT}"
    )
    entries = data["models"].setdefault(model, {})
    for name, cal in calibrations.items():
        entries[name] = asdict(
            FrozenSlo(
                cal.slo.ttft_s, cal.slo.tpot_s, cal.idle_ttft_s, cal.idle_tpot_s, cal.prompt_tokens,
                cal.reference, derived, command,
            )
        )  # fmt: skip
    data["models"] = {m: dict(sorted(e.items())) for m, e in sorted(data["models"].items())}
    path.write_text(json.dumps(data, indent=2) + "\n")


def judged_by(cal: Calibration, frozen: FrozenSlo) -> Calibration:
    """Today's calibration (its idle figures still measured and reported) judged by the frozen SLO."""
    return replace(cal, slo=frozen.slo)


# ---- SLOs given from outside --------------------------------------------------------------------------
#
# Beside the rule's SLOs, a workload can be judged by SLOs stated elsewhere, under a name of its own
# (`<workload>@<source>`): the same prompts and lengths, another bar. They are never derived or frozen.


@dataclass(frozen=True)
class FixedSlo:
    """A workload judged by SLOs given from outside the rule, and where they come from."""

    workload: str
    slo: Slo
    source: str


FIXED_SLOS: dict[str, FixedSlo] = {
    "codegen@article": FixedSlo(
        "codegen",
        Slo(ttft_s=0.5, tpot_s=0.05),
        "the source article's SLOs for code completion: TTFT <= 500 ms and TPOT <= 50 ms for a "
        "~300-token prompt",
    )
}


def base_workload(name: str) -> str:
    """The workload whose prompts and lengths `name` uses: itself, or a fixed-SLO variant's base."""
    fixed = FIXED_SLOS.get(name)
    return fixed.workload if fixed is not None else name
