"""A pool instance in plain Python: its engine loop (one engine thread with a typed inbox), the runner
(the only seam to the engine), the response thread, lease renewals, faults for live tests, and the
in-process and offline ways to drive pools. Nothing here imports Triton or the request side
(``disagg.serving``); ``disagg.triton.pool_model`` adapts it to ``pb_utils``.
"""
