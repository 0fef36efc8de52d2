"""Test-only Python-based backend (the shape of `backends/disagg`): models pick it with
`backend: "smoke_pybackend"` and differ only by config parameters, read once in `initialize`."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.offset = int(parameters["offset"]["string_value"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = pb_utils.Tensor("Y", (x + self.offset).astype(np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[y]))
        return responses
