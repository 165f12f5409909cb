"""The fraud model every peer serves: the demo XGBoost, trained and compiled through scorestack's public API, with an
ONNX artifact of it verified by the compiler (the served one when it holds one, else the model compiled to ONNX alone)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FraudModel:
    xgb_json: Path          # the trained XGBoost model (the source file of the spec)
    onnx: Path              # an ONNX artifact of the model, verified by the compiler (for the onnxruntime peer)
    model_dir: Path         # <repository>/fraud_xgb: config.pbtxt + version folder
    features: tuple[str, ...]
    report: dict            # the compile report (format, threads, derived batching)


def prepare(workspace: Path, recompile: bool = False) -> FraudModel:
    """Train (once) and compile (once, cached by content; `recompile` forces it) the demo fraud XGBoost into `workspace`."""
    from scorestack import schema
    from scorestack.compile import compile_model
    from scorestack.demo import train_demo_models

    workspace.mkdir(parents=True, exist_ok=True)
    specs = {p.stem: p for p in train_demo_models(workspace / "models")}
    repository = workspace / "model_repository"
    compile_model(specs["fraud_xgb"], repository, force=recompile)
    model_dir = repository / "fraud_xgb"
    return FraudModel(
        xgb_json=workspace / "models" / "fraud_xgb.json",
        onnx=_served_onnx(model_dir) or compiled_onnx(specs["fraud_xgb"], workspace, recompile),
        model_dir=model_dir,
        features=tuple(schema.FRAUD_FEATURES),
        report=json.loads((model_dir / "report.json").read_text()) if (model_dir / "report.json").exists() else {},
    )


def _served_onnx(model_dir: Path) -> Path | None:
    """The ONNX artifact of the served version (a dispatch may hold one), or None."""
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not versions:
        raise FileNotFoundError(f"{model_dir}: no version folder; compile the fraud model first")
    onnx = sorted(versions[-1].rglob("*.onnx"))
    return onnx[0] if onnx else None


def compiled_onnx(spec_path: Path, workspace: Path, recompile: bool = False) -> Path:
    """The same model compiled to ONNX alone (verified like every candidate), for the FastAPI +
    onnxruntime peer and the hand-written services, when the served version holds no ONNX artifact
    (e.g. the tree kernel alone)."""
    import yaml

    from scorestack.compile import compile_model

    spec = yaml.safe_load(spec_path.read_text())
    name = f"{spec['name']}_onnx"
    spec.update(name=name, formats=["onnx"])
    spec.setdefault("serving", {})["dispatch"] = False
    # Written into the workspace, the spec's files resolved against the original spec's folder.
    spec["source"]["path"] = str((spec_path.parent / spec["source"]["path"]).resolve())
    spec["holdout"] = str((spec_path.parent / spec["holdout"]).resolve())
    workspace.mkdir(parents=True, exist_ok=True)
    derived = workspace / f"{name}.yaml"
    derived.write_text(yaml.safe_dump(spec))
    repository = workspace / "onnx_repository"
    compile_model(derived, repository, force=recompile, serve_check=False)
    onnx = _served_onnx(repository / name)
    if onnx is None:
        raise FileNotFoundError(f"{repository / name}: compiling the model to ONNX wrote no .onnx artifact")
    return onnx


if __name__ == "__main__":
    from scorestack import paths

    m = prepare(paths.workspace() / "bench_peers")
    print(m)
