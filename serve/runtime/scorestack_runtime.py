"""scorestack's model runtime: the one implementation of every artifact format.

The same file runs in three places, always in the environment that serves the model:
Triton's Python backend (through `model.py` beside it), the compiler's verification and timing
worker (`worker.py`), and nowhere else. It is self-contained on purpose: it runs in the server
environment (numpy<2, without scorestack installed) and is copied into every model version folder.

Everything a model needs to run was decided by the compiler and written into config.pbtxt
`parameters` (the names below are the contract, defined here once) and into the version folder
(the artifact and SHA256SUMS).
"""

import bisect
import hashlib
import json
import os

import numpy as np

# --- the config.pbtxt `parameters` contract -------------------------------------------------------
PARAM_RUNTIME = "scorestack_runtime"  # which runner executes the artifact (a key of RUNNERS)
PARAM_ARTIFACT = "scorestack_artifact"  # artifact file name inside the version folder
PARAM_THREADS = "scorestack_threads"  # intra-op threads per model instance
PARAM_OUTPUT_COLUMN = "scorestack_output_column"  # keep this column of a 2-D raw output (binary: 1)
PARAM_METHOD = "scorestack_method"  # scikit-learn: predict_proba | predict
PARAM_INTEGRITY = "scorestack_integrity"  # "sha256": SHA256SUMS must exist and match before loading
PARAM_DECISION_THRESHOLD = "scorestack_decision_threshold"  # binary: read by clients, not by the runtime
# Per-batch-size dispatch: a JSON list of bands, each {"min_rows", "runtime", "artifact",
# "output_column", "method"}, ascending by min_rows from 1. A joined batch of n rows runs on the last
# band whose min_rows <= n. Set with PARAM_RUNTIME = DISPATCH; the single-artifact keys are then unused.
PARAM_DISPATCH = "scorestack_dispatch"
DISPATCH = "dispatch"

# Files the compiler writes into every version folder besides the artifact.
RUNTIME_FILES = ("model.py", "scorestack_runtime.py")
MANIFEST = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` checks it by hand too
ORIGIN = ".scorestack_origin"  # in a local view's version folder: the repository version folder it renders

# Triton data types (config JSON spelling) -> numpy.
_DTYPES = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
}


class RuntimeLoadError(Exception):
    """The model cannot be loaded; the message names the model and the file."""


class IntegrityError(RuntimeLoadError):
    """A file of the version folder differs from the digest the compiler recorded."""


# --- integrity ------------------------------------------------------------------------------------
def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(version_dir):
    """Write SHA256SUMS for every file in `version_dir` (sha256sum's format); return {file: digest}."""
    digests = {}
    for name in sorted(os.listdir(version_dir)):
        path = os.path.join(version_dir, name)
        if name != MANIFEST and os.path.isfile(path):
            digests[name] = file_sha256(path)
    with open(os.path.join(version_dir, MANIFEST), "w") as fh:
        fh.writelines(f"{digest}  {name}\n" for name, digest in digests.items())
    return digests


def read_manifest(version_dir):
    digests = {}
    with open(os.path.join(version_dir, MANIFEST)) as fh:
        for line in fh:
            if line.strip():
                digest, name = line.rstrip("\n").split(None, 1)
                digests[name.lstrip("*")] = digest
    return digests


def check_integrity(model_name, version_dir):
    """Raise IntegrityError unless every file in SHA256SUMS exists and matches its digest."""
    origin = None
    if os.path.exists(os.path.join(version_dir, ORIGIN)):
        with open(os.path.join(version_dir, ORIGIN)) as fh:
            origin = fh.read().strip()
    manifest = os.path.join(version_dir, MANIFEST)
    if not os.path.exists(manifest):
        raise IntegrityError(
            f"model {model_name}: {os.path.join(origin or version_dir, MANIFEST)} is missing, so the artifact cannot be checked; "
            "recompile the model (scorestack compile) or restore the version folder"
        )
    for name, want in read_manifest(version_dir).items():
        path = os.path.join(version_dir, name)
        # Messages name the repository's file, which is what a user fixes: the local view links to
        # it (or, for the runtime's own files, copied it from there).
        shown = os.path.join(origin, name) if origin else os.path.realpath(path)
        if not os.path.exists(path):
            raise IntegrityError(f"model {model_name}: {shown} listed in {MANIFEST} is missing; recompile or restore it")
        got = file_sha256(path)
        if got != want:
            raise IntegrityError(
                f"model {model_name}: {shown} is corrupted or was modified after compile "
                f"(sha256 {got[:16]}…, compiled as {want[:16]}…); refusing to load it. Recompile the model or restore the file"
            )


# --- runners: one class per artifact format -------------------------------------------------------
class OnnxRuntimeRunner:
    """onnxruntime InferenceSession, all graph optimizations, sequential, `threads` intra-op threads."""

    def __init__(self, path, threads, params, output_names):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        graph_inputs = [i.name for i in self.session.get_inputs()]
        graph_outputs = [o.name for o in self.session.get_outputs()]
        self.input_names = graph_inputs
        # Config tensor names normally equal the graph's; fall back to position.
        self.outputs = [n if n in graph_outputs else graph_outputs[i] for i, n in enumerate(output_names)]

    def run(self, inputs):
        feed = {}
        for position, (name, array) in enumerate(inputs):
            feed[name if name in self.input_names else self.input_names[position]] = array
        return self.session.run(self.outputs, feed)


class XGBoostRunner:
    """xgboost Booster with `threads` threads, called through XGBoost's C API.

    `XGBoosterPredictFromDense` is the function `Booster.inplace_predict` wraps; calling it with the
    configuration encoded once skips inplace_predict's per-call Python layer (input-type checks,
    JSON encoding, output wrapping), which cost ~100 µs a call here, as much as 20 rows of trees.
    Same function, same outputs: any input it does not expect goes through inplace_predict.
    """

    def __init__(self, path, threads, params, output_names):
        import ctypes
        import json

        import xgboost

        self.booster = xgboost.Booster(model_file=path)
        self.booster.set_param({"nthread": threads})
        self.ctypes = ctypes
        try:
            from xgboost.core import _LIB, c_bst_ulong

            self.predict_from_dense = _LIB.XGBoosterPredictFromDense
            self.last_error = _LIB.XGBGetLastError
            self.last_error.restype = ctypes.c_char_p
        except (ImportError, AttributeError):  # another XGBoost layout: the public API only
            self.predict_from_dense = None
            return
        config = {"type": 0, "training": False, "iteration_begin": 0, "iteration_end": 0, "strict_shape": False, "missing": float("nan"), "cache_id": 0}
        self.config = json.dumps(config).encode()
        self.shape = ctypes.POINTER(c_bst_ulong)()
        self.dims = c_bst_ulong()
        self.preds = ctypes.POINTER(ctypes.c_float)()
        self.no_proxy = ctypes.c_void_p()

    def run(self, inputs):
        x = inputs[0][1]
        if self.predict_from_dense is None or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
            return [self.booster.inplace_predict(x)]
        ctypes = self.ctypes
        interface = b'{"data": [%d, true], "shape": [%d, %d], "strides": null, "typestr": "<f4", "version": 3}' % (x.ctypes.data, x.shape[0], x.shape[1])
        status = self.predict_from_dense(
            self.booster.handle, interface, self.config, self.no_proxy, ctypes.byref(self.shape), ctypes.byref(self.dims), ctypes.byref(self.preds)
        )
        if status != 0:
            raise RuntimeError(f"XGBoost: {self.last_error().decode(errors='replace')}")
        shape = tuple(int(self.shape[i]) for i in range(self.dims.value))
        # The booster owns the buffer until its next call: copy it out.
        return [np.ctypeslib.as_array(self.preds, shape=shape).copy()]


class SklearnRunner:
    """A joblib-saved scikit-learn estimator; n_jobs set to `threads` (parallelism comes from instances)."""

    def __init__(self, path, threads, params, output_names):
        import joblib

        model = joblib.load(path)
        if hasattr(model, "n_jobs"):
            try:
                model.set_params(n_jobs=threads)
            except ValueError:
                pass
        self.method = getattr(model, params.get(PARAM_METHOD) or "predict")

    def run(self, inputs):
        return [self.method(inputs[0][1])]


class TL2cgenRunner:
    """A TL2cgen shared library: one ctypes call per batch into the function the compiler added
    (`scorestack_predict_batch`, compile/_tree_commons.py); a library without it (compiled before)
    goes through tl2cgen.Predictor. scorestack's own tree kernel (format `trees`,
    compile/tree_kernel.py) speaks the same three-function ABI and is served by this runner too."""

    # Below this many rows a thread pool costs more than it saves.
    PARALLEL_MIN_ROWS = 256

    def __init__(self, path, threads, params, output_names):
        import ctypes

        self.threads = max(1, int(threads))
        lib = ctypes.CDLL(os.path.abspath(path))
        if hasattr(lib, "scorestack_predict_batch"):
            lib.scorestack_result_type.restype = ctypes.c_char_p
            self.dtype = np.float64 if lib.scorestack_result_type() == b"double" else np.float32
            shape = (ctypes.c_int64 * 2)()
            lib.scorestack_output_shape(shape)
            self.shape = (int(shape[0]), int(shape[1]))  # (targets, classes), as tl2cgen.Predictor returns
            self.n_outputs = self.shape[0] * self.shape[1]
            fn = lib.scorestack_predict_batch
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self.lib, self.batch = lib, fn  # ctypes releases the GIL during the call
            self.pool = None
            if self.threads > 1:
                from concurrent.futures import ThreadPoolExecutor

                self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tl2cgen")
            self.run = self._run_batch
            return
        import tl2cgen

        if self.threads > 1:
            # TL2cgen caps nthread at OpenMP's max threads, which the server environment sets to 1
            # (OMP_NUM_THREADS) so that instances do not oversubscribe; this instance was given more.
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=self.threads, user_api="openmp")
        self.dmatrix = tl2cgen.DMatrix
        self.predictor = tl2cgen.Predictor(path, nthread=self.threads)

    def _call(self, x, out, lo, hi):
        n_cols = x.shape[1]
        rc = self.batch(x.ctypes.data + lo * n_cols * 4, hi - lo, n_cols, 0, out.ctypes.data + lo * self.n_outputs * out.itemsize)
        if rc != 0:
            raise ValueError(f"TL2cgen library: {n_cols} input columns, the model was compiled for another number" if rc == -1 else f"TL2cgen library: error {rc}")

    def _run_batch(self, inputs):
        x = np.ascontiguousarray(inputs[0][1], dtype=np.float32)
        n = x.shape[0]
        # (rows, targets, classes): the shape tl2cgen.Predictor returns, so the compiler's output
        # column means the same with either path.
        out = np.empty((n, *self.shape), dtype=self.dtype)
        if self.pool is None or n < self.PARALLEL_MIN_ROWS:
            self._call(x, out, 0, n)
        else:
            step = -(-n // self.threads)
            for f in [self.pool.submit(self._call, x, out, lo, min(n, lo + step)) for lo in range(0, n, step)]:
                f.result()
        return [out]

    def run(self, inputs):
        return [self.predictor.predict(self.dmatrix(inputs[0][1]))]


class TensorRTRunner:
    """A TensorRT plan on the GPU (device buffers through torch.cuda); needs tensorrt and torch with CUDA."""

    def __init__(self, path, threads, params, output_names):
        try:
            import tensorrt as trt
            import torch
        except Exception as exc:  # stub wheels fail with OSError/ImportError alike
            raise RuntimeLoadError(f"TensorRT runner needs tensorrt and torch in this environment ({type(exc).__name__}: {exc})") from None
        if not torch.cuda.is_available():
            raise RuntimeLoadError("TensorRT runner: no CUDA device visible")
        self.torch = torch
        with open(path, "rb") as fh:
            self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(fh.read())
        if self.engine is None:
            raise RuntimeLoadError(f"TensorRT could not deserialize {path} (built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.output_names = list(output_names)

    def run(self, inputs):
        torch = self.torch
        device_inputs = []
        for name, array in inputs:
            x = torch.from_numpy(np.ascontiguousarray(array)).cuda()
            self.context.set_input_shape(name, tuple(x.shape))
            self.context.set_tensor_address(name, x.data_ptr())
            device_inputs.append(x)
        outs = []
        for name in self.output_names:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=torch.float32, device="cuda")
            self.context.set_tensor_address(name, out.data_ptr())
            outs.append(out)
        self.context.execute_async_v3(self.stream.cuda_stream)
        self.stream.synchronize()
        return [o.cpu().numpy() for o in outs]


# Runner selection is this table: a new format is one class and one row.
RUNNERS = {
    "onnxruntime": OnnxRuntimeRunner,
    "xgboost": XGBoostRunner,
    "sklearn": SklearnRunner,
    "tl2cgen": TL2cgenRunner,
    "tensorrt": TensorRTRunner,
}


# --- the model: load once, then execute joined batches --------------------------------------------
def config_parameters(config):
    return {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


class ModelRuntime:
    """One model version: checks its files, loads its runner, and executes the batcher's requests.

    `config` is the model configuration as Triton hands it to the Python backend (JSON-like dict).
    """

    def __init__(self, name, version_dir, config):
        self.name = name
        params = config_parameters(config)
        if params.get(PARAM_INTEGRITY) == "sha256":
            check_integrity(name, version_dir)
        threads = int(params.get(PARAM_THREADS) or 1)
        self.inputs = [(i["name"], _dtype(i["data_type"])) for i in config["input"]]
        self.outputs = [(o["name"], _dtype(o["data_type"]), [int(d) for d in o["dims"]]) for o in config["output"]]
        self.batched = int(config.get("max_batch_size") or 0) > 0
        self.bands = [_load_band(name, version_dir, band, threads, params, [n for n, _, _ in self.outputs]) for band in _bands(name, params)]
        self._starts = [b.min_rows for b in self.bands]

    def band_for(self, n_rows):
        """The band that runs a joined batch of `n_rows` rows."""
        return self.bands[bisect.bisect_right(self._starts, n_rows) - 1]

    def coerce(self, arrays):
        """Request arrays in config order, as contiguous arrays of the config's dtypes."""
        if len(arrays) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs ({[n for n, _ in self.inputs]}), got {len(arrays)}")
        return [(name, np.ascontiguousarray(a, dtype=dtype)) for (name, dtype), a in zip(self.inputs, arrays)]

    def run(self, inputs, n_rows):
        """Run one (joined) batch: `inputs` are (name, array) pairs; returns one array per output."""
        band = self.band_for(n_rows)
        raw = band.runner.run(inputs)
        outputs = []
        for (_name, dtype, dims), value in zip(self.outputs, raw):
            value = np.asarray(value)
            if band.output_column is not None:
                # e.g. predict_proba (n, 2) or TL2cgen's (n, 1, k): keep the column the compiler chose.
                flat = value.reshape(n_rows, -1)
                if flat.shape[1] > 1:
                    value = flat[:, band.output_column]
            shape = ([n_rows] if self.batched else []) + [d if d > 0 else -1 for d in dims]
            outputs.append(np.ascontiguousarray(value.reshape(shape).astype(dtype, copy=False)))
        return outputs

    def execute(self, requests):
        """The dynamic batcher hands several requests at once: join them, run once, split back.

        `requests` holds, per request, its input arrays in config order (or the exception raised
        while reading them). Returns, per request, its output arrays or an exception naming the
        model. A joined batch that fails is retried request by request, so one bad request does not
        fail its neighbours.
        """
        if not self.batched or len(requests) == 1 or any(isinstance(r, Exception) for r in requests):
            return [self._execute_one(r) for r in requests]  # nothing to join, or a request to isolate
        try:
            per_request = [self.coerce(r) for r in requests]
            sizes = [inputs[0][1].shape[0] for inputs in per_request]
            joined = [(name, np.concatenate([inputs[i][1] for inputs in per_request], axis=0)) for i, (name, _) in enumerate(self.inputs)]
            outputs = self.run(joined, sum(sizes))
        except Exception:  # retry one at a time, each with its own error
            return [self._execute_one(r) for r in requests]
        results = []
        start = 0
        for size in sizes:
            results.append([out[start : start + size] for out in outputs])
            start += size
        return results

    def _execute_one(self, arrays):
        try:
            if isinstance(arrays, Exception):
                raise arrays
            inputs = self.coerce(arrays)
            n_rows = inputs[0][1].shape[0] if self.batched else 1
            return self.run(inputs, n_rows)
        except Exception as exc:  # reported per request, with the model's name
            return RuntimeError(f"model {self.name}: {type(exc).__name__}: {exc}")


class Band:
    """One artifact and the batch sizes it runs: from `min_rows` up to the next band's start."""

    def __init__(self, min_rows, runtime, artifact, runner, output_column):
        self.min_rows = min_rows
        self.runtime = runtime
        self.artifact = artifact
        self.runner = runner
        self.output_column = output_column


def _bands(name, params):
    """The bands the config declares: PARAM_DISPATCH's list, or the single artifact as one band from 1 row."""
    runtime = params.get(PARAM_RUNTIME) or "onnxruntime"
    if runtime != DISPATCH:
        column = (params.get(PARAM_OUTPUT_COLUMN) or "").strip()
        return [{
            "min_rows": 1,
            "runtime": runtime,
            "artifact": params.get(PARAM_ARTIFACT) or "model.onnx",
            "output_column": int(column) if column else None,
            "method": params.get(PARAM_METHOD) or None,
        }]
    try:
        bands = json.loads(params.get(PARAM_DISPATCH) or "")
        starts = [int(b["min_rows"]) for b in bands]
    except (ValueError, TypeError, KeyError) as exc:
        raise RuntimeLoadError(f"model {name}: {PARAM_DISPATCH} must be a JSON list of bands with min_rows, runtime and artifact ({exc})") from None
    if not starts or starts[0] != 1 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise RuntimeLoadError(f"model {name}: {PARAM_DISPATCH} bands must start at min_rows 1 and ascend, got {starts}")
    return bands


def _load_band(name, version_dir, band, threads, params, output_names):
    runtime = band.get("runtime")
    if runtime not in RUNNERS:
        raise RuntimeLoadError(f"model {name}: unknown {PARAM_RUNTIME} {runtime!r}; expected one of {sorted(RUNNERS)}")
    artifact = os.path.realpath(os.path.join(version_dir, band.get("artifact") or "model.onnx"))
    if not os.path.exists(artifact):
        raise RuntimeLoadError(f"model {name}: artifact {artifact} not found")
    runner_params = dict(params, **{PARAM_METHOD: band.get("method") or ""})
    try:
        runner = RUNNERS[runtime](artifact, threads, runner_params, output_names)
    except RuntimeLoadError as exc:
        raise RuntimeLoadError(f"model {name}: {exc}") from None
    except Exception as exc:  # any library error means "this artifact does not load here"
        raise RuntimeLoadError(f"model {name}: cannot load {artifact} with {runtime}: {type(exc).__name__}: {exc}") from None
    column = band.get("output_column")
    return Band(int(band["min_rows"]), runtime, os.path.basename(artifact), runner, None if column is None else int(column))


def _dtype(name):
    try:
        return _DTYPES[name]
    except KeyError:
        raise RuntimeLoadError(f"data type {name} is not supported by the scorestack runtime (supported: {sorted(_DTYPES)})") from None
