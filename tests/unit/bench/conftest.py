"""The benchmark library lives in perf/benchlib (scripts, not an installed package): put perf/ on the path."""

from __future__ import annotations

import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[3] / "perf"
if str(PERF) not in sys.path:
    sys.path.insert(0, str(PERF))
