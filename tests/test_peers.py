"""The benchmark's FastAPI peers compute what the source model computes: a ratio against a peer that
scores something else would mean nothing. Every configuration the suite measures (async and sync
endpoints, one and two workers, onnxruntime and XGBoost) is started as the benchmark starts it and
asked over HTTP; bad input gets a 422 naming the field. (MLServer builds a virtual environment of its
own from PyPI on first use and is checked by the benchmark run itself, not here.)"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import xgboost as xgb

from scorestack import schema

BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from peers import servers  # noqa: E402 - benchmarks/ is not a package: put on sys.path first
from peers.model import FraudModel, compiled_onnx  # noqa: E402 - the same
from suite import FASTAPI_TARGETS  # noqa: E402 - the same


@pytest.fixture(scope="module")
def fraud_model(compiled_demo, tmp_path_factory) -> FraudModel:
    models, repository, specs, reports = compiled_demo
    work = tmp_path_factory.mktemp("peers")
    return FraudModel(models / "fraud_xgb.json", compiled_onnx(specs["fraud_xgb"], work), repository / "fraud_xgb",
                      tuple(schema.FRAUD_FEATURES), {})


def _post(address: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{address}/predict", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("target", FASTAPI_TARGETS)
def test_every_fastapi_peer_scores_the_source_model(fraud_model, compiled_demo, target, tmp_path):
    runtime = target.split("_")[1]
    X = np.load(compiled_demo[0] / "fraud_holdout.npz")["X"][:8].astype(np.float32)
    want = xgb.Booster(model_file=str(fraud_model.xgb_json)).predict(xgb.DMatrix(X))
    peer = servers.start_fastapi(runtime, fraud_model, tmp_path, endpoint="sync" if target.endswith("_sync") else "async",
                                 workers=2 if target.endswith("_w2") else 1)
    try:
        assert peer.name == target
        got = []
        for x in X:
            status, body = _post(peer.address, json.dumps({"features": x.tolist()}).encode())
            assert status == 200, body
            got.append(body["probability"])
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert len(set(np.round(got, 6))) > 1
        for bad in (b'{"features": [1, 2]}', b'{"rows": []}'):
            status, body = _post(peer.address, bad)
            assert status == 422 and "features" in json.dumps(body), (bad, status, body)
        assert _post(peer.address, b"not json")[0] == 422
        assert len(peer.pids()) >= (3 if target.endswith("_w2") else 1)  # the supervisor and its workers are charged
    finally:
        peer.stop()
