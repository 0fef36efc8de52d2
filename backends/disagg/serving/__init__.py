"""The serving layer in plain Python: request parsing, pool engine loops, the orchestrator.

Nothing here imports Triton; ``disagg.triton`` adapts these objects to ``pb_utils``.
"""
