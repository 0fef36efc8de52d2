"""Test-only decoupled Python model: streams COUNT responses (VALUE = 0 .. COUNT-1), DELAY_MS apart.

The last response carries the final flag, so COUNT=1 also serves HTTP `generate` (exactly one response);
a stream cut short (cancelled, or the model finalized) ends with a bare final flag.

Requests run on their own threads so that several streams progress at once and `execute` returns at
once, as the project's decoupled models do. `finalize` cuts running streams short (each still ends with
its final flag) and waits for them.
"""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils

MAX_COUNT = 100_000
MAX_DELAY_MS = 10_000


class TritonPythonModel:
    def initialize(self, args):
        self._threads = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count_tensor = pb_utils.get_input_tensor_by_name(request, "COUNT")
            delay_tensor = pb_utils.get_input_tensor_by_name(request, "DELAY_MS")
            count = int(count_tensor.as_numpy().reshape(-1)[0])
            delay_ms = 0 if delay_tensor is None else int(delay_tensor.as_numpy().reshape(-1)[0])
            if not (0 <= count <= MAX_COUNT and 0 <= delay_ms <= MAX_DELAY_MS):
                error = pb_utils.TritonError(
                    "COUNT or DELAY_MS out of range", pb_utils.TritonError.INVALID_ARG
                )
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            thread = threading.Thread(target=self._stream, args=(sender, count, delay_ms / 1000.0))
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def _stream(self, sender, count, delay_s):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            for index in range(count):
                if sender.is_cancelled() or (index and delay_s and self._stopping.wait(delay_s)):
                    break
                value = pb_utils.Tensor("VALUE", np.array([index], dtype=np.int32))
                last = index == count - 1
                sender.send(pb_utils.InferenceResponse(output_tensors=[value]), flags=final if last else 0)
                if last:
                    return
            sender.send(flags=final)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def finalize(self):
        self._stopping.set()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
