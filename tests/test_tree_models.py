"""Tree models users bring: tolerances that fit the task (absolute + relative), and refusals that name the setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scorestack.compile import verify
from scorestack.compile.model import Holdout
from scorestack.compile.spec import DEFAULT_RELATIVE_TOLERANCE


def _holdout(X: np.ndarray) -> Holdout:
    return Holdout(X=X, y=None, groups=None)


def _execute_with(outputs: np.ndarray):
    """A candidate whose outputs are fixed per row: rows are found by their first feature (the row index)."""

    def execute(X: np.ndarray, sizes: list[int]):
        return outputs[X[:, 0].astype(np.int64)], {}

    return execute


def _joblib_spec(tmp_path, name: str, model, X: np.ndarray, y: np.ndarray, task: str, extra: str = "") -> Path:
    """`model` saved as a user saves it (joblib), its held-out rows, and the spec a user writes first (+ `extra`)."""
    import joblib

    joblib.dump(model, tmp_path / f"{name}.joblib")
    np.savez(tmp_path / "holdout.npz", X=X, y=y)
    features = ", ".join(f"f{i}" for i in range(X.shape[1]))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\nsource: {{path: {name}.joblib, format: joblib, trusted: true}}\ntask: {task}\ninputs: {{features: [{features}]}}\nholdout: holdout.npz\n{extra}")
    return spec


def test_regression_in_the_hundreds_passes_with_the_relative_default():
    # float32 rounding of targets up to ±490: |Δ| up to ~2e-5 (a few ulps), more than the absolute 1e-5.
    rng = np.random.default_rng(0)
    ref = rng.uniform(-490, 490, size=(300, 1))
    cand = ref * (1 + 4e-8)
    X = np.arange(300, dtype=np.float32)[:, None]
    rel = DEFAULT_RELATIVE_TOLERANCE["regression"]
    assert rel == 1e-5
    v = verify.verify(_execute_with(cand), ref, _holdout(X), "regression", 1e-5, 32, rel)
    assert v.verified, v.reason
    assert v.max_abs_diff > 1e-5
    # Absolute only: refused, with the value that would have passed.
    v = verify.verify(_execute_with(cand), ref, _holdout(X), "regression", 1e-5, 32, 0.0)
    assert not v.verified
    need = verify.needed_tolerance(ref, cand, 0.0)
    assert v.reason.startswith(f"max |Δ| {v.max_abs_diff:.3g} > tolerance 1e-05; passes with verification.tolerance: ")
    suggested = float(v.reason.split("verification.tolerance: ")[1].split(" ")[0])
    assert need <= suggested <= need * 1.1
    # The suggestions do pass.
    assert verify.verify(_execute_with(cand), ref, _holdout(X), "regression", suggested, 32, 0.0).verified
    suggested_rel = float(v.reason.split("verification.relative_tolerance: ")[1].split(" ")[0])
    assert verify.verify(_execute_with(cand), ref, _holdout(X), "regression", 1e-5, 32, suggested_rel).verified


def test_relative_tolerance_does_not_excuse_large_errors():
    ref = np.linspace(-400, 400, 200)[:, None]
    cand = ref + 0.01
    X = np.arange(200, dtype=np.float32)[:, None]
    v = verify.verify(_execute_with(cand), ref, _holdout(X), "regression", 1e-5, 16, 1e-5)
    assert not v.verified
    assert "tolerance 1e-05 + 1e-05·|source|" in v.reason
    # Near zero the relative part adds nothing: 0.01 is needed in absolute terms.
    assert "passes with verification.tolerance: 0.01 " in v.reason
    # Where the source is 0 no relative tolerance can pass: only the absolute one is suggested.
    ref0 = np.zeros((10, 1))
    v = verify.verify(_execute_with(ref0 + 1e-3), ref0, _holdout(X[:10]), "regression", 1e-5, 4, 1e-5)
    assert "relative_tolerance:" not in v.reason and "verification.tolerance: 0.001 " in v.reason


@pytest.mark.parametrize("task, expected", [("binary", 0.0), ("multiclass", 0.0), ("ranking", 1e-5), ("regression", 1e-5)])
def test_spec_resolves_the_task_default_or_the_given_value(task, expected):
    from scorestack.compile.spec import ModelSpec

    base = {"name": "m", "source": {"format": "joblib", "path": "m.joblib", "trusted": True}, "task": task, "inputs": {"features": ["a"]}, "holdout": "h.npz"}
    assert ModelSpec.model_validate(base).relative_tolerance == expected
    given = ModelSpec.model_validate({**base, "verification": {"relative_tolerance": 3e-4}})
    assert given.relative_tolerance == 3e-4
    with pytest.raises(ValueError):
        ModelSpec.model_validate({**base, "verification": {"relative_tolerance": -1}})


@pytest.mark.slow
def test_regression_in_the_hundreds_compiles_and_is_served_within_the_stated_tolerance(tmp_path):
    """The spec a user writes first (no verification block) for a GradientBoostingRegressor with targets
    up to ±490: verified under the regression default, served by a real Triton and checked over gRPC."""
    from sklearn.ensemble import GradientBoostingRegressor

    from scorestack.compile import compile_model

    rng = np.random.default_rng(1)
    X = rng.normal(size=(900, 6)).astype(np.float32)
    y = X @ np.array([120.0, -80.0, 60.0, 30.0, -20.0, 10.0]) + 5 * rng.normal(size=900)
    y = y / np.abs(y).max() * 490
    model = GradientBoostingRegressor(n_estimators=40, max_depth=3, random_state=0).fit(X[:600], y[:600])
    spec = _joblib_spec(tmp_path, "gbr", model, X[600:], y[600:], "regression", "formats: [onnx, native, tl2cgen]\nbuild_budget_s: 0.001\n")
    report = compile_model(spec, tmp_path / "repo")
    assert (report.tolerance, report.relative_tolerance) == (1e-5, 1e-5)
    by = {c.format: c for c in report.candidates}
    assert by["onnx"].verified and by["native"].verified
    assert by["onnx"].max_abs_diff <= 1e-5 + 1e-5 * 490
    assert all(by[f].convert_s is not None and by[f].load_s is not None and by[f].verify_s is not None for f in ("onnx", "native"))
    assert report.serve_check.status == "passed"
    assert report.serve_check.max_abs_diff <= 1e-5 + 1e-5 * 490
    # The TL2cgen build could not finish within the spec's build_budget_s: stopped, skipped, its time counted.
    assert by["tl2cgen"].status == "skipped" and "`build_budget_s: 0.001`" in by["tl2cgen"].reason and by["tl2cgen"].convert_s is not None
    # Where the compile's time went: the phases add up to the duration, and the candidates' own times fit in theirs.
    assert set(report.phases_s) >= {"load", "passes", "worker", "candidates", "timing", "emit", "serve_check"}
    assert abs(sum(report.phases_s.values()) - report.duration_s) < 0.05
    spent = sum(t for c in report.candidates for t in (c.convert_s, c.load_s, c.verify_s) if t is not None)
    assert spent <= report.phases_s["candidates"]


def test_hummingbird_serves_a_gradient_boosting_regressor_one_row_at_a_time(tmp_path):
    """hummingbird's GEMM form of a GradientBoostingRegressor ends in `squeeze()`, which ONNX exported as a
    Squeeze of every size-1 axis: on one row it removed the batch axis and the next Transpose failed, so
    the candidate was refused ("row 0 at batch 1"). Its axes are now pinned at export: the candidate
    verifies, passes the serving check, and a real Triton answers lone rows and a batch over gRPC."""
    import onnx
    from sklearn.ensemble import GradientBoostingRegressor

    from scorestack.compile import compile_model

    rng = np.random.default_rng(2)
    X = rng.normal(size=(600, 6)).astype(np.float32)
    y = 3 * X[:, 0] - 2 * X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=600)
    model = GradientBoostingRegressor(n_estimators=20, max_depth=3, random_state=0).fit(X[:400], y[:400])
    spec = _joblib_spec(tmp_path, "gbr_hb", model, X[400:], y[400:], "regression", "formats: [hummingbird]\n")
    report = compile_model(spec, tmp_path / "repo")
    (cand,) = [c for c in report.candidates if c.format == "hummingbird"]
    assert cand.status == "selected", cand.reason
    assert report.serve_check.status == "passed", report.serve_check
    graph = onnx.load(str(tmp_path / "repo" / "gbr_hb" / str(report.version) / report.selected.artifact)).graph
    squeezes = [n for n in graph.node if n.op_type == "Squeeze"]
    assert squeezes and all(len(n.input) == 2 for n in squeezes)
    # Through the real Triton over gRPC: lone rows and a batch, as the source predicts.
    import tritonclient.grpc as grpcclient

    from conftest import LocalTriton

    with LocalTriton(tmp_path / "repo", models=["gbr_hb"]) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for rows in (X[400:401], X[401:402], X[410:426]):
                inp = grpcclient.InferInput("features", list(rows.shape), "FP32")
                inp.set_data_from_numpy(np.ascontiguousarray(rows))
                result = client.infer("gbr_hb", [inp], client_timeout=30)
                got = result.as_numpy(result.get_response().outputs[0].name).reshape(-1)
                np.testing.assert_allclose(got, model.predict(rows), rtol=1e-5, atol=1e-5)
        finally:
            client.close()


def test_the_runtime_runs_scikit_learn_models_on_the_serving_threads(tmp_path):
    """Whatever n_jobs the user trained with (-1, also nested in a Pipeline), the model runtime that times the native
    baseline and serves a scikit-learn model sets every n_jobs to the serving thread count; the scores are unchanged."""
    import joblib
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from scorestack.serve.runtime import scorestack_runtime as rt

    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 6)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(int)
    for k, model in enumerate((RandomForestClassifier(20, n_jobs=-1, random_state=0), make_pipeline(StandardScaler(), RandomForestClassifier(20, n_jobs=-1, random_state=0)))):
        model.fit(X, y)
        path = tmp_path / f"m{k}.joblib"
        joblib.dump(model, path)
        runner = rt.SklearnRunner(str(path), 1, {rt.PARAM_METHOD: "predict_proba"}, ["probabilities"])
        served = runner.method.__self__
        jobs = {name: v for name, v in served.get_params(deep=True).items() if name == "n_jobs" or name.endswith("__n_jobs")}
        assert jobs and set(jobs.values()) == {1}
        np.testing.assert_array_equal(runner.run([("features", X[:7])])[0], model.predict_proba(X[:7]))


@pytest.mark.slow
def test_a_multiclass_forest_is_served_by_the_tree_kernel_through_triton(tmp_path, server_environment):
    """A 3-class random forest grown without max_depth (leaf vectors, averaged, deeper than the
    complete-tree layout takes) compiled to the tree kernel's node layout only, loaded by the real
    local Triton and checked over gRPC against predict_proba (the compile's serving check), then
    asked again here through tritonclient."""
    from sklearn.datasets import make_classification
    from sklearn.ensemble import RandomForestClassifier

    import tritonclient.grpc as grpcclient

    from conftest import LocalTriton
    from scorestack.compile import compile_model

    X, y = make_classification(1500, 8, n_informative=5, n_classes=3, random_state=0)
    X = X.astype(np.float32)
    forest = RandomForestClassifier(25, random_state=0).fit(X[:1000], y[:1000])
    report = compile_model(_joblib_spec(tmp_path, "rf3", forest, X[1000:], y[1000:], "multiclass", "formats: [trees]\n"), tmp_path / "repo")
    trees = next(c for c in report.candidates if c.format == "trees")
    assert report.selected.format == "trees" and any("node layout" in n and "leaf vectors, averaged" in n for n in trees.notes)
    assert report.serve_check.status == "passed" and report.serve_check.max_abs_diff <= 1e-5
    with LocalTriton(tmp_path / "repo", server_env=server_environment, ready_timeout_s=300) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for rows in (X[1000:1064], X[1100:1101]):  # a batch (the default max_batch_size, 64) and a lone row
                inp = grpcclient.InferInput("features", list(rows.shape), "FP32")
                inp.set_data_from_numpy(np.ascontiguousarray(rows))
                result = client.infer("rf3", [inp], client_timeout=60)
                got = result.as_numpy(result.get_response().outputs[0].name)
                np.testing.assert_allclose(got.reshape(len(rows), 3), forest.predict_proba(rows), rtol=0, atol=1e-5)
        finally:
            client.close()


def test_a_deep_lightgbm_model_with_missing_values_is_served_by_the_node_layout_one_row_at_a_time(tmp_path, server_environment):
    """LightGBM's leaf-wise trees (63 leaves, deeper than the complete-tree layout takes) with NaN in
    the rows, compiled to the tree kernel only: its node layout walks a lone row over a doubled copy
    of it (NaN kept for splits whose missing values go left, +inf for those that go right). Lone rows
    with and without NaN and a batch, through the real Triton over gRPC, against LightGBM's predict."""
    import lightgbm as lgb
    import tritonclient.grpc as grpcclient

    from conftest import LocalTriton
    from scorestack.compile import compile_model

    rng = np.random.default_rng(4)
    X = rng.normal(size=(3000, 8)).astype(np.float32)
    y = (X[:, 0] + 0.7 * X[:, 1] * X[:, 2] - 0.5 * X[:, 3] ** 2 + 0.3 * rng.normal(size=3000) > 0).astype(int)
    X[rng.random(X.shape) < 0.1] = np.nan  # missing values the trees learn default directions for
    model = lgb.LGBMClassifier(n_estimators=40, num_leaves=63, min_child_samples=5, n_jobs=1, verbose=-1, random_state=0).fit(X[:2000], y[:2000])
    report = compile_model(_joblib_spec(tmp_path, "lgb_deep", model, X[2000:], y[2000:], "binary", "formats: [trees]\n"), tmp_path / "repo")
    trees = next(c for c in report.candidates if c.format == "trees")
    assert report.selected.format == "trees" and any("node layout" in n for n in trees.notes), trees.notes
    assert report.serve_check.status == "passed", report.serve_check
    lone = [i for i in range(2000, 2200) if np.isnan(X[i]).any()][:6] + [i for i in range(2000, 2200) if not np.isnan(X[i]).any()][:2]
    with LocalTriton(tmp_path / "repo", server_env=server_environment, ready_timeout_s=300) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for rows in [X[i : i + 1] for i in lone] + [X[2200:2264]]:
                inp = grpcclient.InferInput("features", list(rows.shape), "FP32")
                inp.set_data_from_numpy(np.ascontiguousarray(rows))
                result = client.infer("lgb_deep", [inp], client_timeout=60)
                got = result.as_numpy(result.get_response().outputs[0].name).reshape(len(rows), -1)[:, -1]
                np.testing.assert_allclose(got, model.booster_.predict(rows, num_threads=1), rtol=0, atol=1e-5)
        finally:
            client.close()
