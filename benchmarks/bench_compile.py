"""The compiler's pick against native XGBoost for the demo fraud model, side by side in one process.

    python benchmarks/bench_compile.py [--models DIR] [--rounds 7]

Trains the demo models if absent (scorestack.compile.train_demo_models), compiles `fraud_xgb` into a
temporary repository, then times, at batch 1, 64 and 1024:
  - the selected artifact, through the model runtime in the server environment (the compiler's worker);
  - native XGBoost through the same runtime and worker (Booster.inplace_predict, nthread=1);
  - native XGBoost the way a user writes it (XGBClassifier.predict_proba, default threads), in this
    process; its rounds alternate with the worker's.
Writes benchmarks/results/compile_fraud_xgb.json and .md and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from scorestack.compile import compile_model, emit, train_demo_models
from scorestack.compile.registry import Artifact
from scorestack.paths import workspace
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.serve.worker import RuntimeWorker
from scorestack.triton_config import load_config

BATCHES = (1, 64, 1024)
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=workspace() / "models")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import xgboost as xgb

    specs = {p.stem: p for p in train_demo_models(args.models)}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        repo = Path(tmp) / "repo"
        report = compile_model(specs["fraud_xgb"], repo, force=True)
        sel = report.selected
        model_file = args.models / "fraud_xgb.json"
        selected_dir = repo / "fraud_xgb" / str(report.version)
        selected_cfg = emit.config_dict(load_config(repo / "fraud_xgb" / "config.pbtxt"))
        # Native XGBoost as the runtime serves it: the same config with the xgboost runner.
        native_dir = Path(tmp) / "native" / "1"
        emit.package_version(native_dir, Artifact("native", "xgboost", "python", "model.json", model_file))
        native_cfg = json.loads(json.dumps(selected_cfg))
        params = native_cfg["parameters"]
        params[rt.PARAM_RUNTIME] = {"string_value": "xgboost"}
        params[rt.PARAM_ARTIFACT] = {"string_value": "model.json"}
        params[rt.PARAM_THREADS] = {"string_value": "1"}
        params.pop(rt.PARAM_OUTPUT_COLUMN, None)

        clf = xgb.XGBClassifier()
        clf.load_model(str(model_file))

        def native_predict_proba(x: np.ndarray) -> np.ndarray:
            return clf.predict_proba(x)[:, 1:2]

        X = np.load(args.models / "fraud_holdout.npz")["X"]
        ref = xgb.Booster(model_file=str(model_file)).predict(xgb.DMatrix(X))
        sel_key = f"selected ({sel.format})"
        table: dict[str, dict[int, list[float]]] = {k: {b: [] for b in BATCHES} for k in (sel_key, "native inplace_predict", "native predict_proba")}
        with RuntimeWorker() as worker:
            worker.load(sel_key, "fraud_xgb", selected_dir, selected_cfg)
            worker.load("native inplace_predict", "fraud_xgb", native_dir, native_cfg)
            diffs = {k: float(np.abs(worker.execute(k, X, [len(X)])[0][:, 0] - ref).max()) for k in (sel_key, "native inplace_predict")}
            diffs["native predict_proba"] = float(np.abs(native_predict_proba(X)[:, 0] - ref).max())
            for r in range(args.rounds):  # worker rounds alternate with this process's rounds
                for k, per in worker.measure([sel_key, "native inplace_predict"], X, list(BATCHES), rounds=1, cell_budget_s=0.15, max_calls=2000, min_calls=5, seed=r).items():
                    for b, v in per.items():
                        table[k][b].append(v)
                for b in BATCHES:
                    table["native predict_proba"][b].append(_median_us(native_predict_proba, np.ascontiguousarray(np.resize(X, (b, X.shape[1])))))
        table = {k: {b: float(np.median(v)) for b, v in per.items()} for k, per in table.items()}

    ratios = {str(b): table["native inplace_predict"][b] / table[sel_key][b] for b in BATCHES}
    ratios_user = {str(b): table["native predict_proba"][b] / table[sel_key][b] for b in BATCHES}
    result = {
        "benchmark": "compile_fraud_xgb",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": report.source.description,
        "holdout_rows": int(len(X)),
        "selected": {"format": sel.format, "runtime": sel.runtime, "threads": sel.threads},
        "compile_candidates": {c.format: {"status": c.status, "latency_us": c.latency_us, "reason": c.reason} for c in report.candidates},
        "method": f"{args.rounds} rounds; the selected and native runtimes interleaved in the server-environment worker, "
        "predict_proba in the project process between them; median µs per call",
        "latency_us": {k: {str(b): round(v, 2) for b, v in per.items()} for k, per in table.items()},
        "rows_per_s": {k: {str(b): round(b / v * 1e6) for b, v in per.items()} for k, per in table.items()},
        "max_abs_diff_vs_source": diffs,
        "speedup_selected_vs_native_inplace": {k: round(v, 2) for k, v in ratios.items()},
        "speedup_selected_vs_native_predict_proba": {k: round(v, 2) for k, v in ratios_user.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_fraud_xgb.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Compiled fraud model vs native XGBoost",
        "",
        f"{report.source.description}; {len(X)} held-out rows; {result['method']}; "
        f"{os.cpu_count()} CPUs ({platform.platform()}). Generated by `benchmarks/bench_compile.py`.",
        "",
        "| path | " + " | ".join(f"batch {b} µs" for b in BATCHES) + " | max abs diff |",
        "|---|" + "---|" * len(BATCHES) + "---|",
    ]
    for k, per in table.items():
        lines.append(f"| {k} | " + " | ".join(f"{per[b]:.1f}" for b in BATCHES) + f" | {diffs[k]:.1e} |")
    lines += [
        "",
        "| speedup of the selected artifact | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
        "|---|" + "---|" * len(BATCHES),
        "| vs native inplace_predict (1 thread) | " + " | ".join(f"{ratios[str(b)]:.2f}x" for b in BATCHES) + " |",
        "| vs XGBClassifier.predict_proba (default threads) | " + " | ".join(f"{ratios_user[str(b)]:.2f}x" for b in BATCHES) + " |",
        "",
        f"The compiler selected **{sel.format}** for the spec's batch mix (batch sizes {report.batch_sizes}, weights "
        f"{report.batch_weights}); the table above also shows batch 1024, outside that mix.",
        "",
    ]
    (RESULTS / "compile_fraud_xgb.md").write_text("\n".join(lines))
    print("\n".join(lines))
    for b in BATCHES:
        print(f"batch {b}: selected {sel.format} is {ratios[str(b)]:.2f}x native inplace_predict, {ratios_user[str(b)]:.2f}x predict_proba")


def _median_us(fn, x: np.ndarray, budget_s: float = 0.15, max_calls: int = 2000) -> float:  # noqa: ANN001
    import time

    fn(x)
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 5 or (len(samples) < max_calls and time.perf_counter() < deadline):
        t0 = time.perf_counter_ns()
        fn(x)
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return float(np.median(samples))


if __name__ == "__main__":
    main()
