"""The request side in plain Python: the text interface, the orchestrator that runs one request's legs
on the pools, the pure router that decides them, the reply to the client, admission by capacity, the
fallback ladder over the pools' health and the watcher that probes them, version pins and remote pool
endpoints. Nothing here imports Triton or a pool's internals (``disagg.pool``);
``disagg.triton.orchestrator_model`` adapts it to ``pb_utils``.
"""
