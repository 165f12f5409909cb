"""serving.batching: "none" emits no dynamic batcher, and "auto" measures the derived batching against no batching
in the local Triton and emits the one the rule picks (compile/tune.py), for a model the demo never made, served
through the real Triton and compared with the source model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
import yaml

from scorestack.compile import compile_model, tune
from scorestack.triton_config import parse_config
from conftest import LocalTriton

pytestmark = pytest.mark.slow  # compiles with serving checks: scheduled early in the parallel run

N_FEATURES = 12


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> tuple[Path, np.ndarray, xgb.Booster]:
    root = tmp_path_factory.mktemp("batching")
    rng = np.random.default_rng(23)
    X = rng.normal(size=(3000, N_FEATURES)).astype(np.float32)
    y = (X[:, 1] - 0.5 * X[:, 4] * X[:, 7] + 0.3 * X[:, 10] > 0).astype(int)
    model = xgb.XGBClassifier(n_estimators=80, max_depth=5, n_jobs=1).fit(X[:2400], y[:2400])
    model.get_booster().save_model(root / "churn.json")
    np.savez(root / "holdout.npz", X=X[2400:], y=y[2400:])
    return root, X[2400:], model.get_booster()


def _spec(root: Path, name: str, batching: str) -> Path:
    spec = {
        "name": name,
        "source": {"path": "churn.json", "format": "xgboost-json"},
        "task": "binary",
        "inputs": {"features": [f"f{i}" for i in range(N_FEATURES)]},
        "serving": {"batch_sizes": [1, 32], "latency_budget_ms": 50, "batching": batching, "concurrency": 16},
        "holdout": "holdout.npz",
        "formats": ["onnx", "trees"],
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _serve_and_compare(repo: Path, name: str, X: np.ndarray, booster: xgb.Booster) -> None:
    with LocalTriton(repo, models=[name]) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            cfg = client.get_model_config(name).config
            for x in (X[:1], X[:32]):
                inp = grpcclient.InferInput(cfg.input[0].name, list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                got = client.infer(name, [inp]).as_numpy(cfg.output[0].name).reshape(-1)
                want = booster.predict(xgb.DMatrix(x))
                np.testing.assert_allclose(got, want, atol=1e-5)
        finally:
            client.close()


def test_batching_none_emits_no_batcher_and_serves_exactly(user_model, tmp_path):
    root, X, booster = user_model
    report = compile_model(_spec(root, "churn_none", "none"), tmp_path / "repo")
    cfg = parse_config((tmp_path / "repo" / "churn_none" / "config.pbtxt").read_text())
    assert not cfg.HasField("dynamic_batching")
    t = report.triton
    assert t.dynamic_batching is False and t.queue_policy is False and t.measured == []
    # The instances that run at once, without the extra ones the queue policy's batcher needs.
    assert sum(g.count for g in cfg.instance_group) == t.instance_count >= 1
    assert any(r.startswith("no dynamic batching (serving.batching: none)") for r in t.rules)
    assert report.serve_check.status == "passed"
    _serve_and_compare(tmp_path / "repo", "churn_none", X, booster)


def test_batching_auto_measures_both_and_emits_the_chosen_one(user_model, tmp_path):
    root, X, booster = user_model
    report = compile_model(_spec(root, "churn_auto", "auto"), tmp_path / "repo")
    t = report.triton
    assert [m["name"] for m in t.measured] == ["dynamic batching", "no batching"]
    for m in t.measured:
        assert m["rounds"] == tune.ROUNDS and m["concurrency"] == 16
        assert 0 < m["c1_p50_ms"] <= m["c1_p99_ms"] and m["rate"] > 0 and m["server_cpu_us"] > 0
    dynamic, none = t.measured
    # The emitted config is the one the rule picks from the recorded measurements.
    assert [m["chosen"] for m in t.measured].count(True) == 1
    assert none["chosen"] == tune.choose(dynamic, none)
    cfg = parse_config((tmp_path / "repo" / "churn_auto" / "config.pbtxt").read_text())
    assert cfg.HasField("dynamic_batching") == dynamic["chosen"] == t.dynamic_batching
    assert sum(g.count for g in cfg.instance_group) == (dynamic if dynamic["chosen"] else none)["instances"] == t.instance_count
    assert t.rules[-1].startswith("measured in the local Triton")
    md = (tmp_path / "repo" / "churn_auto" / "report.md").read_text()
    assert "| dynamic batching |" in md and "| no batching |" in md
    assert report.serve_check.status == "passed"
    _serve_and_compare(tmp_path / "repo", "churn_auto", X, booster)


def test_the_rule_keeps_batching_unless_no_batching_loses_nowhere():
    base = {"errors": 0, "c1_p50_ms": 0.40, "rate": 10_000.0, "server_cpu_us": 50.0}
    assert tune.choose(base, {**base, "c1_p50_ms": 0.35}) is True  # faster alone, same cost at the peak
    assert tune.choose(base, {**base, "c1_p50_ms": 0.35, "server_cpu_us": 51.0}) is True  # within the noise allowance
    assert tune.choose(base, {**base, "c1_p50_ms": 0.35, "server_cpu_us": 60.0}) is False  # costs more at the peak
    assert tune.choose(base, {**base, "c1_p50_ms": 0.35, "rate": 9_000.0}) is True  # the client-bound rate does not decide
    assert tune.choose(base, {**base, "c1_p50_ms": 0.45, "server_cpu_us": 40.0}) is False  # slower alone
    assert tune.choose(base, {**base, "c1_p50_ms": 0.35, "errors": 3}) is False  # errors at the peak
