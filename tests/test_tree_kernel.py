"""scorestack's branch-free tree kernel (compile/tree_kernel.py) against TL2cgen and the source model:
the same numbers for XGBoost and scikit-learn ensembles, missing values, values exactly on the split
thresholds, every batch size and both thread paths of the runner that serves it; clear refusals for
the models it does not handle. Serving through Triton is in test_verified_served.py's matrix."""

from __future__ import annotations


import numpy as np
import pytest
import treelite
import xgboost as xgb
from sklearn.ensemble import GradientBoostingRegressor, HistGradientBoostingClassifier, RandomForestClassifier

from scorestack.compile._tree_commons import compile_tl2cgen
from scorestack.compile.registry import ConvertContext, Skip
from scorestack.compile.tree_kernel import compile_tree_kernel, model_dict, tree_arrays
from scorestack.serve.runtime.scorestack_runtime import TL2cgenRunner

XGB_CASES = {
    "binary": ({"objective": "binary:logistic", "max_depth": 6, "base_score": 0.3}, lambda X: (np.nan_to_num(X[:, 0]) + X[:, 1] > 0).astype(int)),
    "regression": ({"objective": "reg:squarederror", "max_depth": 4}, lambda X: np.nan_to_num(X[:, 0]) * 3 + X[:, 1]),
    "ranking": ({"objective": "rank:ndcg", "max_depth": 5}, lambda X: (np.nan_to_num(X[:, 0]) > 0).astype(int) + (X[:, 1] > 1)),
}


def _thresholds_as_rows(model: treelite.Model, X: np.ndarray) -> np.ndarray:
    """Rows whose values sit exactly on split thresholds (as float32): the `<` / `<=` edge."""
    d = model_dict(model)
    out = X[: len(X) // 2].copy()
    splits = [(n["split_feature_id"], n["threshold"]) for t in d["trees"] for n in t["nodes"] if "threshold" in n]
    for i in range(len(out)):
        f, t = splits[i % len(splits)]
        out[i, f] = np.float32(t)
    return out


def _data(seed: int, n: int = 1500, n_features: int = 13) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, n_features)).astype(np.float32)
    X[::3, 0] = np.nan  # missing values take the split's default direction
    X[::11, 5] = np.nan
    return X


@pytest.mark.parametrize("task", sorted(XGB_CASES))
def test_xgboost_kernel_equals_tl2cgen_and_the_source(task, tmp_path):
    X = _data(7)
    params, label = XGB_CASES[task]
    dtrain = xgb.DMatrix(X, label(X))
    if task == "ranking":
        dtrain.set_group([100] * 15)
    booster = xgb.train(params, dtrain, 40)
    model = treelite.frontend.from_xgboost(booster)
    X = np.concatenate([X, _thresholds_as_rows(model, X)])
    ctx = ConvertContext(task=task, n_features=13, target="y", sample=X[:8])
    (tmp_path / "k").mkdir()
    (tmp_path / "t").mkdir()
    art = compile_tree_kernel(model, tmp_path / "k", ctx)
    assert (art.format, art.runtime, art.artifact_name) == ("trees", "tl2cgen", "model-trees.so")
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["model-trees.so"]  # the C source is not left behind
    tl = compile_tl2cgen(model, tmp_path / "t", ctx)
    reference = TL2cgenRunner(str(tl.path), 1, {}, ["y"]).run([("features", X)])[0]
    one = TL2cgenRunner(str(art.path), 1, {}, ["y"])
    two = TL2cgenRunner(str(art.path), 2, {}, ["y"])  # over 256 rows: split over two threads
    assert one.pool is None and two.pool is not None
    for runner in (one, two):
        out = runner.run([("features", X)])[0]
        assert out.shape == reference.shape and out.dtype == reference.dtype
        # Same split decisions (one wrong turn would move a score by a leaf, ~1e-2); the sums differ
        # in the last bit only (TL2cgen adds each leaf as an 8-digit double literal).
        np.testing.assert_allclose(out, reference, rtol=0, atol=1e-6)
    whole = one.run([("features", X)])[0]
    for n in (1, 2, 63, 64, 65, 255, 256, 257):  # around the row block and the threads' cut-off
        np.testing.assert_array_equal(two.run([("features", X[:n])])[0], whole[:n])
    source = booster.predict(xgb.DMatrix(X), output_margin=task != "binary").reshape(len(X), -1)
    np.testing.assert_allclose(reference.reshape(len(X), -1), source, atol=2e-6)


def test_sklearn_float64_thresholds_and_le_splits_equal_the_source(tmp_path):
    """scikit-learn splits are `x <= t` with float64 thresholds: rounded to the float32 that decides
    every float32 input the same way (rows exactly on the thresholds included)."""
    X = np.nan_to_num(_data(11), nan=0.25)
    y = X[:, 0] * 2 + np.sin(X[:, 1]) + (X[:, 2] > 0.3)
    gbr = GradientBoostingRegressor(n_estimators=40, max_depth=4, random_state=0).fit(X, y)
    model = treelite.sklearn.import_model(gbr)
    edge = _thresholds_as_rows(model, X)
    # float64 thresholds: the float32 just below and just above each one too.
    below = edge.copy()
    above = edge.copy()
    for rows, direction in ((below, -np.inf), (above, np.inf)):
        rows[:] = np.nextafter(rows, np.float32(direction))
    X = np.concatenate([X, edge, below, above])
    art = compile_tree_kernel(model, tmp_path, ConvertContext(task="regression", n_features=13, target="y", sample=X[:8]))
    out = TL2cgenRunner(str(art.path), 1, {}, ["y"]).run([("features", X)])[0].reshape(-1)
    np.testing.assert_allclose(out, gbr.predict(X), rtol=0, atol=1e-5)


def test_hist_gradient_boosting_with_missing_values_equals_the_source(tmp_path):
    X = _data(12)
    y = (np.nan_to_num(X[:, 0], nan=1.0) + X[:, 1] > 0).astype(int)
    hgb = HistGradientBoostingClassifier(max_iter=30, max_depth=5, random_state=0).fit(X, y)
    model = treelite.sklearn.import_model(hgb)
    art = compile_tree_kernel(model, tmp_path, ConvertContext(task="binary", n_features=13, target="y", sample=X[:8]))
    out = TL2cgenRunner(str(art.path), 1, {}, ["y"]).run([("features", X)])[0].reshape(len(X), -1)
    np.testing.assert_allclose(out[:, -1], hgb.predict_proba(X)[:, 1], rtol=0, atol=1e-5)


def test_models_the_kernel_does_not_handle_are_refused_with_the_reason(tmp_path):
    X = np.nan_to_num(_data(13, n=400))
    multi = xgb.train({"objective": "multi:softprob", "num_class": 3}, xgb.DMatrix(X, (X[:, 0] > 0).astype(int) + (X[:, 1] > 1)), 5)
    with pytest.raises(Skip, match="one output per row"):
        tree_arrays(model_dict(treelite.frontend.from_xgboost(multi)))
    forest = RandomForestClassifier(n_estimators=5, max_depth=4, random_state=0).fit(X, (X[:, 0] > 0).astype(int))
    with pytest.raises(Skip, match="averaged trees|one output per row"):
        tree_arrays(model_dict(treelite.sklearn.import_model(forest)))
    # A chain of 11 splits: padded to a complete tree it would hold 2^11 leaves.
    chain = [{"node_id": i, "split_feature_id": 0, "threshold": float(i), "comparison_op": "<", "default_left": True, "left_child": 2 * i + 1 if i < 10 else 21, "right_child": 2 * i + 2 if i < 10 else 22} for i in range(11)]
    nodes = {n["node_id"]: n for n in chain}
    for i in range(11):  # every left child a leaf, the right one the next split
        nodes[i]["left_child"], nodes[i]["right_child"] = 100 + i, (i + 1 if i < 10 else 200)
    leaves = [{"node_id": 100 + i, "leaf_value": float(i)} for i in range(11)] + [{"node_id": 200, "leaf_value": -1.0}]
    deep = {"num_target": 1, "num_class": [1], "leaf_vector_shape": [1, 1], "postprocessor": "identity", "num_feature": 1, "trees": [{"nodes": list(nodes.values()) + leaves}]}
    with pytest.raises(Skip, match=r"depth 11 > 10"):
        tree_arrays(deep)
