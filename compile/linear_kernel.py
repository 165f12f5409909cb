"""scorestack's linear kernel (format `linear`): a scikit-learn linear model, with the per-feature
scalers before it, compiled to C.

A Pipeline of scalers (StandardScaler, MinMaxScaler, MaxAbsScaler, RobustScaler, "passthrough") and
a linear model is one affine map of the raw features, `z = W x + b`, followed by the model's link:
the identity for a regressor, the logistic function for a binary LogisticRegression or SGDClassifier(loss="log_loss") (the
probability of `classes_[1]`), softmax for a multinomial LogisticRegression, normalized logistic
functions for a one-vs-rest one (SGDClassifier's multiclass). The scalers are folded into W and b (in float64) at compile time, so a row costs
one pass over its features per output. The library speaks the batch ABI of the tree kernel and
TL2cgen (`scorestack_predict_batch`, compile/_tree_commons.py), so the runtime's ctypes runner and
scorestack's native backend serve it: a lone request no longer pays the Python backend's round
trip to its stub process, which costs more than the model.

Anything else (polynomial features, one-hot encoders, a classifier without probabilities, several
regression targets) is refused by name; the other candidates (ONNX, scikit-learn itself) serve it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .registry import Artifact, ConvertContext, Skip

LINEAR_KERNEL_ARTIFACT = "model-linear.so"

REGRESSORS = frozenset({"LinearRegression", "Ridge", "RidgeCV", "Lasso", "LassoCV", "ElasticNet", "ElasticNetCV", "SGDRegressor", "BayesianRidge",
                        "HuberRegressor", "LassoLars", "Lars", "OrthogonalMatchingPursuit", "ARDRegression"})  # fmt: skip
CLASSIFIERS = frozenset({"LogisticRegression", "LogisticRegressionCV", "SGDClassifier"})
SCALERS = frozenset({"StandardScaler", "MinMaxScaler", "MaxAbsScaler", "RobustScaler"})


def _scaler(step: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The scaler as (scale, shift) per feature: it maps x to x * scale + shift."""
    name = type(step).__name__
    one, zero = np.ones(n), np.zeros(n)
    if name == "StandardScaler":
        mean = step.mean_ if getattr(step, "mean_", None) is not None and step.with_mean else zero
        scale = step.scale_ if getattr(step, "scale_", None) is not None and step.with_std else one
        return 1.0 / scale, -mean / scale
    if name == "MinMaxScaler":
        if step.clip:
            raise Skip("MinMaxScaler(clip=True): clipping is not an affine map")
        return np.asarray(step.scale_, float), np.asarray(step.min_, float)
    if name == "MaxAbsScaler":
        return 1.0 / np.asarray(step.scale_, float), zero
    if name == "RobustScaler":
        center = step.center_ if getattr(step, "center_", None) is not None and step.with_centering else zero
        scale = step.scale_ if getattr(step, "scale_", None) is not None and step.with_scaling else one
        return 1.0 / scale, -center / scale
    raise Skip(f"pipeline step {name}: the linear kernel folds {', '.join(sorted(SCALERS))} only")


def affine_form(model: Any, task: str, n_features: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(W [outputs, features], b [outputs], link) of a linear model or a Pipeline of scalers and one;
    link is identity, sigmoid, softmax or ovr. Raises Skip naming what it does not express."""
    steps = [s for _, s in model.steps] if hasattr(model, "steps") else [model]
    *pre, est = steps
    name = type(est).__name__
    scale, shift = np.ones(n_features), np.zeros(n_features)
    for step in pre:
        if step is None or step == "passthrough":
            continue
        s, t = _scaler(step, n_features)
        scale, shift = scale * s, shift * s + t
    if name in REGRESSORS:
        if task not in ("regression", "ranking"):
            raise Skip(f"{name} is a regressor; the spec's task is {task}")
        coef = np.atleast_2d(np.asarray(est.coef_, float))
        if coef.shape[0] != 1:
            raise Skip(f"{name} with {coef.shape[0]} targets: the linear kernel scores one")
        link = "identity"
    elif name in CLASSIFIERS:
        if name == "SGDClassifier" and est.loss != "log_loss":
            raise Skip(f"SGDClassifier(loss={est.loss!r}): the linear kernel computes log_loss's probabilities only")
        coef = np.atleast_2d(np.asarray(est.coef_, float))
        k = len(est.classes_)
        if task == "binary" and k == 2:
            link = "sigmoid"
        elif task == "multiclass" and k > 2:
            # SGDClassifier is one-vs-rest; LogisticRegression multinomial unless fitted one-vs-rest.
            multi_class = getattr(est, "multi_class", None)
            ovr = name == "SGDClassifier" or multi_class == "ovr" or (multi_class in (None, "auto", "deprecated") and est.solver == "liblinear")
            link = "ovr" if ovr else "softmax"
        else:
            raise Skip(f"{name} with {k} classes does not fit the spec's task {task}")
    else:
        raise Skip(f"{name}: the linear kernel compiles {', '.join(sorted(CLASSIFIERS | REGRESSORS))}")
    if coef.shape[1] != n_features:
        raise Skip(f"{name} takes {coef.shape[1]} features, the spec declares {n_features}")
    intercept = np.broadcast_to(np.asarray(getattr(est, "intercept_", 0.0), float), (coef.shape[0],))
    # W (x * scale + shift) + b = (W * scale) x + (W shift + b)
    return coef * scale, coef @ shift + intercept, link


def _doubles(a: np.ndarray) -> str:
    return ",".join(repr(float(v)) for v in a.reshape(-1))


def kernel_source(weights: np.ndarray, bias: np.ndarray, link: str) -> str:
    k, n = weights.shape
    if not (np.isfinite(weights).all() and np.isfinite(bias).all()):
        raise Skip("the folded weights are not finite (a scaler with a zero scale?)")
    finish = {
        "identity": "for (int j = 0; j < K; ++j) r[j] = (float)z[j];",
        "sigmoid": "r[0] = (float)(1.0 / (1.0 + exp(-z[0])));",
        "softmax": "double mx = z[0]; for (int j = 1; j < K; ++j) mx = z[j] > mx ? z[j] : mx; double s = 0; "
        "for (int j = 0; j < K; ++j) { z[j] = exp(z[j] - mx); s += z[j]; } for (int j = 0; j < K; ++j) r[j] = (float)(z[j] / s);",
        "ovr": "double s = 0; for (int j = 0; j < K; ++j) { z[j] = 1.0 / (1.0 + exp(-z[j])); s += z[j]; } "
        "for (int j = 0; j < K; ++j) r[j] = (float)(z[j] / s);",
    }[link]
    return f"""/* Generated by scorestack (compile/linear_kernel.py): {k} output(s) over {n} features, link {link}. */
#include <math.h>
#include <stdint.h>

#define K {k}
#define N_FEATURE {n}

static const double W[K * N_FEATURE] = {{{_doubles(weights)}}};
static const double B[K] = {{{_doubles(bias)}}};

const char* scorestack_result_type(void) {{ return "float"; }}
void scorestack_output_shape(int64_t* shape) {{ shape[0] = 1; shape[1] = K; }}

int scorestack_predict_batch(const float* X, int64_t n_rows, int32_t n_cols, int pred_margin, float* out) {{
  if (n_cols != N_FEATURE) return -1;
  for (int64_t i = 0; i < n_rows; ++i) {{
    const float* x = X + i * N_FEATURE;
    float* r = out + i * K;
    double z[K];
    for (int j = 0; j < K; ++j) {{
      const double* w = W + j * N_FEATURE;
      double acc = B[j];
      for (int f = 0; f < N_FEATURE; ++f) acc += w[f] * (double)x[f];
      z[j] = acc;
    }}
    if (pred_margin) {{ for (int j = 0; j < K; ++j) r[j] = (float)z[j]; continue; }}
    {finish}
  }}
  return 0;
}}
"""


def compile_linear_kernel(model: Any, workdir: Path, ctx: ConvertContext) -> Artifact:
    """The linear-kernel candidate of a scikit-learn linear model (format `linear`)."""
    from scorestack.serve.cbuild import build_library

    from ._tree_commons import batch_library_artifact

    weights, bias, link = affine_form(model, ctx.task, ctx.n_features)
    out = build_library(kernel_source(weights, bias, link), workdir / LINEAR_KERNEL_ARTIFACT, error=Skip, what="the linear kernel",
                        flags=("-O3", "-std=c99"), libs=("-lm",))
    how = f"linear kernel: {weights.shape[0]} output(s) over {weights.shape[1]} features, link {link}, the scalers folded into the weights"
    return batch_library_artifact("linear", out, ctx, [how])
