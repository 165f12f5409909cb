"""Per-batch-size dispatch through the real local Triton, and recompiling from a served model's batch profile.

The models are ones the demo never made: a binary and a multiclass XGBoost whose ONNX form is many
times faster than native XGBoost at batch 1 and slower at 1024, so the crossover lies inside their
batch range. Every band is then exercised through Triton over gRPC, and each answer is checked
against the source model and against the band's own format, bit for bit, so a request is known to
have run on the format its band names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import xgboost as xgb
import yaml

from scorestack.compile import compile_model
from conftest import LocalTriton, settled_statistics
from scorestack.triton_config import load_config

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)

N_FEATURES = 20
TOLERANCE = 1e-5
MAX_BATCH = 1024


def _train(root: Path, name: str, task: str) -> tuple[Path, Path]:
    rng = np.random.default_rng(7)
    X = rng.normal(size=(3000, N_FEATURES)).astype(np.float32)
    s = X[:, 0] + 0.8 * X[:, 1] * X[:, 2] - 0.5 * X[:, 3] + 0.3 * rng.normal(size=len(X))
    if task == "binary":
        y = (s > 0.4).astype(int)
        model = xgb.XGBClassifier(n_estimators=200, max_depth=6, base_score=0.3, n_jobs=2)
    else:
        y = np.digitize(s, [-0.6, 0.6])
        model = xgb.XGBClassifier(n_estimators=80, max_depth=6, n_jobs=2)
    model.fit(X[:2400], y[:2400])
    path = root / f"{name}.json"
    model.get_booster().save_model(path)
    holdout = root / f"{name}_holdout.npz"
    np.savez(holdout, X=X[2400:], y=y[2400:])
    spec = {
        "name": name,
        "source": {"path": str(path), "format": "xgboost-json"},
        "task": task,
        "inputs": {"features": [f"f{i}" for i in range(N_FEATURES)]},
        "serving": {"batch_sizes": [1, 64, MAX_BATCH], "batch_weights": [0.6, 0.3, 0.1], "max_batch_size": MAX_BATCH, "latency_budget_ms": 1000},
        "verification": {"tolerance": TOLERANCE},
        "holdout": str(holdout),
        # The two formats whose curves cross; every format's own serving is covered by test_verified_served.
        "formats": ["onnx", "native"],
    }
    spec_path = root / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    return spec_path, path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory, server_environment):
    root = tmp_path_factory.mktemp("dispatch")
    repo = root / "repo"
    out = {}
    for name, task in (("disp_binary", "binary"), ("disp_multi", "multiclass")):
        spec, source = _train(root, name, task)
        out[name] = (spec, source, compile_model(spec, repo))
    return repo, out


def _rows(holdout: Path, n: int) -> np.ndarray:
    X = np.load(holdout)["X"].astype(np.float32)
    return np.ascontiguousarray(X[np.arange(n) % len(X)])


def _infer(client: grpcclient.InferenceServerClient, name: str, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(name, [inp], client_timeout=60)
    return result.as_numpy(result.get_response().outputs[0].name)


def test_the_crossover_gives_bands_and_each_band_answers_on_its_format_through_triton(compiled):
    repo, models = compiled
    with LocalTriton(repo) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for name, (spec, source, report) in models.items():
                d = report.dispatch
                assert d is not None and d.status == "selected", (name, d)
                assert report.selected.format == "dispatch" and report.serve_check.status == "passed"
                formats = [b["format"] for b in d.bands]
                # ONNX wins batch 1 by far and native XGBoost the largest batches: two bands, in that order.
                assert formats == ["onnx", "native"], (name, d.decision)
                assert d.bands[0]["min_rows"] == 1 and d.bands[-1]["max_rows"] == MAX_BATCH
                assert d.bands[0]["max_rows"] + 1 == d.bands[1]["min_rows"]
                assert set(d.edge_sizes) == {1, d.bands[0]["max_rows"], d.bands[1]["min_rows"], MAX_BATCH}
                assert set(d.measured_us) == {"dispatch", "onnx", "native"} and len(d.measured_us["dispatch"]) == len(d.grid)

                version_dir = repo / name / str(report.version)
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1  # as served (scorestack_threads 1): the trees' sum in the same order
                onnx = ort.InferenceSession(str(version_dir / "onnx-model.onnx"), options, providers=["CPUExecutionProvider"])
                booster = xgb.Booster(model_file=str(version_dir / "native-model.json"))
                booster.set_param({"nthread": 1})
                own = {
                    "onnx": lambda x, onnx=onnx: onnx.run(None, {onnx.get_inputs()[0].name: x})[0],
                    "native": lambda x, booster=booster: booster.inplace_predict(x),
                }
                reference = xgb.Booster(model_file=str(source))
                holdout = Path(yaml.safe_load(spec.read_text())["holdout"])
                for band in d.bands:
                    lo, hi = band["min_rows"], band["max_rows"]
                    for n in sorted({lo, (lo + hi) // 2, hi}):
                        x = _rows(holdout, n)
                        got = _infer(client, name, x).astype(np.float64).reshape(n, -1)
                        want = reference.predict(xgb.DMatrix(x)).reshape(n, -1)
                        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=f"{name} at batch {n}")
                        mine = np.asarray(own[band["format"]](x), dtype=np.float32).reshape(n, -1)
                        assert np.array_equal(got.astype(np.float32), mine), f"{name} at batch {n} did not run on {band['format']}"
        finally:
            client.close()


def test_a_recompile_from_a_served_models_batch_profile(compiled, tmp_path):
    repo, models = compiled
    spec, _, first = models["disp_binary"]
    holdout = Path(yaml.safe_load(spec.read_text())["holdout"])
    with LocalTriton(repo, models=["disp_binary"]) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            before = client.get_inference_statistics("disp_binary", as_json=True)
            # One caller at a time: the batcher never has two requests to join.
            for _ in range(40):
                _infer(client, "disp_binary", _rows(holdout, 1))
            for _ in range(10):
                _infer(client, "disp_binary", _rows(holdout, 300))
            counted = lambda s: sum(int(b["compute_infer"]["count"]) for b in s["model_stats"][0].get("batch_stats") or [])
            stats = settled_statistics(client, "disp_binary", lambda s: counted(s) >= counted(before) + 50, as_json=True)
        finally:
            client.close()
    executed = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["model_stats"][0]["batch_stats"]}
    warmup = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in (before["model_stats"][0].get("batch_stats") or [])}
    assert executed[300] - warmup.get(300, 0) == 10 and executed[1] - warmup.get(1, 0) == 40, executed
    profile = tmp_path / "stats.json"
    profile.write_text(json.dumps(stats))

    run = subprocess.run(
        [sys.executable, "-m", "scorestack.cli", "compile", str(spec), "--repository", str(repo), "--batch-profile", str(profile)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((repo / "disp_binary" / "report.json").read_text())
    assert report["version"] == first.version + 1
    p = report["batch_profile"]
    assert p["executions"] == {str(b): n for b, n in sorted(executed.items())}
    assert p["requests_per_execution"] == pytest.approx(1.0, abs=0.05)
    # 300-row batches count as 256 (the nearest measured size on a log scale); weights follow executions.
    total = sum(executed.values())
    assert report["batch_weights"] == {"1": pytest.approx(executed[1] / total, abs=1e-4), "256": pytest.approx(executed[300] / total, abs=1e-4)}
    # The batcher never joined requests: no queue delay, before or after (a lone request never pays one;
    # the batcher joins what queued while the instances were busy).
    cfg = load_config(repo / "disp_binary" / "config.pbtxt")
    assert first.triton.max_queue_delay_us == 0 and cfg.dynamic_batching.max_queue_delay_microseconds == 0
    assert any(rule.startswith("batch profile: 1.00 requests per execution") for rule in report["triton"]["rules"])


def test_a_batch_profile_without_the_model_is_refused_with_the_models_it_holds(compiled, tmp_path):
    _, models = compiled
    spec = models["disp_multi"][0]
    profile = tmp_path / "stats.json"
    profile.write_text(json.dumps({"model_stats": [{"name": "something_else", "batch_stats": [{"batch_size": "1", "compute_infer": {"count": "5"}}]}]}))
    run = subprocess.run(
        [sys.executable, "-m", "scorestack.cli", "compile", str(spec), "--repository", str(tmp_path / "r"), "--batch-profile", str(profile), "--no-serve-check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    said = " ".join(run.stdout.split())  # rich wraps long lines
    assert "no executed batches for model 'disp_multi'" in said and "something_else (5 executions)" in said
