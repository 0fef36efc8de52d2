"""Serving benchmark library: workloads, open-loop load generation, clients, SLOs, goodput search, reports.

Pure arithmetic (`metrics`, `arrivals`, `search`, `slo` rules) is kept apart from I/O (`clients`,
`loadgen`, `deploy`, `report`, `plots`), so the numbers can be checked on hand-written traces.
"""
