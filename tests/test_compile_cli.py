"""`scorestack compile` as a user runs it: a batch where one source is corrupt still lands the others."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from scorestack.demo.train import train_demo_models

SCORESTACK = [sys.executable, "-m", "scorestack.cli"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models")
    train_demo_models(out, xgb_trees=30, sklearn_iters=20, ranker_trees=20, n_fraud=6000, n_queries=200)
    return out


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*SCORESTACK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_batch_with_a_corrupt_source_lands_the_other_and_fails(tmp_path: Path, demo_dir: Path) -> None:
    good = tmp_path / "a.yaml"
    spec = yaml.safe_load((demo_dir / "fraud_xgb.yaml").read_text())
    spec.update(name="fraud_a", formats=["onnx", "native"])
    spec["source"]["path"] = str(demo_dir / "fraud_xgb.json")
    spec["holdout"] = str(demo_dir / "fraud_holdout.npz")
    good.write_text(yaml.safe_dump(spec))

    corrupt_model = tmp_path / "b_model.json"
    text = (demo_dir / "fraud_xgb.json").read_text()
    corrupt_model.write_text(text[: len(text) // 2])  # truncated mid-file
    bad = tmp_path / "b.yaml"
    spec_b = dict(spec, name="fraud_b")
    spec_b["source"] = dict(spec["source"], path=str(corrupt_model))
    bad.write_text(yaml.safe_dump(spec_b))

    repo = tmp_path / "repo"
    proc = _run("compile", str(good), str(bad), "--repository", str(repo), "--jobs", "2", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "field `source.path`: cannot load b_model.json as xgboost-json" in out
    assert "compile summary" in out

    cfg = text_format.Parse((repo / "fraud_a" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.name == "fraud_a" and cfg.output[0].name == "probability"
    report = json.loads((repo / "fraud_a" / "report.json").read_text())
    assert report["selected"]["format"] in ("onnx", "native")
    assert not (repo / "fraud_b").exists()
    assert sorted(p.name for p in repo.iterdir()) == ["fraud_a"]  # no staging debris inside the repository
    assert not (tmp_path / ".repo.staging").exists()

    # Rerun: the good model is unchanged (skipped by content hash), the bad one still fails.
    again = _run("compile", str(good), str(bad), "--repository", str(repo), cwd=tmp_path)
    assert again.returncode != 0
    assert "skipped" in again.stdout and "fraud_a" in again.stdout

    # Fixed source: everything compiles, exit code 0.
    shutil.copy(demo_dir / "fraud_xgb.json", corrupt_model)
    fixed = _run("compile", str(good), str(bad), "--repository", str(repo), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert (repo / "fraud_b" / "config.pbtxt").exists()


def test_demo_train_command_is_idempotent(tmp_path: Path, demo_dir: Path) -> None:
    # Specs already present: the command returns at once without retraining.
    out_dir = tmp_path / "models"
    shutil.copytree(demo_dir, out_dir)
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    proc = _run("demo", "train", "--out", str(out_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("fraud_xgb", "fraud_sklearn", "ranking_xgb"):
        assert f"{name}.yaml" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == before
