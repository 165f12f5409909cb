"""In-process runners for each artifact kind: the same calls the serving model runtime makes.

A runner maps features [batch, n_features] float32 to the output tensor [batch, 1] (or [batch, k])
float32. Verification and timing both go through these, so what is measured is what is served.

Runtime contract (written into config.pbtxt `parameters`, read by serve/runtime/model.py):
  onnxruntime: InferenceSession(model.onnx, ORT_ENABLE_ALL, intra_op_num_threads=threads);
               run([output], {"features": x}).
  xgboost:     Booster(model_file=model.json); set_param(nthread=threads); inplace_predict(x).
  sklearn:     joblib.load(model.joblib); getattr(model, scorestack_method)(x).
  tl2cgen:     tl2cgen.Predictor(model.so, nthread=threads).predict(tl2cgen.DMatrix(x)).
  Then: reshape to [batch, -1]; if `scorestack_output_column` is set keep that column as [batch, 1];
  cast to float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from scorestack import schema

Runner = Callable[[np.ndarray], np.ndarray]


def _finish(out: np.ndarray, n: int, column: int | None) -> np.ndarray:
    out = np.asarray(out).reshape(n, -1)
    if column is not None:
        out = out[:, column : column + 1]
    return out.astype(np.float32, copy=False)


def onnx_session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def onnx_runner(path: Path, threads: int, output: str) -> Runner:
    sess = onnx_session(path, threads)
    outputs = [output]
    run = sess.run

    def _run(x: np.ndarray) -> np.ndarray:
        return run(outputs, {schema.INPUT_TENSOR: x})[0]

    return _run


def xgboost_runner(path: Path, threads: int, column: int | None) -> Runner:
    import xgboost as xgb

    booster = xgb.Booster(model_file=str(path))
    booster.set_param({"nthread": threads})
    predict = booster.inplace_predict

    def _run(x: np.ndarray) -> np.ndarray:
        return _finish(predict(x), len(x), column)

    return _run


def sklearn_runner(path: Path, threads: int, method: str, column: int | None) -> Runner:
    import joblib

    model = joblib.load(path)
    for attr in ("n_jobs",):  # one process per instance; parallelism comes from instances
        if hasattr(model, attr):
            try:
                model.set_params(**{attr: threads})
            except ValueError:
                pass
    fn = getattr(model, method)

    def _run(x: np.ndarray) -> np.ndarray:
        return _finish(fn(x), len(x), column)

    return _run


def tl2cgen_runner(path: Path, threads: int, column: int | None) -> Runner:
    import tl2cgen

    predictor = tl2cgen.Predictor(str(path), nthread=threads)
    DMatrix = tl2cgen.DMatrix

    def _run(x: np.ndarray) -> np.ndarray:
        return _finish(predictor.predict(DMatrix(x)), len(x), column)

    return _run
