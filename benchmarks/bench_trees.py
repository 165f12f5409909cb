"""Tree models users bring: six the demo never trained, compiled with the spec a user writes first.

Each is trained on synthetic data, saved with joblib and compiled with a spec naming only the source,
task, features and held-out rows. From the compile report: compile time and phases, the selected
format, its speed against the source library's own predict (the `native` candidate, serving threads),
the served model checked over gRPC against the source. Results: results/trees.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import joblib
import numpy as np
import yaml
from harness import machine, table, write_results

from scorestack import paths
from scorestack.compile import compile_model


def models(quick: bool) -> dict:
    from lightgbm import LGBMClassifier
    from sklearn.ensemble import GradientBoostingRegressor, HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from xgboost import XGBClassifier

    k = 4 if quick else 1
    return {
        "hgb_defaults": ("binary", HistGradientBoostingClassifier(random_state=0)),
        "rf_unbounded": ("binary", RandomForestClassifier(100 // k, n_jobs=2, random_state=0)),
        "xgb_5_classes": ("multiclass", XGBClassifier(n_estimators=200 // k, max_depth=8, n_jobs=2, random_state=0)),
        "lgbm_joblib": ("binary", LGBMClassifier(n_estimators=200 // k, num_leaves=63, n_jobs=2, verbose=-1, random_state=0)),
        "gbr_hundreds": ("regression", GradientBoostingRegressor(n_estimators=100 // k, random_state=0)),
        "scaler_logistic": ("binary", make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))),
    }


def data(task: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification, make_regression

    if task == "regression":
        X, y = make_regression(n_samples=rows, n_features=20, n_informative=10, noise=5.0, random_state=0)
        return X.astype(np.float32), y / np.abs(y).max() * 490  # targets up to ±490
    X, y = make_classification(n_samples=rows, n_features=20, n_informative=10, n_classes=5 if task == "multiclass" else 2, random_state=0)
    return X.astype(np.float32), y


def compile_one(name: str, task: str, model, rows: int, work: Path) -> dict:
    X, y = data(task, rows)
    cut = rows * 9 // 10
    model.fit(X[:cut], y[:cut])
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, d / "model.joblib")
    np.savez(d / "holdout.npz", X=X[cut:], y=y[cut:])
    spec = {"name": name, "source": {"path": "model.joblib", "format": "joblib", "trusted": True}, "task": task,
            "inputs": {"features": [f"f{i}" for i in range(X.shape[1])]}, "holdout": "holdout.npz"}  # fmt: skip
    (d / "spec.yaml").write_text(yaml.safe_dump(spec))
    t0 = time.perf_counter()
    r = compile_model(d / "spec.yaml", work / "repository", force=True)
    wall = time.perf_counter() - t0
    by = {c.format: c for c in r.candidates}
    sizes = [str(b) for b in r.batch_sizes]
    largest = str(max(r.batch_sizes))
    sel = r.selected.latency_us
    native = by.get("native")
    ratio = {b: native.latency_us[b] / sel[b] for b in ("1", largest) if native and b in native.latency_us and b in sel}
    out = {
        "task": task, "source": r.source.description, "compile_s": round(wall, 1), "phases_s": r.phases_s, "selected": r.selected.format,
        "selected_us": {b: sel.get(b) for b in sizes}, "vs_native": ratio, "largest_batch": int(largest),
        "served_max_abs_diff": r.serve_check.max_abs_diff, "serve_check": r.serve_check.status, "tolerance": [r.tolerance, r.relative_tolerance],
        "candidates": [{"format": c.format, "status": c.status, "s": round(sum(t or 0 for t in (c.convert_s, c.load_s, c.verify_s)), 2),
                        "b1_us": c.latency_us.get("1"), "reason": (c.reason or "")[:200]} for c in r.candidates],
    }  # fmt: skip
    out["served"] = served_b1(work / "repository", name, X[cut:])
    if name.startswith("lgbm"):
        out["lightgbm_b1"] = lightgbm_side_by_side(work / "repository" / name, model.booster_, X[cut:], d)
        out["lightgbm_predict_b1_us"] = out["lightgbm_b1"]["warm"]["us"]["predict_fastest"]
    return out


COLD_BYTES = 4 << 20  # the cold condition: this much other memory written before each timed call


def lightgbm_side_by_side(folder: Path, booster, X: np.ndarray, work: Path, rounds: int = 7, calls: int = 400) -> dict:
    """One row at a time, in this process, interleaved rounds (the order turning): LightGBM's own `Booster.predict` on
    the model file (plain, and with num_threads=1: the faster of the two in each round is the peer), LightGBM's
    single-row C API through the runtime's native runner (the `native` candidate at its fastest), and the compiled
    version folder through the model runtime (what the Python backend and the embedded runtime call). Medians per
    round; the ratio is taken within each round, so a slow moment slows both sides.

    Two conditions: warm (calls back to back, as the compiler times them) and cold (COLD_BYTES of other memory written
    before each call, as a server's request handling does between two lone requests: it evicts the model's arrays
    from the caches, and the served compute of a model is above the compiler's timing for that reason)."""
    import lightgbm

    from scorestack.serve.embedded import _Model

    # The version folder as the embedded mode loads it: its own runtime file, its reference rows reproduced first.
    model = _Model(folder.name, folder)
    runtime = model.runtime
    booster.save_model(work / "native.txt")
    native = model.runtime_module.LightGBMRunner(str(work / "native.txt"), 1, {}, ["y"])
    rows = [np.ascontiguousarray(X[i : i + 1], dtype=np.float32) for i in range(64)]
    np.testing.assert_allclose(runtime.execute([[rows[0]]])[0][0].reshape(-1)[-1], booster.predict(rows[0], num_threads=1)[-1], rtol=1e-5)
    loaded = lightgbm.Booster(model_file=str(work / "native.txt"))  # as a service loads it
    fns = {"predict": lambda x: loaded.predict(x), "predict_threads_1": lambda x: loaded.predict(x, num_threads=1),
           "native": lambda x: native.run([("x", x)]), "compiled": lambda x: runtime.execute([[x]])}
    other = np.ones(COLD_BYTES // 8)
    out: dict = {"rounds": rounds, "calls": calls, "format": runtime.bands[0].runtime, "cold_bytes": COLD_BYTES}
    for condition in ("warm", "cold"):
        per: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(rounds):
            for k in list(fns)[r % len(fns):] + list(fns)[: r % len(fns)]:
                fn = fns[k]
                for x in rows[:8]:
                    fn(x)
                times = []
                for i in range(calls):
                    x = rows[i % len(rows)]
                    if condition == "cold":
                        other += 1.0
                    t = time.perf_counter_ns()
                    fn(x)
                    times.append(time.perf_counter_ns() - t)
                per[k].append(statistics.median(times) / 1000)
        # LightGBM's predict at its faster call form in each round (a keyword argument costs it a parameter parse a call).
        per["predict_fastest"] = [min(a, b) for a, b in zip(per["predict"], per["predict_threads_1"])]
        ratio = lambda a, per=per: sorted(p / c for p, c in zip(per[a], per["compiled"]))
        span = lambda v: [round(v[0], 2), round(statistics.median(v), 2), round(v[-1], 2)]
        out[condition] = {"us": {k: round(statistics.median(v), 2) for k, v in per.items()}, "per_round_us": per,
                          "predict_over_compiled": span(ratio("predict_fastest")), "native_over_compiled": span(ratio("native"))}
    return out


def served_b1(repository: Path, name: str, X: np.ndarray, n: int = 2000) -> dict:
    """The model as served: `n` one-row requests over gRPC to a local Triton (held-out rows in turn),
    and Triton's own compute time per batch-1 execution from its statistics (compute_infer: the
    backend's call into the model, without the request's transport), with the backend that ran it."""
    import tritonclient.grpc as grpcclient

    from scorestack.client.server_stats import parse_statistics
    from scorestack.serve import LocalTriton

    rows = np.ascontiguousarray(X, dtype=np.float32)
    with LocalTriton(repository, models=[name], exit_timeout_s=0) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            cfg = client.get_model_config(name).config

            def infer(i: int):
                x = rows[i % len(rows)][None]
                tensor = grpcclient.InferInput(cfg.input[0].name, list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                return client.infer(name, [tensor])

            def stats():
                return parse_statistics(client.get_inference_statistics(name, as_json=True))[name]

            for i in range(200):  # warm-up
                infer(i)
            before = stats()
            for i in range(n):
                infer(i)
            window = stats() - before  # every request one row: each execution is a batch of 1
        finally:
            client.close()

    def per_execution_us(phase) -> float:
        return round(phase.ns / max(1, phase.count) / 1000, 2)

    return {"backend": cfg.backend or cfg.platform, "requests": n, "executions": window.execution_count,
            "compute_b1_us": per_execution_us(window.compute_infer), "input_b1_us": per_execution_us(window.compute_input),
            "output_b1_us": per_execution_us(window.compute_output)}


def render(data: dict) -> str:
    lines = ["# Tree models users bring, compiled with the spec a user writes first", "", data["note"], ""]
    rows = []
    for name, m in data["models"].items():
        vs = m["vs_native"]
        served = m.get("served") or {}
        lg = ""
        if "lightgbm_b1" in m:
            sb = m["lightgbm_b1"]
            lg = f"; side by side, {sb['rounds']} rounds: " + "; ".join(
                f"{c} compiled {sb[c]['us']['compiled']:.1f}, LightGBM predict {sb[c]['us']['predict_fastest']:.1f} = {sb[c]['predict_over_compiled'][1]:.1f}x "
                f"[{sb[c]['predict_over_compiled'][0]:.1f}–{sb[c]['predict_over_compiled'][2]:.1f}], LightGBM C API {sb[c]['us']['native']:.1f} = "
                f"{sb[c]['native_over_compiled'][1]:.1f}x" for c in ("warm", "cold"))
        elif "lightgbm_predict_b1_us" in m:
            lg = f"; LightGBM predict {m['lightgbm_predict_b1_us']:.0f} µs = {m['lightgbm_predict_b1_us'] / m['selected_us']['1']:.1f}x"
        sv = f"{served['compute_b1_us']:.1f} ({served['backend']}; input {served['input_b1_us']:.1f}, output {served['output_b1_us']:.1f})" if served else "–"
        if served and "lightgbm_predict_b1_us" in m:  # Python predict against Triton's own compute time: a lower bound on the served ratio
            sv += f"; LightGBM predict / served = {m['lightgbm_predict_b1_us'] / served['compute_b1_us']:.1f}x"
        rows.append([name, f"{m['compile_s']:.0f}", m["selected"], f"{m['selected_us']['1']:.1f}{lg}", sv,
                     " / ".join(f"{vs[b]:.1f}x" for b in vs) or "–", f"{m['served_max_abs_diff']:.1e} ({m['serve_check']})"])  # fmt: skip
    lines += table(["model", "compile s", "selected", "batch 1 µs (compile's timing, Python runtime)", "served batch 1 µs (Triton compute_infer)",
                    "vs native b1 / largest", "served max |Δ|"], rows)
    for name, m in data["models"].items():
        lines += ["", f"## {name}: {m['source']}", "", "Phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in m["phases_s"].items()), ""]
        lines += table(["candidate", "status", "build + load + verify s", "batch 1 µs", "reason"],
                       [[c["format"], c["status"], f"{c['s']:.1f}", "–" if c["b1_us"] is None else f"{c['b1_us']:.1f}", c["reason"]] for c in m["candidates"]])  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the trees and rows (a smoke run, not for the results)")
    ap.add_argument("--only", help="comma-separated model names")
    args = ap.parse_args(argv)
    rows = 5000 if args.quick else 20000
    work = paths.workspace() / "bench_trees"
    chosen = {k: v for k, v in models(args.quick).items() if not args.only or k in args.only.split(",")}
    results = {}
    for name, (task, model) in chosen.items():
        print(f"== {name}", flush=True)
        results[name] = compile_one(name, task, model, rows, work)
        print(f"   compiled in {results[name]['compile_s']} s: {results[name]['selected']}", flush=True)
    note = (f"{rows} synthetic rows (20 features; 10% held out); each model compiled once with `force`; compile s is the wall time of "
            "compile_model, phases from its report. vs native: the source library's predict (the `native` candidate, serving threads) "
            "over the selected format, in the same worker. Served: 2,000 one-row gRPC requests to a local Triton holding only the model, "
            "its compute_infer per batch-1 execution from Triton's statistics, with the backend that served it (scorestack_native: the "
            "library called on Triton's own threads; python: the runtime the compile timed). LightGBM side by side: one process, interleaved "
            "rounds of one-row calls to LightGBM's Booster.predict (its faster call form), LightGBM's single-row C API (the native runner) and "
            "the compiled folder through the model runtime; warm (back to back) and cold (4 MiB of other memory written before each call).")  # fmt: skip
    data = {"machine": machine(), "quick": args.quick, "rows": rows, "note": note, "models": results}
    write_results("trees" if not args.quick else "trees_quick", data, render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
