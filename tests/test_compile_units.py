"""The compiler on small real models: spec errors, trust, verification catching wrong converters, passes, emission."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from scorestack import schema
from scorestack.compile import compile_model, load_spec
from scorestack.demo.train import train_demo_models
from scorestack.compile.spec import parse_spec
from scorestack.errors import SpecError, VerificationError

pytestmark = pytest.mark.slow  # a long module: scheduled first in the parallel run (tests/conftest.py)

SMALL = dict(xgb_trees=40, sklearn_iters=30, ranker_trees=30, n_fraud=8000, n_queries=300)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models")
    train_demo_models(out, **SMALL)
    return out


def write_spec(folder: Path, base: Path, name: str, **changes) -> Path:
    """A copy of a demo spec with some fields changed (nested dicts merge)."""
    data = yaml.safe_load(base.read_text())
    data["name"] = name
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    for key in ("path",):
        data["source"][key] = str((base.parent / data["source"][key]).resolve()) if not Path(data["source"][key]).is_absolute() else data["source"][key]
    data["holdout"] = str((base.parent / data["holdout"]).resolve())
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- specs -------------------------------------------------------------------------------------


def test_spec_error_names_the_field_and_the_fix(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "fraud", verification={"tolerance": -1})
    spec = spec.rename(tmp_path / "fraud.yaml")
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert str(err.value) == "spec fraud.yaml: field `verification.tolerance`: must be > 0 (got -1); set a positive number such as 1e-5"


def test_spec_errors_for_unknown_values(tmp_path: Path) -> None:
    data = {
        "name": "m",
        "source": {"path": "m.json", "format": "onnx"},
        "task": "binary",
        "inputs": {"features": ["a", "a"]},
        "holdout": "h.npz",
        "serving": {"latency_budget_ms": 0},
        "colour": "red",
    }
    with pytest.raises(SpecError) as err:
        parse_spec(data, "m.yaml", tmp_path)
    msg = str(err.value)
    assert "field `source.format`" in msg and "use one of xgboost-json, xgboost-ubj, lightgbm-text, joblib, pickle" in msg
    assert "field `inputs.features`: feature names must be unique; repeated: a" in msg
    assert "field `serving.latency_budget_ms`: must be > 0 (got 0)" in msg
    assert "field `colour`: is not a known field" in msg


def test_decision_threshold_is_checked_and_emitted(tmp_path: Path) -> None:
    base = {"name": "m", "source": {"path": "m.json", "format": "xgboost-json"}, "inputs": {"features": ["a"]}, "holdout": "h.npz"}
    with pytest.raises(SpecError) as err:
        parse_spec({**base, "task": "ranking", "serving": {"decision_threshold": 0.3}}, "m.yaml", tmp_path)
    assert "field `serving`: decision_threshold applies to binary models only (task is ranking)" in str(err.value)
    with pytest.raises(SpecError) as err:
        parse_spec({**base, "task": "binary", "serving": {"decision_threshold": 1.5}}, "m.yaml", tmp_path)
    assert "field `serving.decision_threshold`: must be <= 1" in str(err.value) and "probability in [0, 1]" in str(err.value)
    assert parse_spec({**base, "task": "binary", "serving": {"decision_threshold": 0.2}}, "m.yaml", tmp_path).serving.decision_threshold == 0.2


def test_spec_relative_paths_resolve_against_the_spec_folder(demo_dir: Path) -> None:
    spec = load_spec(demo_dir / "fraud_xgb.yaml")
    assert spec.source.path == (demo_dir / "fraud_xgb.json").resolve()
    assert spec.holdout == (demo_dir / "fraud_holdout.npz").resolve()
    assert spec.inputs.features == list(schema.FRAUD_FEATURES)
    assert spec.output_name == "probability"


def test_output_name_must_follow_the_contract(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "fraud", outputs=["score"])
    with pytest.raises(SpecError, match=r"field `outputs`: a binary model exposes exactly one output named 'probability'"):
        load_spec(spec)


def test_feature_count_mismatch_names_inputs(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "fraud", inputs={"features": list(schema.FRAUD_FEATURES[:-1])})
    with pytest.raises(SpecError, match=r"field `inputs.features`: the model takes 30 features but the spec lists 29"):
        compile_model(spec, tmp_path / "repo")


def test_task_mismatch_names_task(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "ranking_xgb.yaml", "rank", task="binary", outputs=["probability"])
    with pytest.raises(SpecError, match=r"field `task`: the model's objective is 'rank:ndcg'"):
        compile_model(spec, tmp_path / "repo")


# --- trust -------------------------------------------------------------------------------------


def test_untrusted_pickle_is_refused_before_loading(tmp_path: Path, demo_dir: Path) -> None:
    marker = tmp_path / "payload-ran"

    class Payload:  # unpickling this would create the marker file
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "model.pkl"
    evil.write_bytes(pickle.dumps(Payload()))
    spec = write_spec(tmp_path, demo_dir / "fraud_sklearn.yaml", "evil", source={"path": str(evil), "format": "pickle", "trusted": False})
    with pytest.raises(SpecError) as err:
        compile_model(spec, tmp_path / "repo")
    assert "field `source.trusted`" in str(err.value)
    assert "unpickling runs arbitrary code" in str(err.value)
    assert not marker.exists()
    assert not (tmp_path / "repo" / "evil").exists()


def test_trusted_joblib_compiles(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "fraud_sklearn.yaml", "skl", formats=["onnx", "native"])
    report = compile_model(spec, tmp_path / "repo")
    by = {c.format: c for c in report.candidates}
    assert by["onnx"].verified and by["native"].verified
    assert by["onnx"].max_abs_diff <= 1e-5
    assert by["tl2cgen"].status == "skipped" and "formats" in by["tl2cgen"].reason


# --- verification catches silently wrong converters --------------------------------------------


def test_hummingbird_without_base_score_is_rejected(tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scorestack.compile import convert_xgboost

    monkeypatch.setattr(convert_xgboost, "hummingbird_extra_config", lambda source: {"n_features": source.n_features})
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "hb", formats=["hummingbird", "native"])
    report = compile_model(spec, tmp_path / "repo")
    hb = next(c for c in report.candidates if c.format == "hummingbird")
    assert hb.status == "rejected" and not hb.verified
    assert hb.max_abs_diff > 0.01
    assert "verification failed: max |Δ|" in hb.reason
    assert report.selected.format == "native"
    assert not (tmp_path / "repo" / "hb" / "1" / "model.onnx").exists()


def test_hummingbird_with_base_score_is_exact(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "hb_ok", formats=["hummingbird"])
    report = compile_model(spec, tmp_path / "repo")
    assert report.selected.format == "hummingbird"
    hb = next(c for c in report.candidates if c.format == "hummingbird")
    assert hb.verified and hb.max_abs_diff <= 1e-5 and hb.label_agreement == 1.0


def test_ranker_converted_as_raw_booster_is_rejected(tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scorestack.compile import convert_xgboost

    # onnxmltools turns a raw ranker Booster into a classifier without complaint (docs/platform-notes.md).
    monkeypatch.setattr(convert_xgboost, "_onnx_input_model", lambda source: convert_xgboost._anonymous(source.model))
    spec = write_spec(tmp_path, demo_dir / "ranking_xgb.yaml", "rank_bad", formats=["onnx", "native"])
    report = compile_model(spec, tmp_path / "repo")
    onnx_c = next(c for c in report.candidates if c.format == "onnx")
    assert onnx_c.status in ("rejected", "failed")
    assert "verification failed" in onnx_c.reason or "conversion failed" in onnx_c.reason
    assert report.selected.format == "native"


def test_perturbed_graph_is_rejected_and_nothing_emitted(tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scorestack.compile import _tree_commons, convert_xgboost

    original = _tree_commons.save_onnx_contract

    def perturbed(raw, workdir, ctx, source_output, n_classes, fmt="onnx", notes=None):
        art = original(raw, workdir, ctx, source_output, n_classes, fmt, notes)
        model = onnx.load(str(art.path))
        out = model.graph.output[0].name
        for node in model.graph.node:  # scale the final output by 1.001
            node.output[:] = [f"{out}__pre" if o == out else o for o in node.output]
        model.graph.initializer.append(onnx.helper.make_tensor("eps", onnx.TensorProto.FLOAT, [], [1.001]))
        model.graph.node.append(onnx.helper.make_node("Mul", [f"{out}__pre", "eps"], [out]))
        onnx.save(model, str(art.path))
        return art

    monkeypatch.setattr(convert_xgboost, "save_onnx_contract", perturbed)
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "only_onnx", formats=["onnx"])
    with pytest.raises(VerificationError, match=r"only_onnx: no candidate reproduces the model \(.*onnx: verification failed: max \|Δ\|"):
        compile_model(spec, tmp_path / "repo")
    assert not (tmp_path / "repo" / "only_onnx").exists()


# --- emission, contract, content hash -----------------------------------------------------------


def test_emitted_folder_follows_the_serving_contract(tmp_path: Path, demo_dir: Path) -> None:
    import onnxruntime as ort

    repo = tmp_path / "repo"
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "fraud", formats=["onnx", "native"], serving={"batch_sizes": [1], "batch_weights": None})
    report = compile_model(spec, repo)
    folder = repo / "fraud"
    assert report.selected.format == "onnx"  # batch 1: onnxruntime ~7 µs vs native XGBoost ~150 µs
    cfg = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.backend == "onnxruntime" and cfg.default_model_filename == "model.onnx"
    assert (cfg.input[0].name, list(cfg.input[0].dims)) == ("features", [30])
    assert (cfg.output[0].name, list(cfg.output[0].dims)) == ("probability", [1])
    assert cfg.max_batch_size == 1
    pol = cfg.dynamic_batching.default_queue_policy
    assert pol.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT and pol.allow_timeout_override
    assert pol.default_timeout_microseconds == report.triton.default_timeout_us > 0
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert cfg.model_warmup[0].batch_size == 1 and cfg.model_warmup[0].inputs["features"].zero_data
    assert cfg.parameters["scorestack_runtime"].string_value == "onnxruntime"
    assert cfg.parameters["scorestack_artifact"].string_value == "model.onnx"
    assert int(cfg.parameters["scorestack_threads"].string_value) == 1

    sess = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert inp.name == "features" and inp.shape == ["batch", 30]
    assert out.name == "probability" and out.shape == ["batch", 1]
    hold = np.load(demo_dir / "fraud_holdout.npz")
    import xgboost as xgb

    booster = xgb.Booster(model_file=str(demo_dir / "fraud_xgb.json"))
    expected = booster.predict(xgb.DMatrix(hold["X"]))
    got = sess.run(None, {"features": hold["X"]})[0]
    assert got.shape == (len(hold["X"]), 1)
    np.testing.assert_allclose(got[:, 0], expected, atol=1e-5)

    data = json.loads((folder / "report.json").read_text())
    assert data["selected"]["format"] == "onnx"
    assert {c["format"] for c in data["candidates"]} >= {"onnx", "native", "tl2cgen"}
    onnx_c = next(c for c in data["candidates"] if c["format"] == "onnx")
    assert onnx_c["verified"] and onnx_c["max_abs_diff"] <= 1e-5 and set(onnx_c["latency_us"]) == {"1"}
    assert "max_queue_delay_microseconds" in (folder / "report.md").read_text()


def test_native_selection_writes_python_backend_and_runtime(tmp_path: Path, demo_dir: Path) -> None:
    repo = tmp_path / "repo"
    spec = write_spec(tmp_path, demo_dir / "fraud_sklearn.yaml", "skl_native", formats=["native"])
    report = compile_model(spec, repo)
    folder = repo / "skl_native"
    cfg = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.backend == "python" and report.selected.runtime == "sklearn"
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["scorestack_runtime"] == "sklearn"
    assert params["scorestack_artifact"] == "model.joblib"
    assert params["scorestack_method"] == "predict_proba"
    assert params["scorestack_output_column"] == "1"
    assert (folder / "1" / "model.joblib").exists() and (folder / "1" / "model.py").exists()


def test_unchanged_spec_is_not_recompiled(tmp_path: Path, demo_dir: Path) -> None:
    repo = tmp_path / "repo"
    spec = write_spec(tmp_path, demo_dir / "ranking_xgb.yaml", "rank", formats=["onnx", "native"])
    # What is tested is the skip, not the load: the per-compile load in a local Triton is left out.
    first = compile_model(spec, repo, serve_check=False)
    assert not first.skipped
    mtime = (repo / "rank" / "config.pbtxt").stat().st_mtime_ns
    second = compile_model(spec, repo, serve_check=False)
    assert second.skipped and second.content_hash == first.content_hash
    assert (repo / "rank" / "config.pbtxt").stat().st_mtime_ns == mtime
    forced = compile_model(spec, repo, force=True, serve_check=False)
    assert not forced.skipped and forced.created_at >= first.created_at
    spec.write_text(spec.read_text().replace("tolerance: 1.0e-05", "tolerance: 2.0e-05"))
    changed = compile_model(spec, repo, serve_check=False)
    assert not changed.skipped and changed.content_hash != first.content_hash


# --- lossy passes ------------------------------------------------------------------------------


def test_pruning_keeps_a_prefix_within_budget(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(
        tmp_path, demo_dir / "ranking_xgb.yaml", "rank_pruned", formats=["native"], optimization={"pruning": {"quality_budget": 0.05}}
    )
    report = compile_model(spec, tmp_path / "repo")
    (p,) = report.passes
    assert p.name == "pruning" and p.metric == "ndcg@10"
    assert p.accepted and p.trees_after < p.trees_before == 30
    assert p.quality_drop <= 0.05
    import xgboost as xgb

    served = xgb.Booster(model_file=str(tmp_path / "repo" / "rank_pruned" / "1" / "model.json"))
    assert served.num_boosted_rounds() == p.trees_after


def test_distillation_reports_quality_and_respects_budget(tmp_path: Path, demo_dir: Path) -> None:
    spec = write_spec(
        tmp_path,
        demo_dir / "fraud_xgb.yaml",
        "fraud_student",
        formats=["onnx"],
        optimization={"distillation": {"n_estimators": 10, "max_depth": 3, "quality_budget": 0.0}},
    )
    report = compile_model(spec, tmp_path / "repo")
    (p,) = report.passes
    assert p.name == "distillation" and p.metric == "auc"
    for key in ("teacher_auc", "student_auc", "teacher_pr_auc", "student_pr_auc", "top1pct_overlap"):
        assert 0.0 <= p.details[key] <= 1.0
    # A budget of 0 accepts only a student at least as good as its teacher.
    assert p.accepted == (p.quality_drop <= 0.0)
    if not p.accepted:
        assert "exceeds the budget" in p.reason and "distilled" not in report.source.final_model


def test_missing_hummingbird_is_reported_as_skipped(tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scorestack.compile import _tree_commons

    monkeypatch.setattr(_tree_commons, "hummingbird_available", lambda: False)
    spec = write_spec(tmp_path, demo_dir / "fraud_xgb.yaml", "no_hb", formats=["hummingbird", "native", "tensorrt"])
    compile_model(spec, tmp_path / "repo")
    data = json.loads((tmp_path / "repo" / "no_hb" / "report.json").read_text())
    by = {c["format"]: c for c in data["candidates"]}
    assert by["hummingbird"]["status"] == "skipped" and "hummingbird not installed" in by["hummingbird"]["reason"]
    assert by["tensorrt"]["status"] == "skipped" and "target is cpu" in by["tensorrt"]["reason"]
    assert data["selected"]["format"] == "native"
