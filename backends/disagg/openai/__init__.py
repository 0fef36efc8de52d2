"""The OpenAI-compatible front end: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and
``/health`` over the ``llm`` entry point, reached through Triton gRPC streaming (where a client's
cancel reaches the orchestrator).

- ``protocol``: request bodies validated into one typed ``Generation`` (pure).
- ``chat``: the model's chat template rendered with jinja2 (pure).
- ``response``: response bodies and stream chunks, ``usage`` included (pure).
- ``errors``: ``ApiError`` and the OpenAI error body; the mapping of the ``llm`` model's error codes.
- ``client``: one generation over ``tritonclient.grpc.aio``, as ``Piece`` values, cancelled on exit.
- ``app``: the aiohttp application; ``server``: its command line (``disagg openai``);
  ``launcher``: the child process ``disagg serve`` runs beside Triton.

Nothing here tokenizes, samples or schedules: token counts and finish reasons come from ``llm``.
"""
