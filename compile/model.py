"""The compiler's core types: a loaded source model with its reference predictions, and held-out rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SourceModel:
    """A loaded model, its family (the registry key) and its reference predictions in the tensor contract.

    `model` is an `xgboost.Booster` for the xgboost family, a `lightgbm.Booster` for the lightgbm family
    (an LGBMClassifier/LGBMRegressor is unwrapped on load) and a fitted estimator for sklearn families.
    Image models are `compile.vision.VisionSource`, which owns their predict path (this module
    imports nothing of vision's: the dependency goes one way).
    """

    name: str
    task: str
    family: str  # "xgboost" | "lightgbm" | "sklearn-trees" | "sklearn"
    model: Any
    n_features: int
    n_classes: int | None = None
    objective: str | None = None
    description: str = ""
    history: list[str] = field(default_factory=list)  # passes applied ("pruned to 120 trees", ...)
    image: Any = None  # None here; compile.vision.VisionSource holds the spec's ImageSpec
    cache: dict[str, Any] = field(default_factory=dict, repr=False)  # e.g. an ONNX source's inference session

    @property
    def framework(self) -> str:
        return self.family if self.family in ("xgboost", "lightgbm") else "sklearn"

    @property
    def n_trees(self) -> int | None:
        if self.family == "xgboost":
            per_round = self.n_classes if self.task == "multiclass" and self.n_classes else 1
            return int(self.model.num_boosted_rounds()) * per_round
        if self.family == "lightgbm":
            return int(self.model.num_trees())
        est = self.model
        for attr in ("n_iter_", "n_estimators_"):
            if hasattr(est, attr):
                return int(getattr(est, attr))
        if hasattr(est, "estimators_"):
            return len(est.estimators_)
        return None

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Reference scores through the library's standard predict path: [n, 1] (or [n, k] for multiclass)."""
        X = np.ascontiguousarray(X, dtype=np.float32)
        if self.family == "xgboost":
            import xgboost as xgb

            dm = xgb.DMatrix(X, feature_names=self.model.feature_names)
            out = np.asarray(self.model.predict(dm))
        elif self.family == "lightgbm":
            # LightGBM's own predict: probabilities for binary/multiclass, the transformed score otherwise.
            out = np.asarray(self.model.predict(X, num_threads=1))
        elif self.task in ("binary", "multiclass"):
            out = np.asarray(self.model.predict_proba(X))
            if self.task == "binary":
                out = out[:, 1]
        else:
            out = np.asarray(self.model.predict(X))
        out = out.astype(np.float64, copy=False)
        return out.reshape(len(X), -1)


@dataclass(frozen=True)
class Holdout:
    """Held-out rows for verification and calibration; `groups` are query-group sizes for ranking."""

    X: np.ndarray
    y: np.ndarray | None
    groups: np.ndarray | None

    def __len__(self) -> int:
        return len(self.X)

    def group_ids(self) -> np.ndarray | None:
        if self.groups is None:
            return None
        return np.repeat(np.arange(len(self.groups)), self.groups)

    def subset_groups(self, start: int, stop: int) -> "Holdout":
        """Whole groups [start, stop) (or a row range when there are no groups)."""
        if self.groups is None:
            sl = slice(start, stop)
            return Holdout(self.X[sl], None if self.y is None else self.y[sl], None)
        bounds = np.concatenate([[0], np.cumsum(self.groups)])
        sl = slice(int(bounds[start]), int(bounds[stop]))
        return Holdout(self.X[sl], None if self.y is None else self.y[sl], self.groups[start:stop])

    def halves(self) -> tuple["Holdout", "Holdout"]:
        n = len(self.groups) if self.groups is not None else len(self.X)
        mid = n // 2
        return self.subset_groups(0, mid), self.subset_groups(mid, n)
