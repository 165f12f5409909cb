"""scorestack's tree kernel (compile/tree_kernel.py) against TL2cgen and the source model: the same
numbers for XGBoost, scikit-learn and LightGBM ensembles, missing values, values exactly on the split
thresholds, every batch size and both thread paths of the runner that serves it; the complete-tree
layout's refusals, and the node layout taking those models (deep trees, classes, leaf vectors).
Serving through Triton is in test_verified_served.py's matrix and test_tree_models.py."""

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


def _node_layout_cases():
    import lightgbm as lgb
    from sklearn.datasets import make_classification

    X, y = make_classification(2000, 12, n_informative=6, n_classes=3, random_state=0)
    X = X.astype(np.float32)
    X[::7, 2] = np.nan  # missing values: each library's default direction
    filled = np.nan_to_num(X)  # random forests here are trained without missing values
    yb = (y > 0).astype(int)
    return {
        "xgboost-3-classes": (xgb.XGBClassifier(n_estimators=20, max_depth=6).fit(X, y), X, "multiclass", "xgboost"),
        "random-forest-binary": (RandomForestClassifier(15, random_state=0).fit(filled, yb), filled, "binary", "sklearn"),
        "random-forest-3-classes": (RandomForestClassifier(15, random_state=0).fit(filled, y), filled, "multiclass", "sklearn"),
        "hgb-deep-binary": (HistGradientBoostingClassifier(max_iter=40, random_state=0).fit(X, yb), X, "binary", "sklearn"),
        "hgb-3-classes": (HistGradientBoostingClassifier(max_iter=20, random_state=0).fit(X, y), X, "multiclass", "sklearn"),
        "lightgbm-deep-binary": (lgb.LGBMClassifier(n_estimators=40, num_leaves=63, verbose=-1).fit(X, yb), X, "binary", "lightgbm"),
        "lightgbm-3-classes": (lgb.LGBMClassifier(n_estimators=20, num_leaves=31, verbose=-1).fit(X, y), X, "multiclass", "lightgbm"),
    }


@pytest.mark.parametrize("case", ["xgboost-3-classes", "random-forest-binary", "random-forest-3-classes", "hgb-deep-binary", "hgb-3-classes", "lightgbm-deep-binary", "lightgbm-3-classes"])
def test_node_layout_equals_the_source_for_deep_trees_classes_and_leaf_vectors(case, tmp_path):
    """Trees the complete-tree layout refuses (deeper than 10, several classes, leaf vectors, averaged
    forests) take the node layout: every class probability equals the source library's, with missing
    values, at every batch size and on both thread paths; the report note says which layout and why."""
    source, X, task, kind = _node_layout_cases()[case]
    importers = {"xgboost": lambda m: treelite.frontend.from_xgboost(m.get_booster()), "sklearn": treelite.sklearn.import_model, "lightgbm": lambda m: treelite.frontend.from_lightgbm(m.booster_)}
    model = importers[kind](source)
    reference = source.predict_proba(X)
    art = compile_tree_kernel(model, tmp_path, ConvertContext(task=task, n_features=12, target="y", sample=X[:8]))
    assert "node layout" in art.notes[-1] and "not the complete-tree layout" in art.notes[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-trees.so"]  # no C source or node file left behind
    one, two = TL2cgenRunner(str(art.path), 1, {}, ["y"]), TL2cgenRunner(str(art.path), 2, {}, ["y"])
    out = one.run([("features", X)])[0].reshape(len(X), -1)
    if task == "binary":
        assert art.output_column in (None, 1)
        got = out[:, art.output_column] if art.output_column is not None else out[:, 0]
        np.testing.assert_allclose(got, reference[:, 1], rtol=0, atol=1e-6)
    else:
        assert out.shape == (len(X), 3)
        np.testing.assert_allclose(out, reference, rtol=0, atol=1e-6)
    for n in (1, 63, 64, 65, 257):
        np.testing.assert_array_equal(two.run([("features", X[:n])])[0].reshape(n, -1), out[:n])
