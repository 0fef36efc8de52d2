"""Hot prompts: detecting prompt groups that surge (shared prefixes, near duplicates) and capping them
(a token bucket per group, an adaptive rate from the shared decode pool's step time). Pure; the
orchestrator (``disagg.serving``) consults it for each new request.
"""
