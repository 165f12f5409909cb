"""scorestack model runtime: executes a compiled artifact inside Triton's Python backend.

Self-contained on purpose (it runs in the server environment, numpy<2, without scorestack
installed). Every decision (runtime, artifact, threads, output column) was made by the compiler
and written into config.pbtxt `parameters`; this file only joins, runs and splits batches.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class _OnnxRuntime:
    def __init__(self, path, threads, params):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs, output_names):
        # Config tensor names normally equal the graph's; fall back to position.
        feed = {}
        for position, (name, array) in enumerate(inputs):
            feed[name if name in self.input_names else self.input_names[position]] = array
        wanted = [n if n in self.output_names else self.output_names[i] for i, n in enumerate(output_names)]
        return self.session.run(wanted, feed)


class _XGBoostRuntime:
    def __init__(self, path, threads, params):
        import xgboost

        self.booster = xgboost.Booster(model_file=path)
        self.booster.set_param({"nthread": threads})

    def run(self, inputs, output_names):
        return [np.asarray(self.booster.inplace_predict(inputs[0][1]))]


class _SklearnRuntime:
    def __init__(self, path, threads, params):
        import joblib

        self.model = joblib.load(path)
        self.method = getattr(self.model, params.get("scorestack_method", "predict"))

    def run(self, inputs, output_names):
        return [np.asarray(self.method(inputs[0][1]))]


class _TL2cgenRuntime:
    def __init__(self, path, threads, params):
        import tl2cgen

        self.tl2cgen = tl2cgen
        self.predictor = tl2cgen.Predictor(path, nthread=threads)

    def run(self, inputs, output_names):
        return [np.asarray(self.predictor.predict(self.tl2cgen.DMatrix(inputs[0][1])))]


RUNTIMES = {
    "onnxruntime": _OnnxRuntime,
    "xgboost": _XGBoostRuntime,
    "sklearn": _SklearnRuntime,
    "tl2cgen": _TL2cgenRuntime,
}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        runtime = params.get("scorestack_runtime", "onnxruntime")
        if runtime not in RUNTIMES:
            raise pb_utils.TritonModelException(
                f"model {self.name}: unknown scorestack_runtime {runtime!r}; expected one of {sorted(RUNTIMES)}"
            )
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        artifact = os.path.join(version_dir, params.get("scorestack_artifact", "model.onnx"))
        if not os.path.exists(artifact):
            raise pb_utils.TritonModelException(f"model {self.name}: artifact {artifact} not found")
        threads = int(params.get("scorestack_threads", "1") or 1)
        column = params.get("scorestack_output_column", "")
        self.output_column = int(column) if column.strip() else None
        self.input_specs = [(i["name"], pb_utils.triton_string_to_numpy(i["data_type"])) for i in config["input"]]
        self.output_specs = [
            (o["name"], pb_utils.triton_string_to_numpy(o["data_type"]), [int(d) for d in o["dims"]])
            for o in config["output"]
        ]
        self.runner = RUNTIMES[runtime](artifact, threads, params)

    def execute(self, requests):
        # The dynamic batcher hands several requests at once: join them, run once, split back.
        try:
            per_request = [self._inputs(r) for r in requests]
        except Exception:  # a malformed request must not fail its neighbours
            return [self._execute_one(r) for r in requests]
        sizes = [batch[0][1].shape[0] for batch in per_request]
        joined = [
            (name, np.concatenate([batch[i][1] for batch in per_request], axis=0))
            for i, (name, _) in enumerate(self.input_specs)
        ]
        try:
            outputs = self._run(joined, sum(sizes))
        except Exception:
            return [self._execute_one(r) for r in requests]
        responses = []
        start = 0
        for size in sizes:
            tensors = [pb_utils.Tensor(name, out[start : start + size]) for (name, _, _), out in zip(self.output_specs, outputs)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += size
        return responses

    def _execute_one(self, request):
        try:
            inputs = self._inputs(request)
            outputs = self._run(inputs, inputs[0][1].shape[0])
            tensors = [pb_utils.Tensor(name, out) for (name, _, _), out in zip(self.output_specs, outputs)]
            return pb_utils.InferenceResponse(output_tensors=tensors)
        except Exception as exc:  # reported per request, with the model's name
            return pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(f"model {self.name}: {type(exc).__name__}: {exc}")
            )

    def _inputs(self, request):
        arrays = []
        for name, dtype in self.input_specs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise ValueError(f"input {name!r} missing")
            arrays.append((name, np.ascontiguousarray(tensor.as_numpy(), dtype=dtype)))
        return arrays

    def _run(self, inputs, n_rows):
        raw = self.runner.run(inputs, [name for name, _, _ in self.output_specs])
        outputs = []
        for (name, dtype, dims), value in zip(self.output_specs, raw):
            value = np.asarray(value)
            if self.output_column is not None:
                # e.g. predict_proba (n, 2) or TL2cgen's (n, 1, k): pick the column the compiler chose.
                flat = value.reshape(n_rows, -1)
                if flat.shape[1] > 1:
                    value = flat[:, self.output_column]
            value = value.reshape([n_rows] + [d if d > 0 else -1 for d in dims]).astype(dtype, copy=False)
            outputs.append(np.ascontiguousarray(value))
        return outputs

    def finalize(self):
        self.runner = None
