"""Python-based backend of perf/bls_release_stress.py: a decoupled BLS relay over a streaming source.

Two roles, picked by the config parameter ``role``:
  - ``source`` (decoupled): answers COUNT responses, each a BYTES tensor BLOB of WIDTH small strings
    (a numpy object array: freeing it touches Python's allocator once per element), then a bare
    final flag, as the project's pools do.
  - ``relay`` (decoupled, async execute like the project's orchestrator): calls ``source`` with
    decoupled BLS, pulls its responses on a thread pool and, after each one with data, checks its
    own request for cancellation on that thread (a round trip through the stub's stub-to-parent
    queue, as the orchestrator does per token); answers one response with the number of strings
    seen. Parameter ``release``: ``drop`` lets the finished iterator go at once (what Python code
    naturally does), ``graveyard`` buries it in ``disagg.triton.graveyard.Graveyard`` until a later
    cancellation check has passed.
A churn thread in ``relay`` allocates and frees small objects all the time, as a busy orchestrator does.

Tripwire: the relay hangs a weak-reference callback on the numpy array of every response it gets.
The callback runs on whichever thread frees the array and asks CPython whether that thread holds the
GIL (``PyGILState_Check``, a per-thread answer). A thread without it running Python code at all is
the defect itself, so the count of such frees is a lower bound, and the run may crash first. Counts
go to the server log as ``bls-release-tripwire: policy=... with_gil=N without_gil=M`` from the churn
thread, about twice a second while they change, and at finalize: a stub that the defect leaves hung
(it then never unloads) or kills has still logged what it counted.
"""

import asyncio
import ctypes
import json
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton.graveyard import Graveyard

_END = object()
_holds_gil = ctypes.pythonapi.PyGILState_Check
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _parameters(args):
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        params = _parameters(args)
        self.role = params["role"]
        self.release = params.get("release", "drop")
        if self.release not in ("drop", "graveyard"):
            raise ValueError(f"release must be drop or graveyard, got {self.release!r}")
        if self.role == "relay":
            self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pull")
            self.graveyard = Graveyard()
            self.wires = {}  # id -> weak reference (a weakref's callback needs the weakref alive)
            self.with_gil = 0
            self.without_gil = 0
            self.stopping = threading.Event()
            self.churn = threading.Thread(target=self._churn, daemon=True)
            self.churn.start()

    def execute(self, requests):
        if self.role == "source":
            for request in requests:
                self._stream(request)
            return None
        return self._relay_all(requests)  # a coroutine: the stub runs it on its event loop

    async def _relay_all(self, requests):
        await asyncio.gather(*(self._relay(request) for request in requests))

    def _stream(self, request):
        sender = request.get_response_sender()
        count, width = _scalar(request, "COUNT"), _scalar(request, "WIDTH")
        for i in range(count):
            blob = np.array([b"x%d-%d" % (i, j) for j in range(width)], dtype=np.object_)
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("BLOB", blob)]))
        sender.send(flags=FINAL)  # a bare final flag, as the project's pools end a job

    async def _relay(self, request):
        sender = request.get_response_sender()
        loop = asyncio.get_running_loop()
        call = pb_utils.InferenceRequest(
            model_name="source",
            inputs=[pb_utils.get_input_tensor_by_name(request, n) for n in ("COUNT", "WIDTH")],
            requested_output_names=["BLOB"],
        )
        responses = await call.async_exec(decoupled=True)
        seen = 0
        error = None
        blob = None
        while True:
            response = await loop.run_in_executor(self.executor, self._pull, responses, sender)
            if response is _END:
                break
            if response.has_error():
                error = response.error().message()
                continue
            blob = pb_utils.get_output_tensor_by_name(response, "BLOB")
            if blob is not None:
                array = blob.as_numpy()
                seen += len(array)
                wire = weakref.ref(array, self._freed)
                self.wires[id(wire)] = wire
                del array
        if self.release == "graveyard":
            self.graveyard.bury(responses)
        del responses, blob, response  # drop: the last Python reference may go right here
        if error is not None:
            out = pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
        else:
            out = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("SEEN", np.array([seen], dtype=np.int32))]
            )
        sender.send(out, flags=FINAL)

    def _pull(self, responses, sender):
        """On a pool thread: the next response, then a cancellation check (many threads check at
        once, so the stub-to-parent queue holds a backlog, as under load)."""
        response = next(responses, _END)
        if response is _END or pb_utils.get_output_tensor_by_name(response, "BLOB") is None:
            return response  # the bare final flag: the orchestrator checks nothing after it either
        if self.release == "graveyard":
            self.graveyard.checked(sender.is_cancelled)
        else:
            sender.is_cancelled()
        return response

    def _freed(self, wire):
        if _holds_gil():
            self.wires.pop(id(wire), None)
            self.with_gil += 1
        else:
            self.without_gil += 1  # touch as little as possible: this thread should not be here

    def _churn(self):
        keep = []
        logged, tick = None, 0
        while not self.stopping.wait(0.001):  # bursts of small allocations, leaving the GIL between
            keep.append([bytes([i % 256]) * (i % 64) for i in range(200)])
            if len(keep) > 50:
                keep = keep[25:]
            tick += 1
            if tick % 400 == 0 and (self.with_gil, self.without_gil) != logged:
                logged = (self.with_gil, self.without_gil)
                self._log_counts()

    def _log_counts(self):
        print(
            f"bls-release-tripwire: policy={self.release} with_gil={self.with_gil} "
            f"without_gil={self.without_gil}",
            file=sys.stderr,
            flush=True,
        )

    def finalize(self):
        if self.role == "relay":
            self.stopping.set()
            self.churn.join()
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.graveyard.release_all()
            self._log_counts()
