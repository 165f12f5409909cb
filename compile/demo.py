"""Demo models: train the fraud (XGBoost, scikit-learn) and ranking (XGBRanker) models and write their specs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from scorestack import demo_data, schema

DEMO_MODELS = ("fraud_xgb", "fraud_sklearn", "ranking_xgb")
# Online fraud scoring: mostly single requests, small dynamic batches under load.
_SERVING = {"batch_sizes": [1, 8, 64], "batch_weights": [0.7, 0.2, 0.1], "latency_budget_ms": 10}


def _write_spec(path: Path, spec: dict) -> None:
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(spec, sort_keys=False))
    tmp.replace(path)  # the spec lands last: its presence means the model's files are complete


def _split(n: int, seed: int, frac: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    cut = int(n * (1 - frac))
    return np.sort(idx[:cut]), np.sort(idx[cut:])


def train_demo_models(
    out_dir: str | Path,
    *,
    xgb_trees: int = 300,
    sklearn_iters: int = 100,
    ranker_trees: int = 200,
    n_fraud: int = 60000,
    n_queries: int = 3000,
    threads: int = 2,
) -> list[Path]:
    """Train the three demo models into `out_dir` (idempotent: existing specs are kept) and return their spec paths."""
    import joblib
    import xgboost as xgb
    from sklearn.ensemble import HistGradientBoostingClassifier

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = {name: out / f"{name}.yaml" for name in DEMO_MODELS}
    if all(p.exists() for p in specs.values()):
        return list(specs.values())

    users = demo_data.make_users()
    if not (specs["fraud_xgb"].exists() and specs["fraud_sklearn"].exists()):
        X, y, _ = demo_data.make_fraud_dataset(users, n=n_fraud)
        tr, te = _split(len(X), seed=5)
        np.savez(out / "fraud_holdout.npz", X=X[te], y=y[te])
        if not specs["fraud_xgb"].exists():
            clf = xgb.XGBClassifier(
                n_estimators=xgb_trees, max_depth=6, learning_rate=0.05, tree_method="hist", n_jobs=threads, random_state=0
            )
            clf.fit(X[tr], y[tr])
            clf.get_booster().save_model(str(out / "fraud_xgb.json"))
            threshold = _review_threshold(clf.predict_proba(X[tr])[:, 1])
            _write_spec(specs["fraud_xgb"], _fraud_spec("fraud_xgb", {"path": "fraud_xgb.json", "format": "xgboost-json", "trusted": False}, threshold))
        if not specs["fraud_sklearn"].exists():
            hgb = HistGradientBoostingClassifier(max_iter=sklearn_iters, learning_rate=0.1, random_state=0)
            hgb.fit(X[tr], y[tr])
            joblib.dump(hgb, out / "fraud_sklearn.joblib")
            threshold = _review_threshold(hgb.predict_proba(X[tr])[:, 1])
            # We trained this file ourselves a moment ago, so unpickling it is safe.
            source = {"path": "fraud_sklearn.joblib", "format": "joblib", "trusted": True}
            _write_spec(specs["fraud_sklearn"], _fraud_spec("fraud_sklearn", source, threshold))
    if not specs["ranking_xgb"].exists():
        items = demo_data.make_items()
        X, rel, groups = demo_data.make_ranking_dataset(users, items, n_queries=n_queries)
        n_train_q = int(len(groups) * 0.8)
        cut = int(groups[:n_train_q].sum())
        np.savez(out / "ranking_holdout.npz", X=X[cut:], y=rel[cut:], group=groups[n_train_q:])
        ranker = xgb.XGBRanker(
            n_estimators=ranker_trees, max_depth=6, learning_rate=0.1, objective="rank:ndcg", tree_method="hist", n_jobs=threads, random_state=0
        )
        ranker.fit(X[:cut], rel[:cut], group=groups[:n_train_q])
        ranker.get_booster().save_model(str(out / "ranking_xgb.json"))
        _write_spec(
            specs["ranking_xgb"],
            {
                "name": "ranking_xgb",
                "source": {"path": "ranking_xgb.json", "format": "xgboost-json", "trusted": False},
                "task": "ranking",
                "inputs": {"features": list(schema.RANKING_FEATURES), "dtype": "float32"},
                "outputs": [schema.OUTPUT_TENSORS["ranking"]],
                # One ranking request scores a user's candidates (the demo sends 200) in one batch.
                "serving": {"batch_sizes": [1, 50, 200], "batch_weights": [0.1, 0.3, 0.6], "latency_budget_ms": 10},
                "verification": {"tolerance": 1e-5},
                "threads": [1],
                "holdout": "ranking_holdout.npz",
            },
        )
    return list(specs.values())


def _fraud_spec(name: str, source: dict, threshold: float) -> dict:
    """The spec of a demo fraud model: same features, batch mix, tolerance and held-out rows."""
    return {
        "name": name,
        "source": source,
        "task": "binary",
        "inputs": {"features": list(schema.FRAUD_FEATURES), "dtype": "float32"},
        "outputs": [schema.OUTPUT_TENSORS["binary"]],
        "target": "cpu",
        "serving": {**_SERVING, "decision_threshold": threshold},
        "verification": {"tolerance": 1e-5},
        "threads": [1],
        "holdout": "fraud_holdout.npz",
    }


def _review_threshold(train_scores: np.ndarray, review_rate: float = 0.02) -> float:
    """The score above which the top `review_rate` of training transactions go to review (about
    the fraud rate, 1.5%, plus headroom): a business choice the spec records, not a model property."""
    return round(float(np.quantile(train_scores, 1.0 - review_rate)), 6)
