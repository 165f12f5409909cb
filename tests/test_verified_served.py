"""Verified means served: every format forced for every task and source family, compiled, then served
by the real local Triton over gRPC and compared with the source model's own predictions, row by row.

Models here are ones the demo never made (an XGBClassifier with base_score 0.3, multiclass forests,
a linear Pipeline, a HistGradientBoostingClassifier pickled under numpy 2, LightGBM multiclass and
lambdarank model files). A refusal must carry
its reason and leave nothing in the repository; nothing may verify and then fail to load. The same
folders then run in the embedded mode (no Triton), as the source predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import joblib
import lightgbm as lgb
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
import yaml
from sklearn.ensemble import GradientBoostingRegressor, HistGradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scorestack.compile import compile_model
from scorestack.compile.emit import check_artifact_name
from scorestack.errors import VerificationError
from conftest import LocalTriton
from scorestack.serve.native import LIBRARY as NATIVE_LIBRARY

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)

FORMATS = ("onnx", "native", "tl2cgen", "trees", "linear", "hummingbird")
N_FEATURES = 6
TOLERANCE = 1e-5


@dataclass
class Source:
    name: str
    task: str
    path: Path
    format: str  # spec source.format
    predict: Any  # X -> reference [n, k]
    holdout: Path


def _data(seed: int, n: int = 900) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    signal = X[:, 0] + 0.7 * X[:, 1] * X[:, 2] - 0.5 * X[:, 3]
    return X, signal


def _sources(root: Path) -> list[Source]:
    """The matrix's source models: four tasks, four source families, trained small."""
    out: list[Source] = []

    def save_holdout(name: str, X: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None) -> Path:
        path = root / f"{name}_holdout.npz"
        arrays = {"X": X, "y": y} if groups is None else {"X": X, "y": y, "group": groups}
        np.savez(path, **arrays)
        return path

    X, s = _data(1)
    tr, ho = slice(0, 600), slice(600, None)
    binary = (s > 0.3).astype(int)
    three = np.digitize(s, [-0.5, 0.5])

    # XGBoost, all four tasks (binary with a fitted base_score other than 0.5).
    m = xgb.XGBClassifier(n_estimators=20, max_depth=3, base_score=0.3, n_jobs=1).fit(X[tr], binary[tr])
    m.get_booster().save_model(root / "xgb_binary.json")
    b = xgb.Booster(model_file=str(root / "xgb_binary.json"))
    out.append(Source("xgb_binary", "binary", root / "xgb_binary.json", "xgboost-json", lambda Z, b=b: b.predict(xgb.DMatrix(Z)).reshape(-1, 1), save_holdout("xgb_binary", X[ho], binary[ho])))
    m = xgb.XGBClassifier(n_estimators=15, max_depth=3, n_jobs=1).fit(X[tr], three[tr])
    m.get_booster().save_model(root / "xgb_multi.json")
    b = xgb.Booster(model_file=str(root / "xgb_multi.json"))
    out.append(Source("xgb_multi", "multiclass", root / "xgb_multi.json", "xgboost-json", lambda Z, b=b: b.predict(xgb.DMatrix(Z)), save_holdout("xgb_multi", X[ho], three[ho])))
    m = xgb.XGBRegressor(n_estimators=20, max_depth=3, n_jobs=1).fit(X[tr], s[tr])
    m.get_booster().save_model(root / "xgb_reg.json")
    b = xgb.Booster(model_file=str(root / "xgb_reg.json"))
    out.append(Source("xgb_reg", "regression", root / "xgb_reg.json", "xgboost-json", lambda Z, b=b: b.predict(xgb.DMatrix(Z)).reshape(-1, 1), save_holdout("xgb_reg", X[ho], s[ho])))
    groups_tr, groups_ho = np.full(30, 20), np.full(15, 20)
    rel = np.clip(np.round(s + 1), 0, 3).astype(int)
    m = xgb.XGBRanker(n_estimators=20, max_depth=3, n_jobs=1, objective="rank:pairwise").fit(X[tr], rel[tr], group=groups_tr)
    m.get_booster().save_model(root / "xgb_rank.json")
    b = xgb.Booster(model_file=str(root / "xgb_rank.json"))
    out.append(Source("xgb_rank", "ranking", root / "xgb_rank.json", "xgboost-json", lambda Z, b=b: b.predict(xgb.DMatrix(Z)).reshape(-1, 1), save_holdout("xgb_rank", X[600:900], rel[600:900], groups_ho)))

    def sk(name: str, task: str, est: Any, y: np.ndarray) -> None:
        est.fit(X[tr], y[tr])
        joblib.dump(est, root / f"{name}.joblib")
        if task == "binary":
            pred = lambda Z, e=est: e.predict_proba(Z)[:, 1:2]
        elif task == "multiclass":
            pred = lambda Z, e=est: e.predict_proba(Z)
        else:
            pred = lambda Z, e=est: e.predict(Z).reshape(-1, 1)
        out.append(Source(name, task, root / f"{name}.joblib", "joblib", pred, save_holdout(name, X[ho], y[ho])))

    # scikit-learn trees, a linear Pipeline, and a HistGradientBoosting pickled in this (numpy 2) environment.
    sk("skl_forest_binary", "binary", RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0), binary)
    sk("skl_forest_multi", "multiclass", RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0), three)
    sk("skl_gbr", "regression", GradientBoostingRegressor(n_estimators=20, max_depth=3, random_state=0), s)
    sk("linear_binary", "binary", make_pipeline(StandardScaler(), LogisticRegression()), binary)
    sk("linear_multi", "multiclass", make_pipeline(StandardScaler(), LogisticRegression()), three)
    sk("linear_reg", "regression", make_pipeline(StandardScaler(), Ridge()), s)
    sk("hgb_binary", "binary", HistGradientBoostingClassifier(max_iter=20, random_state=0), binary)

    # LightGBM model files, the two tasks its own tests do not serve in every format: several classes and ranking.
    lgb_params = {"verbose": -1, "num_threads": 1, "num_leaves": 15, "max_depth": 4, "seed": 0}
    for name, task, params, y, groups in (("lgb_multi", "multiclass", {"objective": "multiclass", "num_class": 3}, three, None),
                                          ("lgb_rank", "ranking", {"objective": "lambdarank"}, rel, groups_ho)):
        data = lgb.Dataset(X[tr], y[tr], group=groups_tr if groups is not None else None)
        lgb.train({**lgb_params, **params}, data, num_boost_round=15).save_model(root / f"{name}.txt")
        b = lgb.Booster(model_file=str(root / f"{name}.txt"))
        holdout = save_holdout(name, X[ho], y[ho], groups)
        out.append(Source(name, task, root / f"{name}.txt", "lightgbm-text", lambda Z, b=b: b.predict(Z).reshape(len(Z), -1), holdout))
    return out


def _spec(root: Path, src: Source, fmt: str) -> Path:
    spec = {
        "name": f"{src.name}__{fmt}",
        "source": {"path": str(src.path), "format": src.format, "trusted": src.format == "joblib"},
        "task": src.task,
        "inputs": {"features": [f"f{i}" for i in range(N_FEATURES)]},
        # 2 threads -> one instance per model: ~40 models stay within the machine's memory.
        "threads": [2],
        # A generous budget: ~40 models share 2 busy cores here, and the derived queue timeout
        # follows the budget (a tight one rejects requests by design, not because a model is wrong).
        "serving": {"batch_sizes": [1, 16], "latency_budget_ms": 2000},
        "verification": {"tolerance": TOLERANCE},
        "holdout": str(src.holdout),
        "formats": [fmt],
    }
    path = root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory):
    """Compile every (source, format); return the repository, the sources and {name: report or refusal}."""
    root = tmp_path_factory.mktemp("matrix")
    repo = root / "model_repository"
    sources = _sources(root)
    outcomes: dict[str, Any] = {}
    for src in sources:
        for fmt in FORMATS:
            name = f"{src.name}__{fmt}"
            try:
                # The matrix serves every model below, all rows, in one Triton: skip the per-compile check.
                outcomes[name] = compile_model(_spec(root, src, fmt), repo, serve_check=False)
            except VerificationError as exc:
                outcomes[name] = exc
    return repo, sources, outcomes


def test_every_format_either_serves_exactly_or_is_refused_with_a_reason(matrix, server_environment):
    repo, sources, outcomes = matrix
    compiled = {n: r for n, r in outcomes.items() if not isinstance(r, Exception)}
    refused = {n: e for n, e in outcomes.items() if isinstance(e, Exception)}
    for name, exc in refused.items():
        fmt = name.split("__")[1]
        assert f"{fmt}: " in str(exc), f"{name}: refusal without a reason for {fmt}: {exc}"
        assert not (repo / name).exists(), f"{name} was refused but emitted"
    for name, report in compiled.items():
        assert report.selected.format == name.split("__")[1]
        assert report.verified_in["numpy"].startswith("1."), "verified outside the server environment"
        assert set(report.artifact_sha256) >= {f"1/{report.selected.artifact}", "1/model.py", "1/scorestack_runtime.py"}
        # Batch libraries are served by scorestack's native backend (its library in the version
        # folder, under SHA256SUMS), everything else by the Python backend's model runtime.
        native = report.selected.format in ("tl2cgen", "trees", "linear")
        assert (report.selected.backend == "scorestack") == native, name
        assert (f"1/{NATIVE_LIBRARY}" in report.artifact_sha256) == native, name

    # What must hold regardless of converter versions: ONNX and the native library serve every
    # source (scikit-learn pickles written under numpy 2 once failed to load under the server's
    # numpy 1.26: HistGradientBoosting's Generator, GradientBoosting's RandomState); TL2cgen serves
    # every tree ensemble (its library once shadowed model.py).
    for src in sources:
        for fmt in ("onnx", "native"):
            assert f"{src.name}__{fmt}" in compiled, f"{src.name}: {fmt} refused: {refused.get(f'{src.name}__{fmt}')}"
    for tree in ("xgb_binary", "xgb_multi", "xgb_reg", "xgb_rank", "skl_forest_binary", "skl_gbr", "hgb_binary", "lgb_multi", "lgb_rank"):
        assert f"{tree}__tl2cgen" in compiled, f"{tree}: tl2cgen refused: {refused.get(f'{tree}__tl2cgen')}"
    assert "no tl2cgen converter" in str(refused["linear_reg__tl2cgen"])
    # scorestack's tree kernel serves every tree ensemble: shallow single-output boosting in the
    # complete-tree layout, the rest (several classes, leaf vectors, averaged forests, HistGradientBoosting's
    # leaf-wise trees deeper than 10) in the node layout; the report's note says which.
    for tree in ("xgb_binary", "xgb_multi", "xgb_reg", "xgb_rank", "skl_forest_binary", "skl_forest_multi", "skl_gbr", "hgb_binary", "lgb_multi", "lgb_rank"):
        assert f"{tree}__trees" in compiled, f"{tree}: trees refused: {refused.get(f'{tree}__trees')}"
    for tree in ("xgb_multi", "skl_forest_binary", "skl_forest_multi"):
        notes = next(c.notes for c in compiled[f"{tree}__trees"].candidates if c.format == "trees")
        assert any("node layout" in n for n in notes), (tree, notes)
    assert "no trees converter" in str(refused["linear_reg__trees"])
    # scorestack's linear kernel serves the linear pipelines (scaler folded in), and only them.
    for linear in ("linear_binary", "linear_multi", "linear_reg"):
        assert f"{linear}__linear" in compiled, f"{linear}: linear refused: {refused.get(f'{linear}__linear')}"
    assert "no linear converter" in str(refused["xgb_binary__linear"]) and "no linear converter" in str(refused["skl_gbr__linear"])
    assert "missing-value handling" in str(refused["lgb_multi__hummingbird"])

    by_source = {s.name: s for s in sources}
    with LocalTriton(repo, server_env=server_environment, ready_timeout_s=600) as server:
        not_ready = {n: st.reason for n, st in server.model_status.items() if not st.ready}
        assert not not_ready, f"verified, then failed to load: {not_ready}"
        assert set(server.ready_models()) == set(compiled)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for name, report in sorted(compiled.items()):
                src = by_source[name.split("__")[0]]
                X = np.load(src.holdout)["X"]
                want = src.predict(X).astype(np.float64)
                got = np.concatenate([_infer(client, name, report.triton.max_batch_size, X[i : i + 16]) for i in range(0, len(X), 16)])
                assert got.shape == want.shape, name
                np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)
                one = _infer(client, name, 1, X[:1])  # batch 1 too
                np.testing.assert_allclose(one, want[:1], rtol=0, atol=TOLERANCE, err_msg=name)
        finally:
            client.close()
    summary = {n: ("served" if n in compiled else str(refused[n]).split("(", 1)[-1][:160]) for n in sorted(outcomes)}
    print(json.dumps(summary, indent=1))


def _infer(client: grpcclient.InferenceServerClient, name: str, max_batch: int, X: np.ndarray) -> np.ndarray:
    parts = []
    for i in range(0, len(X), max_batch):
        x = np.ascontiguousarray(X[i : i + max_batch])
        inp = grpcclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(name, [inp], client_timeout=60)
        parts.append(result.as_numpy(result.get_response().outputs[0].name).astype(np.float64))
    return np.concatenate(parts)


def test_artifact_names_that_import_could_resolve_are_refused():
    for bad in ("model.so", "model.py", "numpy.so", "model.cpython-311-x86_64-linux-gnu.so", "scorestack_runtime.pyc"):
        with pytest.raises(ValueError, match="would shadow"):
            check_artifact_name(bad)
    for good in ("model-tl2cgen.so", "model.onnx", "model.json", "model.joblib", "model.plan"):
        check_artifact_name(good)


def test_embedded_mode_runs_every_format_the_matrix_compiled(matrix):
    """The same version folders in this process (TritonClient(in_process=EmbeddedModels(...))'s runtime): each
    reproduces the compiler's reference rows here, and answers the holdout rows, in batches and alone, as the source does."""
    from scorestack.serve.embedded import EmbeddedModels

    repo, sources, outcomes = matrix
    compiled = sorted(n for n, r in outcomes.items() if not isinstance(r, Exception))
    by_source = {s.name: s for s in sources}
    with EmbeddedModels(repo, models=compiled) as embedded:
        checked = embedded.reference_check()
        assert set(checked) == set(compiled) and max(checked.values()) <= TOLERANCE, checked
        for name in compiled:
            src = by_source[name.split("__")[0]]
            X = np.load(src.holdout)["X"][:40]
            want = src.predict(X).astype(np.float64)
            meta = embedded.model_metadata(name)
            inp, out = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
            got = np.concatenate([embedded.infer(name, [(inp, "FP32", X[i : i + 16])], [out])[out] for i in range(0, len(X), 16)]).astype(np.float64)
            lone = np.concatenate([embedded.infer(name, [(inp, "FP32", X[i : i + 1])], [out])[out] for i in range(3)]).astype(np.float64)
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=TOLERANCE, err_msg=name)
            np.testing.assert_allclose(lone.reshape(want[:3].shape), want[:3], rtol=0, atol=TOLERANCE, err_msg=name)
    assert {n.split("__")[1] for n in compiled} >= {"onnx", "native", "tl2cgen", "trees", "linear"}  # every family's formats ran here
