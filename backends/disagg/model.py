"""Triton entry point of the ``disagg`` Python-based backend. Every model of the repository uses it;
its ``role`` parameter picks the adapter (``disagg.triton``), which holds all the glue."""

import triton_python_backend_utils as pb_utils

from disagg.triton.entry import create_adapter, finalize_adapter


class TritonPythonModel:
    def initialize(self, args):
        self._adapter = create_adapter(args, pb_utils)

    def execute(self, requests):
        # A list (pre/postprocessing), None (decoupled pools) or a coroutine (the orchestrator).
        return self._adapter.execute(requests)

    def finalize(self):
        finalize_adapter(self._adapter)
