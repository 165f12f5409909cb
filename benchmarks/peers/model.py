"""The fraud model every peer serves: the demo XGBoost, trained and compiled through scorestack's public API.

Returns the source XGBoost JSON, the compiled ONNX artifact, the feature names and the compiled
model folder (config.pbtxt with the derived dynamic batching) in the benchmark workspace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FraudModel:
    xgb_json: Path          # the trained XGBoost model (the source file of the spec)
    onnx: Path              # the compiled artifact scorestack serves (ONNX)
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
    report = compile_model(specs["fraud_xgb"], repository, force=recompile)
    model_dir = repository / "fraud_xgb"
    return FraudModel(
        xgb_json=workspace / "models" / "fraud_xgb.json",
        onnx=_served_onnx(model_dir),
        model_dir=model_dir,
        features=tuple(schema.FRAUD_FEATURES),
        report=json.loads((model_dir / "report.json").read_text()) if (model_dir / "report.json").exists() else {},
    )


def _served_onnx(model_dir: Path) -> Path:
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not versions:
        raise FileNotFoundError(f"{model_dir}: no version folder; compile the fraud model first")
    onnx = sorted(versions[-1].rglob("*.onnx"))
    if not onnx:
        raise FileNotFoundError(f"{versions[-1]}: the compiled fraud model holds no .onnx artifact (files: {sorted(p.name for p in versions[-1].iterdir())})")
    return onnx[0]


if __name__ == "__main__":
    from scorestack import paths

    m = prepare(paths.workspace() / "bench_peers")
    print(m)
