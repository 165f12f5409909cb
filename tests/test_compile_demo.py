"""Every demo model compiles, loads in the local Triton, and returns over gRPC the source model's scores."""

from __future__ import annotations

import json
from pathlib import Path

import joblib
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb

from scorestack import schema
from conftest import LocalTriton

pytestmark = pytest.mark.slow

DEMO = ("fraud_xgb", "fraud_sklearn", "ranking_xgb")


@pytest.fixture(scope="module")
def compiled(compiled_demo) -> tuple[Path, Path, dict]:
    # Shared with the request-path tests: the real demo sizes (300-tree fraud model), compiled once.
    models, repo, _, reports = compiled_demo
    return models, repo, reports


def _source_scores(models: Path, name: str, X: np.ndarray) -> np.ndarray:
    if name == "fraud_sklearn":
        return joblib.load(models / "fraud_sklearn.joblib").predict_proba(X)[:, 1]
    booster = xgb.Booster(model_file=str(models / f"{name}.json"))
    return booster.predict(xgb.DMatrix(X))


def test_every_demo_model_compiles(compiled) -> None:
    _, repo, reports = compiled
    assert set(reports) == set(DEMO)
    for name, report in reports.items():
        assert (repo / name / "config.pbtxt").exists()
        assert report.selected.artifacts and all((repo / name / "1" / f).exists() for f in report.selected.artifacts)
        data = json.loads((repo / name / "report.json").read_text())
        assert data["selected"]["format"] == report.selected.format
        for cand in data["candidates"]:
            # Every exact conversion either reproduces the model or says why it was not tried.
            assert cand["status"] in ("selected", "verified", "skipped"), (name, cand)
            if cand["verified"]:
                assert cand["max_abs_diff"] <= 1e-5
                assert set(cand["latency_us"]) == {str(b) for b in data["batch_sizes"]}
        formats = {c["format"] for c in data["candidates"] if c["verified"]}
        assert {"onnx", "native", "tl2cgen"} <= formats, (name, formats)


def test_triton_serves_the_source_models_scores(compiled) -> None:
    models, repo, reports = compiled
    holdouts = {
        "fraud_xgb": np.load(models / "fraud_holdout.npz")["X"],
        "fraud_sklearn": np.load(models / "fraud_holdout.npz")["X"],
        "ranking_xgb": np.load(models / "ranking_holdout.npz")["X"],
    }
    with LocalTriton(repository=repo) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for name in DEMO:
            report = reports[name]
            out_name = schema.OUTPUT_TENSORS[report.source.task]
            X = holdouts[name][:640]
            expected = _source_scores(models, name, X)
            batch = report.triton.max_batch_size
            got = []
            for start in range(0, len(X), batch):
                chunk = X[start : start + batch]
                inp = grpcclient.InferInput(schema.INPUT_TENSOR, list(chunk.shape), "FP32")
                inp.set_data_from_numpy(chunk)
                res = client.infer(name, [inp], outputs=[grpcclient.InferRequestedOutput(out_name)], client_timeout=30)
                got.append(res.as_numpy(out_name))
            got = np.concatenate(got)
            assert got.shape == (len(X), 1), (name, got.shape)
            np.testing.assert_allclose(got[:, 0], expected, atol=1e-5, err_msg=f"{name} ({report.selected.format})")
            # Batch 1 too: the dynamic batcher's path for single requests.
            for i in (0, 1, 2):
                inp = grpcclient.InferInput(schema.INPUT_TENSOR, [1, X.shape[1]], "FP32")
                inp.set_data_from_numpy(X[i : i + 1])
                res = client.infer(name, [inp], client_timeout=30)
                assert abs(float(res.as_numpy(out_name)[0, 0]) - expected[i]) <= 1e-5
