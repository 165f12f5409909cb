"""Early-stopped XGBoost and LightGBM models are served as the API that saved them predicts.

XGBoost keeps every round it trained and records `best_iteration`: its scikit-learn predict (an
XGBClassifier, or a file it saved) uses the rounds up to the best iteration, `Booster.predict` (a
model from `xgb.train`) uses them all. The compiler serves the same by default and
`source.iterations` chooses; the compile report says which. LightGBM predicts with its best
iteration through either API, and so does every format. Checked through a real Triton against the
libraries' own predictions on rows the compiler never saw.
"""

from __future__ import annotations

import joblib
import lightgbm as lgb
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
from conftest import LocalTriton

from scorestack.compile import compile_model

FEATURES = ["a", "b", "c", "d", "e"]


def _data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, len(FEATURES))).astype(np.float32)
    y = (X[:, 0] + X[:, 1] ** 2 + rng.normal(scale=0.8, size=n) > 1).astype(int)
    return X, y


def _spec(d, name: str, source: str, fmt: str, extra: str = "") -> str:
    trusted = ", trusted: true" if fmt == "joblib" else ""
    path = d / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nsource: {{path: {source}, format: {fmt}{trusted}{extra}}}\ntask: binary\n"
        f"inputs: {{features: [{', '.join(FEATURES)}]}}\nholdout: holdout.npz\nformats: [trees]\n"
    )
    return str(path)


@pytest.mark.slow
def test_early_stopped_models_serve_what_their_api_predicts(tmp_path, server_environment):
    X, y = _data(0, 3000)
    np.savez(tmp_path / "holdout.npz", X=X[2500:], y=y[2500:])
    params = {"max_depth": 4, "learning_rate": 0.3, "n_jobs": 1}
    clf = xgb.XGBClassifier(n_estimators=400, early_stopping_rounds=10, **params)
    clf.fit(X[:2000], y[:2000], eval_set=[(X[2000:2500], y[2000:2500])], verbose=False)
    clf.save_model(tmp_path / "sk.json")
    joblib.dump(clf, tmp_path / "sk.joblib")
    bst = xgb.train({"objective": "binary:logistic", "max_depth": 4, "eta": 0.3, "nthread": 1}, xgb.DMatrix(X[:2000], y[:2000]), 400,
                    evals=[(xgb.DMatrix(X[2000:2500], y[2000:2500]), "v")], early_stopping_rounds=10, verbose_eval=False)
    bst.save_model(tmp_path / "raw.json")
    lgb_clf = lgb.LGBMClassifier(n_estimators=400, num_leaves=15, learning_rate=0.2, verbose=-1, n_jobs=1)
    lgb_clf.fit(X[:2000], y[:2000], eval_set=[(X[2000:2500], y[2000:2500])], callbacks=[lgb.early_stopping(10, verbose=False)])
    joblib.dump(lgb_clf, tmp_path / "lgb_sk.joblib")
    # A Booster that kept training state holds every tree; its predict uses the best iteration.
    lgb_bst = lgb.train({"objective": "binary", "num_leaves": 15, "learning_rate": 0.2, "verbose": -1, "num_threads": 1},
                        lgb.Dataset(X[:2000], y[:2000]), 400, valid_sets=[lgb.Dataset(X[2000:2500], y[2000:2500])],
                        callbacks=[lgb.early_stopping(10, verbose=False)], keep_training_booster=True)
    assert lgb_bst.best_iteration < lgb_bst.current_iteration()
    joblib.dump(lgb_bst, tmp_path / "lgb_train.joblib")
    rounds, best = bst.num_boosted_rounds(), bst.best_iteration
    assert best + 1 < rounds and clf.best_iteration + 1 < clf.get_booster().num_boosted_rounds()  # it did stop early

    specs = {
        "es_sklearn_file": _spec(tmp_path, "es_sklearn_file", "sk.json", "xgboost-json"),
        "es_sklearn_object": _spec(tmp_path, "es_sklearn_object", "sk.joblib", "joblib"),
        "es_train": _spec(tmp_path, "es_train", "raw.json", "xgboost-json"),
        "es_train_best": _spec(tmp_path, "es_train_best", "raw.json", "xgboost-json", ", iterations: best"),
        "es_sklearn_all": _spec(tmp_path, "es_sklearn_all", "sk.json", "xgboost-json", ", iterations: all"),
        "es_lgb_sklearn": _spec(tmp_path, "es_lgb_sklearn", "lgb_sk.joblib", "joblib"),
        "es_lgb_train": _spec(tmp_path, "es_lgb_train", "lgb_train.joblib", "joblib"),
    }
    # The test serves every model below in one Triton: the per-compile load check is skipped.
    reports = {name: compile_model(spec, tmp_path / "repo", serve_check=False) for name, spec in specs.items()}
    sk_keep, sk_rounds = clf.best_iteration + 1, clf.get_booster().num_boosted_rounds()
    text = {name: r.source.description for name, r in reports.items()}  # the report's source line
    assert f"the {sk_keep} rounds up to its best iteration of {sk_rounds} trained, as XGBoost's scikit-learn predict does" in text["es_sklearn_file"]
    assert f"the {sk_keep} rounds up to its best iteration of {sk_rounds} trained" in text["es_sklearn_object"]
    assert f"every one of its {rounds} rounds, as Booster.predict does, though early stopping found the best at {best + 1}" in text["es_train"]
    assert f"the {best + 1} rounds up to its best iteration of {rounds} trained, `source.iterations: best`" in text["es_train_best"]
    assert f"every one of its {sk_rounds} rounds, `source.iterations: all`" in text["es_sklearn_all"]

    Xt, _ = _data(9, 300)
    dt = xgb.DMatrix(Xt)
    want = {
        "es_sklearn_file": clf.predict_proba(Xt)[:, 1],
        "es_sklearn_object": clf.predict_proba(Xt)[:, 1],
        "es_train": bst.predict(dt),
        "es_train_best": bst.predict(dt, iteration_range=(0, best + 1)),
        "es_sklearn_all": clf.get_booster().predict(dt),
        "es_lgb_sklearn": lgb_clf.predict_proba(Xt)[:, 1],
        "es_lgb_train": lgb_bst.predict(Xt),
    }
    assert np.abs(want["es_lgb_train"] - lgb_bst.predict(Xt, num_iteration=lgb_bst.current_iteration())).max() > 0.01
    # The two readings of one file really differ: the test tells them apart.
    assert np.abs(want["es_train"] - want["es_train_best"]).max() > 0.01
    assert np.abs(want["es_sklearn_file"] - want["es_sklearn_all"]).max() > 0.01
    with LocalTriton(tmp_path / "repo", server_env=server_environment, ready_timeout_s=300) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            def infer(name: str, x: np.ndarray) -> np.ndarray:
                inp = grpcclient.InferInput("features", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                result = client.infer(name, [inp], client_timeout=60)
                return result.as_numpy(result.get_response().outputs[0].name).reshape(-1)

            for name in specs:  # batches of 64 (max_batch_size) and lone rows
                got = np.concatenate([infer(name, Xt[i : i + 64]) for i in range(0, len(Xt), 64)] + [infer(name, Xt[i : i + 1]) for i in range(3)])
                expected = np.concatenate([want[name], want[name][:3]])
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{name} ({reports[name].selected.format})")
        finally:
            client.close()
