"""The served artifact against native XGBoost at every batch size the server may execute, side by side in one run.

    python benchmarks/bench_compile.py [--models DIR] [--rounds 7] [--max-batch 1024]

Trains the demo models if absent, compiles the fraud model and the ranker with the spec's batch mix
and `max_batch_size` 1024 (so the compiler measures its grid up to 1024 and may dispatch by batch
size), then times, at batch 1, 8, 64, 256 and 1024:
  - the served artifact: the version folder and config.pbtxt as emitted, through the model runtime in
    the server environment (the compiler's worker: what Triton's Python backend runs);
  - the runtime's own native XGBoost runner through the same worker (XGBoost's C API, the same threads);
  - native XGBoost as the issue measured it, `Booster.inplace_predict` (nthread = the served threads),
    and the way a user writes it (XGBClassifier.predict_proba / XGBRanker.predict, default threads),
    both in this process (the same XGBoost release as the server environment), without the runtime's
    per-call work, so the ratios against them are conservative; their rounds alternate with the worker's.
Writes benchmarks/results/compile.json and compile.md: µs per call, ratios, the bands the compiler
chose, the targets (served >= 1.0x native at every size, >= 15x at batch 1, >= 1.4x at 64) and the
load of the machine while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from scorestack.compile import compile_model, emit
from scorestack.demo.train import train_demo_models
from scorestack.compile.registry import Artifact
from scorestack.paths import workspace
from scorestack.serve.runtime import scorestack_runtime as rt
from scorestack.serve.runtime.worker import distinct_batches, median_us
from scorestack.serve.worker import RuntimeWorker
from scorestack.triton_config import load_config

BATCHES = (1, 8, 64, 256, 1024)
MODELS = {"fraud_xgb": "fraud_holdout.npz", "ranking_xgb": "ranking_holdout.npz"}
TARGETS = {"every size": 1.0, "batch 1": 15.0, "batch 64": 1.4}  # served vs Booster.inplace_predict
RESULTS = Path(__file__).resolve().parent / "results"


def _bench_spec(models: Path, name: str, out: Path, max_batch: int) -> Path:
    spec = yaml.safe_load((models / f"{name}.yaml").read_text())
    spec["serving"]["max_batch_size"] = max_batch
    spec["source"]["path"] = str((models / spec["source"]["path"]).resolve())
    spec["holdout"] = str((models / spec["holdout"]).resolve())
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _native_config(served: dict[str, Any], threads: int) -> dict[str, Any]:
    """The served config with the runner swapped for native XGBoost (same tensors, same threads)."""
    cfg = json.loads(json.dumps(served))
    params = cfg["parameters"]
    for key in (rt.PARAM_DISPATCH, rt.PARAM_OUTPUT_COLUMN, rt.PARAM_METHOD):
        params.pop(key, None)
    params[rt.PARAM_RUNTIME] = {"string_value": "xgboost"}
    params[rt.PARAM_ARTIFACT] = {"string_value": "model.json"}
    params[rt.PARAM_THREADS] = {"string_value": str(threads)}
    return cfg


def bench_model(name: str, models: Path, tmp: Path, rounds: int, max_batch: int) -> dict[str, Any]:
    import xgboost as xgb

    spec = _bench_spec(models, name, tmp, max_batch)
    repo = tmp / "repo"
    report = compile_model(spec, repo, force=True)
    served_dir = repo / name / str(report.version)
    served_cfg = emit.config_dict(load_config(repo / name / "config.pbtxt"))
    threads = int(served_cfg["parameters"][rt.PARAM_THREADS]["string_value"])
    source = models / f"{name}.json"
    native_dir = tmp / f"native-{name}" / "1"
    emit.package_version(native_dir, Artifact("native", "xgboost", "python", "model.json", source))
    native_cfg = _native_config(served_cfg, threads)

    if report.source.task == "binary":
        user_model = xgb.XGBClassifier()
        user_model.load_model(str(source))

        def user_predict(x: np.ndarray) -> np.ndarray:
            return user_model.predict_proba(x)[:, 1:2]

        user_label = "XGBClassifier.predict_proba"
    else:
        user_model = xgb.XGBRanker()
        user_model.load_model(str(source))

        def user_predict(x: np.ndarray) -> np.ndarray:
            return user_model.predict(x).reshape(-1, 1)

        user_label = "XGBRanker.predict"

    booster = xgb.Booster(model_file=str(source))
    booster.set_param({"nthread": threads})

    def inplace(x: np.ndarray) -> np.ndarray:
        return booster.inplace_predict(x).reshape(len(x), -1)

    inplace_label = f"Booster.inplace_predict ({threads} thread(s), in process)"
    X = np.load(models / MODELS[name])["X"].astype(np.float32)
    ref = xgb.Booster(model_file=str(source)).predict(xgb.DMatrix(X)).reshape(-1, 1)
    keys = {"served": f"served ({report.selected.format})", "native": "runtime native runner (C API)"}
    in_process = {inplace_label: inplace, user_label: user_predict}
    table: dict[str, dict[int, list[float]]] = {k: {b: [] for b in BATCHES} for k in (*keys.values(), *in_process)}
    load_before = os.getloadavg()
    with RuntimeWorker() as worker:
        worker.load(keys["served"], name, served_dir, served_cfg)
        worker.load(keys["native"], name, native_dir, native_cfg)
        diffs = {k: float(np.abs(worker.execute(k, X, [len(X)])[0] - ref).max()) for k in keys.values()}
        for k, fn in in_process.items():
            diffs[k] = float(np.abs(fn(X) - ref).max())
        for r in range(rounds):  # worker rounds alternate with this process's rounds
            for k, per in worker.measure(list(keys.values()), X, list(BATCHES), rounds=1, cell_budget_s=0.15, max_calls=2000, min_calls=5, seed=r).items():
                for b, v in per.items():
                    table[k][b].append(v)
            for k, fn in in_process.items():
                for b in BATCHES:
                    table[k][b].append(median_us(fn, distinct_batches(X, b)))
    load_after = os.getloadavg()
    med = {k: {b: float(np.median(v)) for b, v in per.items()} for k, per in table.items()}
    served, native = med[keys["served"]], med[inplace_label]
    ratios = {b: native[b] / served[b] for b in BATCHES}
    ratios_runner = {b: med[keys["native"]][b] / served[b] for b in BATCHES}
    ratios_user = {b: med[user_label][b] / served[b] for b in BATCHES}
    checks = {
        "every size": min(ratios.values()) >= TARGETS["every size"],
        "batch 1": ratios[1] >= TARGETS["batch 1"],
        "batch 64": ratios[64] >= TARGETS["batch 64"],
    }
    d = report.dispatch
    return {
        "model": name,
        "description": report.source.description,
        "holdout_rows": int(len(X)),
        "spec_batch_sizes": yaml.safe_load(spec.read_text())["serving"]["batch_sizes"],
        "max_batch_size": max_batch,
        "selected": {"format": report.selected.format, "runtime": report.selected.runtime, "threads": report.selected.threads},
        "bands": d.bands if d is not None and d.status == "selected" else [{"format": report.selected.format, "min_rows": 1, "max_rows": max_batch}],
        "dispatch_decision": d.decision if d is not None else "one verified candidate",
        "compile_curves_us": d.curves_us if d is not None else {},
        "latency_us": {k: {str(b): round(v, 2) for b, v in per.items()} for k, per in med.items()},
        "max_abs_diff_vs_source": diffs,
        "speedup_served_vs_native": {str(b): round(v, 2) for b, v in ratios.items()},
        "speedup_served_vs_runtime_native_runner": {str(b): round(v, 2) for b, v in ratios_runner.items()},
        "native_label": inplace_label,
        "speedup_served_vs_user": {str(b): round(v, 2) for b, v in ratios_user.items()},
        "user_label": user_label,
        "targets_met": checks,
        "loadavg_before_after": [list(load_before), list(load_after)],
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        "# The served artifact vs native XGBoost, at every batch size the server may execute",
        "",
        f"{result['method']}. {result['machine']['cpus']} CPUs ({result['machine']['platform']}), {result['created_at']}. "
        "Generated by `benchmarks/bench_compile.py`.",
        "",
    ]
    for m in result["models"]:
        keys = list(m["latency_us"])
        lines += [
            f"## {m['model']}",
            "",
            f"{m['description']}; {m['holdout_rows']} held-out rows; spec batch sizes {m['spec_batch_sizes']}, max_batch_size {m['max_batch_size']}. "
            f"Served: **{m['selected']['format']}** ({m['selected']['threads']} thread(s)), bands "
            + "; ".join(f"{b['format']} {b['min_rows']}-{b['max_rows']} rows" for b in m["bands"])
            + f". Compiler: {m['dispatch_decision']}. Load average before/after: {m['loadavg_before_after'][0][0]:.2f} / {m['loadavg_before_after'][1][0]:.2f}.",
            "",
            "| µs per call | " + " | ".join(f"batch {b}" for b in BATCHES) + " | max abs diff |",
            "|---|" + "---|" * len(BATCHES) + "---|",
        ]
        for k in keys:
            lines.append(f"| {k} | " + " | ".join(f"{m['latency_us'][k][str(b)]:.1f}" for b in BATCHES) + f" | {m['max_abs_diff_vs_source'][k]:.1e} |")
        lines += [
            "",
            "| speedup of the served artifact | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
            "|---|" + "---|" * len(BATCHES),
            f"| vs {m['native_label']} | " + " | ".join(f"{m['speedup_served_vs_native'][str(b)]:.2f}x" for b in BATCHES) + " |",
            "| vs the runtime's native runner (same worker) | " + " | ".join(f"{m['speedup_served_vs_runtime_native_runner'][str(b)]:.2f}x" for b in BATCHES) + " |",
            f"| vs {m['user_label']} (default threads) | " + " | ".join(f"{m['speedup_served_vs_user'][str(b)]:.2f}x" for b in BATCHES) + " |",
            "",
            "Targets vs Booster.inplace_predict: " + ", ".join(f"{name} >= {TARGETS[name]}x: {'met' if ok else 'MISSED'}" for name, ok in m["targets_met"].items()) + ".",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=workspace() / "models")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-batch", type=int, default=1024)
    args = parser.parse_args()

    train_demo_models(args.models)
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        models = [bench_model(name, args.models, Path(tmp), args.rounds, args.max_batch) for name in MODELS]
    result = {
        "benchmark": "compile",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "method": f"{args.rounds} rounds; the served and native runtimes interleaved in the server-environment worker, "
        "the user's call in the project process between them; median µs per call",
        "models": models,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (RESULTS / "compile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
