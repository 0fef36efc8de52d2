"""How long a decode pool lends its cores between two steps while prompts wait (pure).

A decode pool that lends a core to a prefill pool (``disagg.engine.loan``) keeps stepping back to
back while no prompt waits: it never pauses for nothing. While one waits, it lends the core after
each step for what is left of its per-token budget once the step and the wait to take the core back
(at most one kernel part in flight) are paid::

    lend = budget - step - reclaim        (0 when below ``min_lend_s``, or when no prompt waits)

so that a token costs its stream at most the budget: with the budget at half the TPOT SLO, decode's
TPOT stays within half of it however long the prompts keep coming.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pacing:
    """``tpot_budget_s``: a decode step plus the time lent after it, while prompts wait (0: lend only
    while idle). ``min_lend_s``: a shorter loan is not worth a helper's wake-up."""

    tpot_budget_s: float
    min_lend_s: float = 0.001

    def __post_init__(self) -> None:
        if not self.tpot_budget_s >= 0:
            raise ValueError("tpot_budget_s must be at least 0")
        if not self.min_lend_s >= 0:
            raise ValueError("min_lend_s must be at least 0")

    def lend_s(self, step_s: float, reclaim_s: float, prompts_waiting: bool) -> float:
        """Seconds to lend after a step that took ``step_s`` when taking the core back is expected
        to take ``reclaim_s``; 0 when no prompt waits or too little is left."""
        if not prompts_waiting or self.tpot_budget_s <= 0:
            return 0.0
        spare = self.tpot_budget_s - max(step_s, 0.0) - max(reclaim_s, 0.0)
        return spare if spare >= self.min_lend_s else 0.0
