"""scorestack's model runtime: the one implementation of every artifact format.

The same file runs in the environment that serves the model: Triton's Python backend (through
`model.py` beside it), the compiler's verification and timing worker (`worker.py`), and a service
process that runs the artifact itself (scorestack.serve.embedded, which loads the version folder's
copy and first reproduces the folder's reference rows, REFERENCE, because that process is not the
environment the compiler verified in). It is self-contained on purpose: it runs in the server
environment (numpy<2, without scorestack installed) and is copied into every model version folder.

Everything a model needs to run was decided by the compiler and written into config.pbtxt
`parameters` (the names below are the contract, defined here once) and into the version folder
(the artifact and SHA256SUMS).
"""

import bisect
import hashlib
import json
import os
import threading

import numpy as np

# --- the config.pbtxt `parameters` contract -------------------------------------------------------
PARAM_RUNTIME = "scorestack_runtime"  # which runner executes the artifact (a key of RUNNERS)
PARAM_ARTIFACT = "scorestack_artifact"  # artifact file name inside the version folder
PARAM_THREADS = "scorestack_threads"  # intra-op threads per model instance
PARAM_OUTPUT_COLUMN = "scorestack_output_column"  # keep this column of a 2-D raw output (binary: 1)
PARAM_METHOD = "scorestack_method"  # scikit-learn: predict_proba | predict
PARAM_INTEGRITY = "scorestack_integrity"  # "sha256": SHA256SUMS must exist and match before loading
PARAM_DECISION_THRESHOLD = "scorestack_decision_threshold"  # binary: read by clients, not by the runtime
# Per-batch-size dispatch: the plan, a JSON list of bands whose format is specified once below
# (parse_dispatch) and read by this runtime and by the native backend alike. Set with
# PARAM_RUNTIME = DISPATCH; the single-artifact keys are then unused.
PARAM_DISPATCH = "scorestack_dispatch"
DISPATCH = "dispatch"

# Files the compiler writes into every version folder besides the artifact.
RUNTIME_FILES = ("model.py", "scorestack_runtime.py")
MANIFEST = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` checks it by hand too
# Rows and the source model's outputs on them, with the verification tolerances: a process that runs
# the artifact outside the server environment (scorestack.serve.embedded) checks it against these first.
REFERENCE = "scorestack_reference.npz"
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


# --- integrity: the SHA256SUMS rule ---------------------------------------------------------------
# This is the one statement of the rule; the native backend's scorestack_check_manifest
# (serve/runtime/native/scorestack_backend.c) applies it with the same messages, and
# tests/test_contracts.py runs both on one set of version folders.
#
#   When PARAM_INTEGRITY is "sha256", before anything loads, the version folder's SHA256SUMS is read
#   as bytes, in sha256sum's format as write_manifest writes it: lines ending in "\n" (a "\r" before
#   it is dropped), each "<64 lowercase hex digits><space><space or *><file name>", the name being a
#   file of the folder itself (no "/"). Empty lines are skipped.
#   Checked in this order, the first failure being the message (INTEGRITY_MESSAGES):
#     the manifest exists ("missing_manifest"); every line has that form ("malformed", naming the
#     first line that does not, counting from 1); it lists a file ("empty"); then file by file in
#     the manifest's order: it exists ("missing_file"), it can be read ("unreadable", with the
#     system's reason), its sha256 is the listed one ("modified").
#   {folder} is the repository's version folder a local view renders (the first line of
#   .scorestack_origin) or else the version folder's real path: the folder a user fixes.
INTEGRITY_MESSAGES = {
    "missing_manifest": "model {model}: {folder}/SHA256SUMS is missing, so the artifact cannot be checked; "
    "recompile the model (scorestack compile) or restore the version folder",
    "malformed": "model {model}: {folder}/SHA256SUMS line {line} is not '<sha256>  <file>'; "
    "recompile the model (scorestack compile) or restore the version folder",
    "empty": "model {model}: {folder}/SHA256SUMS lists no files, so the artifact cannot be checked; "
    "recompile the model (scorestack compile) or restore the version folder",
    "missing_file": "model {model}: {folder}/{file} listed in SHA256SUMS is missing; recompile or restore it",
    "unreadable": "model {model}: cannot read {folder}/{file}: {reason}",
    "modified": "model {model}: {folder}/{file} is corrupted or was modified after compile "
    "(sha256 {got}…, compiled as {want}…); refusing to load it. Recompile the model or restore the file",
}
_HEX = frozenset(b"0123456789abcdef")


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


def read_manifest(data):
    """The (file name, digest) entries of a manifest's bytes, or the number of its first malformed line."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    entries = []
    for number, line in enumerate(lines, 1):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            continue
        digest, sep, mark, name = line[:64], line[64:65], line[65:66], line[66:]
        if len(digest) != 64 or not set(digest) <= _HEX or sep != b" " or mark not in (b" ", b"*") or not name or b"/" in name or b"\0" in name:
            return number
        entries.append((os.fsdecode(name), digest.decode()))
    return entries


def _integrity_failure(model_name, version_dir):
    """The rule above: None when the folder passes, else (kind, message)."""
    origin = ""
    if os.path.exists(os.path.join(version_dir, ORIGIN)):
        with open(os.path.join(version_dir, ORIGIN)) as fh:
            origin = fh.readline().rstrip("\r\n")
    where = {"model": model_name, "folder": origin or os.path.realpath(version_dir)}
    try:
        with open(os.path.join(version_dir, MANIFEST), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return "missing_manifest", INTEGRITY_MESSAGES["missing_manifest"].format(**where)
    except OSError as exc:
        return "unreadable", INTEGRITY_MESSAGES["unreadable"].format(file=MANIFEST, reason=os.strerror(exc.errno or 5), **where)
    entries = read_manifest(data)
    if isinstance(entries, int):
        return "malformed", INTEGRITY_MESSAGES["malformed"].format(line=entries, **where)
    if not entries:
        return "empty", INTEGRITY_MESSAGES["empty"].format(**where)
    for name, want in entries:
        try:
            got = file_sha256(os.path.join(version_dir, name))
        except FileNotFoundError:
            return "missing_file", INTEGRITY_MESSAGES["missing_file"].format(file=name, **where)
        except OSError as exc:
            return "unreadable", INTEGRITY_MESSAGES["unreadable"].format(file=name, reason=os.strerror(exc.errno or 5), **where)
        if got != want:
            return "modified", INTEGRITY_MESSAGES["modified"].format(file=name, got=got[:16], want=want[:16], **where)
    return None


def check_integrity(model_name, version_dir):
    """Raise IntegrityError unless the version folder passes the SHA256SUMS rule above."""
    failure = _integrity_failure(model_name, version_dir)
    if failure is not None:
        raise IntegrityError(failure[1])


# --- the per-batch-size dispatch plan (PARAM_DISPATCH): one format, two readers -----------------
# This is the one specification. compile/dispatch.py `dispatch_parameter` writes it (and checks its
# text with parse_dispatch before it writes it); parse_dispatch below and the native backend's
# parse_dispatch (serve/runtime/native/scorestack_backend.c) read it, accepting and refusing exactly
# the same texts with the same messages (tests/test_contracts.py runs both on one set of cases).
#
#   The value is JSON, at most PLAN_MAX_BYTES bytes of UTF-8: a list of 1 to PLAN_MAX_BANDS band
#   objects, ascending by min_rows from 1. A joined batch of n rows runs on the last band whose
#   min_rows <= n. A band has exactly these keys, each at most once:
#     "min_rows"       required: an integer from 1 to PLAN_INT_MAX, above the previous band's
#     "runtime"        required: a name, the runner (a key of RUNNERS; the native backend: tl2cgen)
#     "artifact"       required: a name, the file inside the version folder
#     "output_column"  optional: null or an integer from 0 to PLAN_INT_MAX (keep that column of the raw output)
#     "method"         optional: null or a name (scikit-learn: predict_proba | predict)
#   A name is 1 to PLAN_NAME_MAX characters of A-Z a-z 0-9 . _ + - not starting with ".".
#   Whitespace between tokens is JSON's (space, tab, CR, LF); integers are JSON integers (1.0 is not).
#
# The checks run in this order and the first failure is the message: the text's length, JSON
# syntax, a list, its length, then band by band: an object, its first unknown key (in the text's
# order), its first repeated key, its missing keys (min_rows, runtime, artifact), min_rows, runtime,
# artifact, output_column, method, and min_rows against the previous band.
PLAN_MAX_BYTES = 16383
PLAN_MAX_BANDS = 16
PLAN_INT_MAX = 2147483647
PLAN_NAME_MAX = 255
PLAN_KEYS = ("min_rows", "runtime", "artifact", "output_column", "method")
PLAN_REQUIRED = ("min_rows", "runtime", "artifact")
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._+-")
_NAME_RULE = "letters, digits and . _ + -, not starting with ."


class PlanError(ValueError):
    """A dispatch plan that does not follow the format above; the message says where."""


class _Band(dict):
    keys_in_order = ()


def _band_object(pairs):
    band = _Band(pairs)
    band.keys_in_order = tuple(k for k, _ in pairs)
    return band


def _is_int(value, lo):
    return type(value) is int and lo <= value <= PLAN_INT_MAX


def _is_name(value):
    return type(value) is str and 0 < len(value) <= PLAN_NAME_MAX and not value.startswith(".") and all(c in _NAME_CHARS for c in value)


def parse_dispatch(text):
    """The bands of a dispatch plan (the format above) as dicts with all five keys; PlanError if it is not one."""
    if len(text.encode("utf-8", "surrogatepass")) > PLAN_MAX_BYTES:
        raise PlanError(f"longer than {PLAN_MAX_BYTES} bytes")
    try:
        bands = json.loads(text, object_pairs_hook=_band_object)
    except (ValueError, RecursionError):
        raise PlanError("not valid JSON") from None
    if type(bands) is not list:
        raise PlanError("not a JSON list of bands")
    if not bands:
        raise PlanError("no bands")
    if len(bands) > PLAN_MAX_BANDS:
        raise PlanError(f"more than {PLAN_MAX_BANDS} bands")
    plan = []
    for i, band in enumerate(bands, 1):
        if type(band) is not _Band:
            raise PlanError(f"band {i} is not a JSON object")
        keys = band.keys_in_order
        unknown = next((k for k in keys if k not in PLAN_KEYS), None)
        if unknown is not None:
            raise PlanError(f'band {i}: unknown key "{unknown[:63]}" (a band has {", ".join(PLAN_KEYS)})')
        repeated = next((k for j, k in enumerate(keys) if k in keys[:j]), None)
        if repeated is not None:
            raise PlanError(f'band {i}: key "{repeated}" appears twice')
        missing = next((k for k in PLAN_REQUIRED if k not in band), None)
        if missing is not None:
            raise PlanError(f'band {i}: "{missing}" is missing')
        if not _is_int(band["min_rows"], 1):
            raise PlanError(f"band {i}: min_rows must be an integer from 1 to {PLAN_INT_MAX}")
        for key in ("runtime", "artifact"):
            if not _is_name(band[key]):
                raise PlanError(f"band {i}: {key} must be a name ({_NAME_RULE})")
        column, method = band.get("output_column"), band.get("method")
        if column is not None and not _is_int(column, 0):
            raise PlanError(f"band {i}: output_column must be null or an integer from 0 to {PLAN_INT_MAX}")
        if method is not None and not _is_name(method):
            raise PlanError(f"band {i}: method must be null or a name ({_NAME_RULE})")
        if i == 1 and band["min_rows"] != 1:
            raise PlanError(f"band 1: min_rows must be 1 (the first band starts at one row), not {band['min_rows']}")
        if i > 1 and band["min_rows"] <= plan[-1]["min_rows"]:
            raise PlanError(f"band {i}: min_rows {band['min_rows']} does not ascend from band {i - 1}'s {plan[-1]['min_rows']}")
        plan.append({"min_rows": band["min_rows"], "runtime": band["runtime"], "artifact": band["artifact"], "output_column": column, "method": method})
    return plan


def plan_error_message(model_name, detail):
    """How a load reports an unreadable plan (the native backend words it the same)."""
    return f"model {model_name}: config parameter {PARAM_DISPATCH} cannot be read ({detail}); recompile the model (scorestack compile)"


# --- runners: one class per artifact format -------------------------------------------------------
class _Staging:
    """A runner's own input and output buffers for small batches, and its C call's arguments made once.

    Per call from Python, taking an array's address (`x.ctypes.data`) cost ~2.4 µs here (timeit,
    numpy 1.26, one core; twice a call, more than a shallow model's whole prediction) and ctypes'
    conversion of five plain arguments ~0.3 µs. A batch of up to `rows` rows is copied into the
    input buffer (cast as numpy assigns) and its outputs copied out; the arguments for each row
    count are built once by `make_args(n, x_address, out_address)`. The lock keeps the buffers to
    one caller at a time: the embedded runtime may call a runner from several threads, so a caller
    that finds them taken takes the runner's unstaged path instead of waiting.
    """

    ROWS = 64
    MAX_BYTES = 1 << 20  # a very wide model stages fewer rows (at least one), not megabytes of buffer

    def __init__(self, n_cols, in_dtype, out_shape, out_dtype, make_args, rows=ROWS):
        row_bytes = n_cols * np.dtype(in_dtype).itemsize + int(np.prod(out_shape)) * np.dtype(out_dtype).itemsize
        rows = max(1, min(rows, self.MAX_BYTES // max(1, row_bytes)))
        self.n_cols = n_cols
        self.x = np.zeros((rows, n_cols), dtype=in_dtype)
        self.out = np.zeros((rows, *out_shape), dtype=out_dtype)
        self.rows = rows
        self.lock = threading.Lock()
        self._make_args = make_args
        self._entries = {}

    def takes(self, x):
        """True (and the buffers held: call `release`) when `x` is a 2-D batch this staging holds."""
        return x.ndim == 2 and x.shape[0] <= self.rows and x.shape[1] == self.n_cols and self.lock.acquire(False)

    def entry(self, n):
        """(input rows, output rows, call arguments) for a batch of `n` rows, made once per row count."""
        entry = self._entries.get(n)
        if entry is None:
            x, out = self.x[:n], self.out[:n]
            entry = self._entries[n] = (x, out, self._make_args(n, x.ctypes.data, out.ctypes.data))
        return entry

    def release(self):
        self.lock.release()


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


class LightGBMRunner:
    """A LightGBM model file run by LightGBM itself, through its C API: one row through
    `LGBM_BoosterPredictForMatSingleRowFast` (its configuration parsed once, at load), a batch through
    `LGBM_BoosterPredictForMat` with `threads` threads. `Booster.predict` wraps the same functions;
    its per-call Python layer (input checks, parameter strings, output reshaping) is most of its time
    on one row. Outputs are `Booster.predict`'s: probabilities (binary: the positive class's; one
    column per class otherwise), the transformed score for other objectives."""

    def __init__(self, path, threads, params, output_names):
        import ctypes

        import lightgbm
        from lightgbm.basic import _LIB

        self.booster = lightgbm.Booster(model_file=path)
        self.ctypes, self.lib = ctypes, _LIB
        self.n_features = self.booster.num_feature()
        self.n_outputs = self.booster.num_model_per_iteration()
        self.parameter = f"num_threads={int(threads)}".encode()
        self.fast = ctypes.c_void_p()
        self._check(_LIB.LGBM_BoosterPredictForMatSingleRowFastInit(
            self.booster._handle, ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(0),  # normal predict, every tree, float32 rows
            ctypes.c_int32(self.n_features), ctypes.c_char_p(self.parameter), ctypes.byref(self.fast)))
        self.out_len = ctypes.c_int64()
        # One row: staged (_Staging) through the single-row function, called holding the GIL.
        single = ctypes.PyDLL(_LIB._name).LGBM_BoosterPredictForMatSingleRowFast
        single.restype = ctypes.c_int
        self.staged_single = single
        self.staging = _Staging(self.n_features, np.float32, (self.n_outputs,), np.float64, lambda n, xp, op: (
            self.fast, ctypes.c_void_p(xp), ctypes.byref(self.out_len), ctypes.c_void_p(op)), rows=1)

    def _check(self, status):
        if status != 0:
            raise RuntimeError(f"LightGBM: {self.lib.LGBM_GetLastError().decode(errors='replace')}")

    def run(self, inputs):
        ctypes = self.ctypes
        x = inputs[0][1]
        staging = self.staging
        if staging.takes(x):
            try:
                x_row, out_row, args = staging.entry(1)
                x_row[...] = x  # any dtype, cast as numpy assigns
                self._check(self.staged_single(*args))
                out = out_row.copy()
            finally:
                staging.release()
            return [out if self.n_outputs > 1 else out.reshape(1)]
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"LightGBM: expected rows of {self.n_features} features, got shape {list(x.shape)}")
        n = x.shape[0]
        if n == 1:  # the staging is taken by another thread
            one = np.empty(self.n_outputs, dtype=np.float64)
            self._check(self.lib.LGBM_BoosterPredictForMatSingleRowFast(
                self.fast, ctypes.c_void_p(x.ctypes.data), ctypes.byref(self.out_len), ctypes.c_void_p(one.ctypes.data)))
            out = one
        else:
            out = np.empty(n * self.n_outputs, dtype=np.float64)
            self._check(self.lib.LGBM_BoosterPredictForMat(
                self.booster._handle, ctypes.c_void_p(x.ctypes.data), ctypes.c_int(0), ctypes.c_int32(n), ctypes.c_int32(self.n_features),
                ctypes.c_int(1), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_char_p(self.parameter), ctypes.byref(self.out_len),
                ctypes.c_void_p(out.ctypes.data)))
        return [out.reshape(n, self.n_outputs) if self.n_outputs > 1 else out]

    def __del__(self):
        if getattr(self, "fast", None) and self.fast.value:
            self.lib.LGBM_FastConfigFree(self.fast)


class SklearnRunner:
    """A joblib-saved scikit-learn estimator; n_jobs set to `threads` (parallelism comes from instances)."""

    def __init__(self, path, threads, params, output_names):
        import joblib

        model = joblib.load(path)
        # Every n_jobs, nested ones included (a Pipeline's forest, a stacking ensemble's members): whatever the
        # user trained with (n_jobs=-1 is common), the model runs on the serving threads, in timing and serving alike.
        try:
            jobs = {k: threads for k in model.get_params(deep=True) if k == "n_jobs" or k.endswith("__n_jobs")}
            if jobs:
                model.set_params(**jobs)
        except (AttributeError, TypeError, ValueError):  # not a scikit-learn estimator, or a parameter it refuses
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
            # Staged batches (up to _Staging.ROWS rows) call the same function holding the GIL: a
            # release and re-take cost about 0.3 µs a call here (timeit).
            self.staged_batch = ctypes.PyDLL(os.path.abspath(path)).scorestack_predict_batch
            self.staged_batch.argtypes, self.staged_batch.restype = fn.argtypes, fn.restype
            self.staging = None  # made at the first call, which gives the column count
            self.ctypes = ctypes
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
            staging = getattr(self, "staging", None)
            if rc == -1 and staging is not None and staging.n_cols == n_cols:  # made for a request of the wrong width
                self.staging = None
            self._failed(rc, n_cols)

    @staticmethod
    def _failed(rc, n_cols):
        raise ValueError(f"TL2cgen library: {n_cols} input columns, the model was compiled for another number" if rc == -1 else f"TL2cgen library: error {rc}")

    def _run_batch(self, inputs):
        x = inputs[0][1]
        staging = self.staging
        if staging is None and x.ndim == 2:
            ctypes = self.ctypes
            staging = self.staging = _Staging(x.shape[1], np.float32, self.shape, self.dtype, lambda n, xp, op, c=x.shape[1]: (
                ctypes.c_void_p(xp), ctypes.c_int64(n), ctypes.c_int32(c), ctypes.c_int(0), ctypes.c_void_p(op)))
        if staging is not None and staging.takes(x):
            try:
                x_rows, out_rows, args = staging.entry(x.shape[0])
                x_rows[...] = x  # any dtype, cast as numpy assigns
                rc = self.staged_batch(*args)
                if rc != 0:
                    if rc == -1:  # made for a request of the wrong width: the next call makes it again
                        self.staging = None
                    self._failed(rc, staging.n_cols)
                return [out_rows.copy()]
            finally:
                staging.release()
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
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
    "lightgbm": LightGBMRunner,
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
        self._only = self.bands[0] if len(self.bands) == 1 else None
        # Each output's dtype and its shape after the rows (-1: as the runner returns it).
        self._tails = [(dtype, tuple(d if d > 0 else -1 for d in dims)) for _name, dtype, dims in self.outputs]

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
        band = self._only or self.band_for(n_rows)
        raw = band.runner.run(inputs)
        column = band.output_column
        outputs = []
        for (dtype, tail), value in zip(self._tails, raw):
            value = np.asarray(value)
            if column is not None:
                # e.g. predict_proba (n, 2) or TL2cgen's (n, 1, k): keep the column the compiler chose.
                flat = value.reshape(n_rows, -1)
                if flat.shape[1] > 1:
                    value = flat[:, column]
            value = value.reshape((n_rows, *tail) if self.batched else tail)
            outputs.append(np.ascontiguousarray(value.astype(dtype, copy=False)))
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
    """The bands the config declares: PARAM_DISPATCH's plan, or the single artifact as one band from 1 row."""
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
        if PARAM_DISPATCH not in params:
            raise PlanError("the parameter is missing")
        return parse_dispatch(params[PARAM_DISPATCH])
    except PlanError as exc:
        raise RuntimeLoadError(plan_error_message(name, exc)) from None


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
