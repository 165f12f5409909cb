"""LightGBM sources: a native model text file and a scikit-learn API object (joblib) compile from the spec a
user writes, are served by a real Triton equal to LightGBM's own predict, and what no converter can
express is refused with the training setting that causes it."""

from __future__ import annotations

import joblib
import lightgbm as lgb
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import LocalTriton

from scorestack.compile import compile_model
from scorestack.errors import SpecError, VerificationError

FEATURES = ["a", "b", "c", "d", "e"]
TOLERANCE = 1e-5  # probabilities: absolute; regression: + TOLERANCE * |source| (the task's relative default)


def _rows(seed: int, n: int, categorical: bool = False, zeros: bool = False) -> np.ndarray:
    """Gaussian rows with 5% NaN (LightGBM learns a side for missing values; the converters must keep it);
    `zeros`: 10% exact 0.0 as well (missing, for a model trained with zero_as_missing=True)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, len(FEATURES))).astype(np.float32)
    X[rng.random(X.shape) < 0.05] = np.nan
    if zeros:
        X[rng.random(X.shape) < 0.1] = 0.0
    if categorical:  # column e: category codes 0..9, plus ones never seen in training (12), negative (-1: missing) and NaN
        X[:, 4] = rng.integers(0, 10, n)
        X[rng.random(n) < 0.03, 4] = 12
        X[rng.random(n) < 0.03, 4] = -1
        X[rng.random(n) < 0.03, 4] = np.nan
    return X


def _spec(path, name: str, source: str, fmt: str, task: str, extra: str = "") -> None:
    trusted = ", trusted: true" if fmt == "joblib" else ""
    path.joinpath(f"{name}.yaml").write_text(
        f"name: {name}\nsource: {{path: {source}, format: {fmt}{trusted}}}\ntask: {task}\n"
        f"inputs: {{features: [{', '.join(FEATURES)}]}}\nholdout: {name}.npz\n{extra}"
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Six small models (20-40 trees) compiled into one repository: {name: (report, LightGBM's predict, rows kind)}."""
    d = tmp_path_factory.mktemp("lightgbm")
    X, Xc = _rows(0, 1400), _rows(1, 1400, categorical=True)
    z = np.nan_to_num(X)
    y_bin = (z[:, 0] + z[:, 1] ** 2 - 0.5 * z[:, 2] > 1).astype(int)
    y_multi = (z[:, 0] > 0).astype(int) + (z[:, 1] > 0.5)
    y_reg = 30 * z[:, 0] + 10 * z[:, 1] ** 2 - 5 * z[:, 3]
    y_cat = (np.nan_to_num(Xc[:, 0]) + (Xc[:, 4] % 3 == 0) > 0.5).astype(int)
    params = {"verbose": -1, "num_threads": 1, "num_leaves": 15, "max_depth": 5, "seed": 0}
    # Native text file, binary: every candidate (max_depth 5 keeps the trees within the tree kernel's depth).
    lgb.train({**params, "objective": "binary"}, lgb.Dataset(X[:1000], y_bin[:1000]), num_boost_round=40).save_model(d / "binary.txt")
    np.savez(d / "lgb_binary.npz", X=X[1000:], y=y_bin[1000:])
    _spec(d, "lgb_binary", "binary.txt", "lightgbm-text", "binary")
    # scikit-learn API objects saved with joblib; each restricted to one format, so ONNX and the tree kernel both serve.
    multi = lgb.LGBMClassifier(n_estimators=30, **params).fit(X[:1000], y_multi[:1000])
    joblib.dump(multi, d / "multi.joblib")
    np.savez(d / "lgb_multi.npz", X=X[1000:], y=y_multi[1000:])
    _spec(d, "lgb_multi", "multi.joblib", "joblib", "multiclass", "formats: [onnx]\n")
    reg = lgb.LGBMRegressor(n_estimators=40, **params).fit(X[:1000], y_reg[:1000])
    joblib.dump(reg, d / "reg.joblib")
    np.savez(d / "lgb_reg.npz", X=X[1000:], y=y_reg[1000:])
    _spec(d, "lgb_reg", "reg.joblib", "joblib", "regression", "formats: [trees]\n")
    # Categorical splits (`categorical_feature`): TL2cgen and ONNX express them, the tree kernel does not.
    cat_params = {**params, "objective": "binary", "min_data_per_group": 5, "cat_smooth": 1}
    lgb.train(cat_params, lgb.Dataset(Xc[:1000], y_cat[:1000], categorical_feature=[4]), num_boost_round=30).save_model(d / "cat.txt")
    np.savez(d / "lgb_cat.npz", X=Xc[1000:], y=y_cat[1000:])
    _spec(d, "lgb_cat", "cat.txt", "lightgbm-text", "binary", "formats: [onnx, tl2cgen, trees]\n")

    # What only LightGBM computes, every format allowed: linear trees (a regressor) and zero_as_missing (rows with 0.0).
    Xz = _rows(2, 1400, zeros=True)
    lgb.train({**params, "objective": "regression", "linear_tree": True}, lgb.Dataset(X[:1000], y_reg[:1000]), num_boost_round=20).save_model(d / "linear.txt")
    np.savez(d / "lgb_linear.npz", X=X[1000:], y=y_reg[1000:])
    _spec(d, "lgb_linear", "linear.txt", "lightgbm-text", "regression")
    y_zero = (np.nan_to_num(Xz[:, 0]) + (Xz[:, 1] == 0) > 0.3).astype(int)
    lgb.train({**params, "objective": "binary", "zero_as_missing": True}, lgb.Dataset(Xz[:1000], y_zero[:1000]), num_boost_round=30).save_model(d / "zero.txt")
    np.savez(d / "lgb_zero.npz", X=Xz[1000:], y=y_zero[1000:])
    _spec(d, "lgb_zero", "zero.txt", "lightgbm-text", "binary")

    boosters = {name: lgb.Booster(model_file=str(d / f"{name}.txt")) for name in ("binary", "cat", "linear", "zero")}
    column = lambda b: lambda X: b.predict(X)[:, None]
    predict = {
        "lgb_binary": (column(boosters["binary"]), "plain"),
        "lgb_multi": (multi.predict_proba, "plain"),
        "lgb_reg": (lambda X: reg.predict(X)[:, None], "plain"),
        "lgb_cat": (column(boosters["cat"]), "categorical"),
        "lgb_linear": (column(boosters["linear"]), "plain"),
        "lgb_zero": (column(boosters["zero"]), "zeros"),
    }
    repo = d / "repo"
    return repo, {name: (compile_model(d / f"{name}.yaml", repo), fn, kind) for name, (fn, kind) in predict.items()}


@pytest.mark.slow
def test_lightgbm_candidates_verify_or_are_refused_with_the_setting(compiled):
    _, models = compiled
    reports = {name: report for name, (report, _, _) in models.items()}
    for name, report in reports.items():
        assert report.serve_check.status == "passed", (name, report.serve_check.reason)
        assert report.source.family == "lightgbm" and report.source.n_trees in (20, 30, 40, 90), (name, report.source)
    by = {c.format: c for c in reports["lgb_binary"].candidates}
    for fmt in ("tl2cgen", "trees", "onnx", "native"):
        assert by[fmt].verified and by[fmt].max_abs_diff <= TOLERANCE, (fmt, by[fmt].reason)
    assert by["native"].latency_us["1"] > 0
    assert by["hummingbird"].status == "skipped" and "missing-value" in by["hummingbird"].reason
    # Which verified format (or per-batch-size dispatch of them) wins is the measurement's call.
    assert reports["lgb_binary"].selected.format in ("tl2cgen", "trees", "onnx", "dispatch")
    assert reports["lgb_multi"].selected.format == "onnx" and reports["lgb_reg"].selected.format == "trees"
    cat = {c.format: c for c in reports["lgb_cat"].candidates}
    assert cat["onnx"].verified and cat["tl2cgen"].verified
    assert cat["trees"].status == "skipped" and "`categorical_feature`" in cat["trees"].reason
    # Linear trees and zero_as_missing: every other format refuses them by name; LightGBM itself serves them.
    for name, setting in (("lgb_linear", "`linear_tree=True`"), ("lgb_zero", "`zero_as_missing=True`")):
        cands = {c.format: c for c in reports[name].candidates}
        assert reports[name].selected.format == "native" and cands["native"].max_abs_diff <= TOLERANCE, (name, cands["native"])
        for fmt in ("tl2cgen", "trees", "onnx"):
            assert cands[fmt].status == "skipped" and setting in cands[fmt].reason and "native" in cands[fmt].reason, (name, fmt, cands[fmt].reason)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:X does not have valid feature names")  # the estimators' own predict on a bare array
def test_served_scores_equal_lightgbm_predict(compiled, server_environment):
    """Rows the compiler never saw, over gRPC (batches of 64 and batch 1), against LightGBM's own predict."""
    repo, models = compiled
    with LocalTriton(repo, server_env=server_environment, ready_timeout_s=300) as server:
        assert set(server.ready_models()) == set(models)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for name, (report, predict, kind) in sorted(models.items()):
                X = _rows(7, 200, categorical=kind == "categorical", zeros=kind == "zeros")
                want = np.asarray(predict(X), dtype=np.float64)
                got = np.concatenate([_infer(client, name, X[i : i + 64]) for i in range(0, len(X), 64)] + [_infer(client, name, X[:3][i : i + 1]) for i in range(3)])
                want = np.concatenate([want, want[:3]])
                assert got.shape == want.shape, name
                np.testing.assert_allclose(got, want, rtol=TOLERANCE if name == "lgb_reg" else 0, atol=TOLERANCE, err_msg=f"{name} ({report.selected.format})")
        finally:
            client.close()


def _infer(client: grpcclient.InferenceServerClient, name: str, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    result = client.infer(name, [inp], client_timeout=60)
    return result.as_numpy(result.get_response().outputs[0].name).astype(np.float64)


def _train_and_spec(tmp_path, params: dict, task: str = "binary", formats: str = "", rounds: int = 10) -> str:
    X = _rows(3, 600)
    z = np.nan_to_num(X)
    y = (z[:, 0] + z[:, 1] > 0.3).astype(int) if task == "binary" else (z[:, 0] > 0).astype(int) + (z[:, 1] > 0.5)
    base = {"verbose": -1, "num_threads": 1, "num_leaves": 7, "objective": "binary", "seed": 0}
    lgb.train({**base, **params}, lgb.Dataset(X[:400], y[:400]), num_boost_round=rounds).save_model(tmp_path / "m.txt")
    np.savez(tmp_path / "m.npz", X=X[400:], y=y[400:])
    _spec(tmp_path, "m", "m.txt", "lightgbm-text", task, formats)
    return str(tmp_path / "m.yaml")


@pytest.mark.parametrize(
    "params, setting",
    [
        ({"linear_tree": True}, "`linear_tree=True`"),  # Treelite refuses it, onnxmltools drops the linear terms
        ({"zero_as_missing": True}, "`zero_as_missing=True`"),  # every converter compares 0.0 as a number
    ],
)
def test_what_only_lightgbm_computes_is_refused_by_every_other_format_naming_the_setting(tmp_path, params, setting):
    """Without the native candidate (the spec's formats), no format can serve the model: the refusal names the setting for each."""
    with pytest.raises(VerificationError) as info:
        compile_model(_train_and_spec(tmp_path, params, formats="formats: [onnx, tl2cgen, trees]\n"), tmp_path / "repo")
    text = str(info.value)
    for fmt in ("onnx", "tl2cgen", "trees"):
        reason = text.split(f"; {fmt}: ")[1].split("; native:")[0].split("; trees:")[0].split("; hummingbird:")[0]
        assert setting in reason and "only LightGBM itself" in reason and "(the `native` candidate)" in reason, (fmt, text)
    assert "native: not listed in the spec's `formats`" in text
    assert not (tmp_path / "repo" / "m").exists()


@pytest.mark.parametrize(
    "params, task, setting",
    [
        ({"boosting": "rf", "bagging_freq": 1, "bagging_fraction": 0.7}, "binary", "`boosting=rf`"),  # onnxmltools sums the averaged trees
        ({"objective": "multiclassova", "num_class": 3}, "multiclass", "objective multiclassova"),  # onnxmltools normalizes the sigmoids
    ],
)
def test_onnx_refuses_what_onnxmltools_gets_wrong(tmp_path, params, task, setting):
    """Converted, these verify wrong (0.45 and 0.58 off): refused before converting, with the setting named."""
    with pytest.raises(VerificationError, match=f"onnx: .*{setting}"):
        compile_model(_train_and_spec(tmp_path, params, task, "formats: [onnx]\n"), tmp_path / "repo")


def test_objective_that_does_not_fit_the_task_is_refused(tmp_path):
    spec = _train_and_spec(tmp_path, {})
    text = open(spec).read().replace("task: binary", "task: regression")
    open(spec, "w").write(text)
    with pytest.raises(SpecError, match="field `task`: the LightGBM model's objective is 'binary'"):
        compile_model(spec, tmp_path / "repo")


def test_pruning_keeps_a_real_prefix_of_lightgbm_iterations():
    """The pruning pass on a LightGBM Booster: a smaller Booster equal to LightGBM's own first-k-iterations predict."""
    from scorestack.compile.model import Holdout, SourceModel
    from scorestack.compile.passes import prune
    from scorestack.compile.spec import PruningSpec

    X = _rows(5, 1600)
    z = np.nan_to_num(X)
    y = (z[:, 0] + z[:, 1] ** 2 > 1).astype(int)
    booster = lgb.train({"objective": "binary", "verbose": -1, "num_threads": 1, "num_leaves": 7, "seed": 0}, lgb.Dataset(X[:1000], y[:1000]), num_boost_round=60)
    source = SourceModel("m", "binary", "lightgbm", booster, len(FEATURES), 2, "binary")
    pruned, report = prune(source, Holdout(X[1000:], y[1000:], None), PruningSpec(quality_budget=0.05))
    assert report.accepted and report.trees_before == 60 and report.trees_after < 60, report
    k = report.trees_after
    assert pruned.family == "lightgbm" and pruned.n_trees == k and pruned.history == [f"pruned to {k} rounds"]
    np.testing.assert_array_equal(pruned.predict(X[1000:])[:, 0], booster.predict(X[1000:], num_iteration=k, num_threads=1))


def test_lightgbm_runner_lone_rows_through_its_staging_equal_predict_on_concurrent_threads(tmp_path):
    """The native LightGBM runner's lone row goes through its staged single-row call: float64 rows are
    cast, each call keeps its own output, and callers on several threads at once (some finding the
    buffer taken) each get LightGBM's predict of their own row; batches go through PredictForMat."""
    from concurrent.futures import ThreadPoolExecutor

    from scorestack.serve.runtime.scorestack_runtime import LightGBMRunner

    X = _rows(3, 600)
    z = np.nan_to_num(X)
    for objective, y, extra in (("binary", (z[:, 0] + z[:, 1] > 0).astype(int), {}),
                                ("multiclass", (z[:, 0] > 0).astype(int) + (z[:, 1] > 0.5), {"num_class": 3})):
        path = tmp_path / f"{objective}.txt"
        lgb.train({"verbose": -1, "num_threads": 1, "num_leaves": 15, "objective": objective, **extra}, lgb.Dataset(X, y), num_boost_round=20).save_model(path)
        reference = lgb.Booster(model_file=str(path)).predict(X, num_threads=1)
        runner = LightGBMRunner(str(path), 1, {}, ["y"])
        first = runner.run([("features", X[:1])])[0]
        second = runner.run([("features", X[1:2].astype(np.float64))])[0]
        assert first.shape == reference[:1].shape
        np.testing.assert_allclose(first, reference[:1], rtol=1e-12)
        np.testing.assert_allclose(second, reference[1:2], rtol=1e-12)
        np.testing.assert_allclose(first, reference[:1], rtol=1e-12)  # not overwritten by the second call
        np.testing.assert_allclose(runner.run([("features", X[:50])])[0], reference[:50], rtol=1e-12)

        def one(i, runner=runner):
            return runner.run([("features", X[i : i + 1])])[0]

        with ThreadPoolExecutor(8) as pool:
            got = np.concatenate(list(pool.map(one, range(len(X)))))
        np.testing.assert_allclose(got, reference, rtol=1e-12)
