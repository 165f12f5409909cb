"""Triton Python backend entry point: adapts Triton's requests to scorestack's model runtime.

All model logic lives in `scorestack_runtime.py` beside this file, the same code the compiler
verified the artifact with; this file only converts between Triton's tensors and numpy arrays.
"""

import importlib.util
import json
import os

import triton_python_backend_utils as pb_utils


def _load_runtime():
    # Load the sibling file by path: whatever else is on sys.path cannot shadow it.
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("scorestack_runtime", os.path.join(here, "scorestack_runtime.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TritonPythonModel:
    def initialize(self, args):
        runtime = _load_runtime()
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        try:
            self.model = runtime.ModelRuntime(self.name, version_dir, config)
        except runtime.RuntimeLoadError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        self.output_names = [name for name, _, _ in self.model.outputs]

    def execute(self, requests):
        results = self.model.execute([self._inputs(r) for r in requests])
        responses = []
        for result in results:
            if isinstance(result, Exception):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(result))))
            else:
                tensors = [pb_utils.Tensor(name, value) for name, value in zip(self.output_names, result)]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _inputs(self, request):
        arrays = []
        for name, _ in self.model.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                return ValueError(f"input {name!r} missing")
            arrays.append(tensor.as_numpy())
        return arrays

    def finalize(self):
        self.model = None
