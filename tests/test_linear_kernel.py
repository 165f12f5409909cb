"""scorestack's linear kernel (compile/linear_kernel.py): scikit-learn linear models with the scalers before
them, folded into one affine map and compiled to C, equal the source's predict / predict_proba for
every scaler it folds, with and without intercepts, binary, multiclass and regression; what it does
not express is refused by name. Real gcc, the runtime's ctypes runner; no mocks."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge, SGDClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MaxAbsScaler, MinMaxScaler, PolynomialFeatures, RobustScaler, StandardScaler
from sklearn.svm import LinearSVC

from scorestack.compile.linear_kernel import compile_linear_kernel
from scorestack.compile.registry import ConvertContext, Skip
from scorestack.serve.runtime.scorestack_runtime import TL2cgenRunner

N = 7


def _data(seed: int = 0, n: int = 600):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n, N)) * [1, 10, 100, 0.1, 1, 5, 1000] + [0, 3, -50, 0, 1, 0, 2e4]).astype(np.float32)
    z = X[:, 0] + 0.1 * X[:, 1] - 0.01 * X[:, 2] + 5 * X[:, 3] + 0.001 * (X[:, 6] - 2e4)
    return X, z


CASES = {
    "standard_logistic": ("binary", lambda: make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)), lambda z: (z > 0).astype(int)),
    "minmax_logistic_no_intercept": ("binary", lambda: make_pipeline(MinMaxScaler(), LogisticRegression(fit_intercept=False, max_iter=1000)), lambda z: (z > 0.5).astype(int)),
    "robust_maxabs_multinomial": ("multiclass", lambda: make_pipeline(RobustScaler(), MaxAbsScaler(), LogisticRegression(max_iter=2000)), lambda z: np.digitize(z, [-1, 1])),
    "standard_no_mean_multinomial": ("multiclass", lambda: make_pipeline(StandardScaler(with_mean=False), LogisticRegression(C=0.5, max_iter=2000)), lambda z: np.digitize(z, [-1, 0, 1])),
    "standard_sgd_log_loss_one_vs_rest": ("multiclass", lambda: make_pipeline(StandardScaler(), SGDClassifier(loss="log_loss", random_state=0)), lambda z: np.digitize(z, [-1, 1])),
    "bare_linear_regression": ("regression", lambda: LinearRegression(), lambda z: 300 * z + 40),
    "standard_ridge": ("regression", lambda: make_pipeline(StandardScaler(), Ridge(alpha=3.0)), lambda z: z * z + z),
    "ridge_ranker": ("ranking", lambda: make_pipeline(StandardScaler(), Ridge()), lambda z: np.clip(np.round(z + 1), 0, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_kernel_equals_the_source(case, tmp_path):
    task, make, label = CASES[case]
    X, z = _data()
    # The reference in float64 throughout, as the kernel computes (given float32 rows, scikit-learn's scalers
    # answer float32, and a model fitted on float32 keeps float32 weights: up to 6e-4 off at these feature
    # scales, which is the source's rounding, not the kernel's; the compiler's verification judges it).
    X64 = X.astype(np.float64)
    model = make().fit(X64[:400], label(z[:400]))
    art = compile_linear_kernel(model, tmp_path, ConvertContext(task=task, n_features=N, target="y", sample=X[:8]))
    assert art.format == "linear" and art.runtime == "tl2cgen" and art.path.name == "model-linear.so"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-linear.so"]  # the generated C is not left behind
    if task == "binary":
        want = model.predict_proba(X64)[:, 1:2]
    elif task == "multiclass":
        want = model.predict_proba(X64)
    else:  # regression, ranking
        want = model.predict(X64).reshape(-1, 1)
    runner = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    got = runner.run([("x", X)])[0].reshape(len(X), -1).astype(np.float64)
    assert art.output_column is None and got.shape == want.shape
    # float32 outputs: within their own rounding (probabilities absolute, regression relative)
    scores = task in ("regression", "ranking")
    np.testing.assert_allclose(got, want, rtol=1.2e-7 if scores else 0, atol=1e-9 if scores else 1e-7)
    for i in range(3):  # a lone row, through the runner's staging buffers
        np.testing.assert_array_equal(runner.run([("x", X[i : i + 1])])[0].reshape(1, -1), got[i : i + 1].astype(np.float32))


@pytest.mark.parametrize(
    "model, task, why",
    [
        (make_pipeline(PolynomialFeatures(2), LogisticRegression()), "binary", "pipeline step PolynomialFeatures: the linear kernel folds MaxAbsScaler, MinMaxScaler, RobustScaler, StandardScaler only"),
        (make_pipeline(MinMaxScaler(clip=True), LogisticRegression()), "binary", r"MinMaxScaler\(clip=True\): clipping is not an affine map"),
        (LinearSVC(), "binary", "LinearSVC: the linear kernel compiles"),
        (SGDClassifier(loss="hinge"), "binary", r"SGDClassifier\(loss='hinge'\): the linear kernel computes log_loss's probabilities only"),
        (LogisticRegression(), "regression", None),
        (Ridge(), "binary", "Ridge is a regressor; the spec's task is binary"),
    ],
)
def test_what_the_linear_kernel_does_not_express_is_refused_by_name(model, task, why, tmp_path):
    X, z = _data(1)
    y = (z > 0).astype(int) if task != "regression" or isinstance(model, LogisticRegression) else z
    model.fit(X[:300], y[:300])
    with pytest.raises(Skip, match=why or "LogisticRegression with 2 classes does not fit the spec's task regression"):
        compile_linear_kernel(model, tmp_path, ConvertContext(task=task, n_features=N, target="y", sample=X[:8]))


def test_several_regression_targets_are_refused(tmp_path):
    X, z = _data(2)
    model = LinearRegression().fit(X[:300], np.stack([z[:300], 2 * z[:300]], axis=1))
    with pytest.raises(Skip, match="LinearRegression with 2 targets: the linear kernel scores one"):
        compile_linear_kernel(model, tmp_path, ConvertContext(task="regression", n_features=N, target="y", sample=X[:8]))
