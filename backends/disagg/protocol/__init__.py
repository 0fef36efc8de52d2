"""What pools, schedulers and the orchestrator share, and nothing they do: the typed jobs, events and
pool loads that cross between them (``messages``), and errors with their Triton code and typed reason
(``errors``). A bottom layer: it imports only the engine's and the KV layer's error types, so that
``disagg.scheduling`` and ``disagg.serving`` both build on it without importing each other.
"""
