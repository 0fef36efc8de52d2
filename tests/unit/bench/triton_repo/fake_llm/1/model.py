"""Test-only decoupled model with the serving contract's tensors: each request streams `max_tokens`
pieces (" t0", " t1", ...) `delay_ms` apart on its own thread, then a bare final flag, as the project's
pipelines end their streams. A prompt starting with "fail" gets an INVALID_ARG error instead."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.delay_s = float(params["delay_ms"]["string_value"]) / 1000.0

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            count = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            if prompt.startswith(b"fail"):
                error = pb_utils.TritonError("refused by the fake", pb_utils.TritonError.INVALID_ARG)
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            threading.Thread(target=self._stream, args=(sender, count), daemon=True).start()
        return None

    def _stream(self, sender, count):
        for index in range(count):
            if index:
                time.sleep(self.delay_s)  # the fake's token cadence, not synchronisation
            text = np.array([[f" t{index}".encode()]], dtype=object)
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", text)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
