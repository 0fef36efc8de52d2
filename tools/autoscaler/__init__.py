"""External autoscaler for the prefill and decode pools (`disagg autoscale`).

Reads the `disagg_*` families (contract: :data:`METRIC_NAMES`) from Triton's `/metrics` or a Prometheus
server, decides per pool with plain policy classes, and acts through a dry-run log, Triton's model
repository API (instance count on one machine) or Kubernetes (Deployment replicas).
"""

from disagg_tools.autoscaler.cli import main
from disagg_tools.autoscaler.contract import AUTOSCALER_METRIC_NAMES, METRIC_NAMES

__all__ = ["AUTOSCALER_METRIC_NAMES", "METRIC_NAMES", "main"]
