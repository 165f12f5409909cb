"""Loaders: turn a spec's source file into a SourceModel (compile/model.py) with a reference `predict`, and read held-out rows."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from scorestack.errors import SpecError

from .model import Holdout, SourceModel
from .spec import ModelSpec

# Bare tree ensembles: TL2cgen (via Treelite) can compile these; pipelines and linear models it cannot.
SKLEARN_TREE_ENSEMBLES = (
    "RandomForestClassifier",
    "RandomForestRegressor",
    "ExtraTreesClassifier",
    "ExtraTreesRegressor",
    "GradientBoostingClassifier",
    "GradientBoostingRegressor",
    "HistGradientBoostingClassifier",
    "HistGradientBoostingRegressor",
)

# LightGBM objectives by task, as the model text names them (`objective=binary sigmoid:1`: its first word).
_LGB_OBJECTIVES = {
    "binary": ("binary",),
    "multiclass": ("multiclass", "multiclassova"),
    "regression": ("regression", "regression_l1", "huber", "fair", "poisson", "quantile", "mape", "gamma", "tweedie"),
    "ranking": ("lambdarank", "rank_xendcg"),
}

_XGB_OBJECTIVES = {
    "binary": ("binary:logistic",),
    "multiclass": ("multi:softprob",),
    "regression": ("reg:", "count:poisson"),
    "ranking": ("rank:",),
}


def load_holdout(path: Path, spec: ModelSpec, source: str, field_name: str = "holdout") -> Holdout:
    """Read a .npz with X [n, n_features] (and y, and group sizes for ranking); image models: uint8 images X and labels y."""
    if spec.is_vision:
        from .vision import load_images

        images = load_images(path, spec, source, field_name)
        return Holdout(images.X, images.y, None)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise SpecError(f"spec {source}: field `{field_name}`: cannot read {path} ({exc}); give a .npz file with arrays X and y") from None
    if "X" not in arrays:
        raise SpecError(f"spec {source}: field `{field_name}`: {path.name} has no array `X` (has {sorted(arrays)}); save it with np.savez(path, X=..., y=...)")
    X = np.ascontiguousarray(arrays["X"], dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != spec.n_features or len(X) == 0:
        raise SpecError(
            f"spec {source}: field `{field_name}`: X has shape {X.shape} but the spec lists {spec.n_features} input features; "
            "X must be [rows, n_features] in the spec's feature order"
        )
    y = arrays.get("y")
    groups = arrays.get("group", arrays.get("groups"))
    if groups is not None:
        groups = np.asarray(groups, dtype=np.int64).ravel()
        if groups.sum() != len(X) or (groups <= 0).any():
            raise SpecError(f"spec {source}: field `{field_name}`: group sizes sum to {int(groups.sum())} but X has {len(X)} rows")
    if spec.task == "ranking" and groups is None:
        raise SpecError(f"spec {source}: field `{field_name}`: a ranking model needs query-group sizes; save them as `group` in {path.name}")
    return Holdout(X, None if y is None else np.asarray(y).ravel(), groups)


def _refuse_untrusted(spec: ModelSpec, source: str) -> None:
    raise SpecError(
        f"spec {source}: field `source.trusted`: refusing to load {spec.source.path.name} ({spec.source.format}): "
        "unpickling runs arbitrary code from the file. If you produced this file yourself, set `trusted: true` "
        "under `source`; otherwise export the model in a data-only format (XGBoost: save_model('model.json'))."
    )


def _load_xgboost_file(path: Path) -> Any:
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(str(path))
    return booster


def _xgb_meta(booster: Any) -> tuple[str, int]:
    cfg = json.loads(booster.save_config())
    learner = cfg["learner"]
    objective = learner["objective"]["name"]
    num_class = int(learner["learner_model_param"].get("num_class", "0") or 0)
    return objective, num_class


def load_source(spec: ModelSpec, source: str) -> SourceModel:
    """Load the spec's model file (refusing unpickling unless trusted) and check it matches the spec."""
    fmt, path = spec.source.format, spec.source.path
    if spec.is_vision or fmt in ("torch-module", "torchscript", "onnx-model"):
        if not spec.is_vision:
            raise SpecError(f"spec {source}: field `task`: a {fmt} source is an image model; set `task: image-classification` (tabular models come as xgboost-json, xgboost-ubj, lightgbm-text, joblib or pickle)")
        from .vision import load_vision_source

        return load_vision_source(spec, source)
    if not path.exists():
        raise SpecError(f"spec {source}: field `source.path`: {path} does not exist; give the model file's path, relative to the spec file")
    if fmt in ("joblib", "pickle") and not spec.source.trusted:
        _refuse_untrusted(spec, source)
    try:
        if fmt in ("xgboost-json", "xgboost-ubj"):
            obj = _load_xgboost_file(path)
        elif fmt == "lightgbm-text":
            import lightgbm as lgb

            obj = lgb.Booster(model_file=str(path))
        elif fmt == "joblib":
            import joblib

            obj = joblib.load(path)
        else:
            with open(path, "rb") as fh:
                obj = pickle.load(fh)
    except SpecError:
        raise
    except Exception as exc:  # any library error means "this file is not a loadable model"
        raise SpecError(
            f"spec {source}: field `source.path`: cannot load {path.name} as {fmt}: {type(exc).__name__}: {_library_message(exc)}; "
            "check that the file is complete and that `source.format` matches it"
        ) from None
    return _wrap(obj, spec, source)


def _library_message(exc: Exception) -> str:
    """XGBoost's errors carry a timestamp, a source path and a native stack trace: keep the sentence."""
    msg = str(exc).split("Stack trace:")[0].strip()
    msg = re.sub(r"^\[[0-9:]+\] \S+: ", "", msg)
    return " ".join(msg.split())[:300]


def _wrap(obj: Any, spec: ModelSpec, source: str) -> SourceModel:
    if type(obj).__module__.split(".")[0] == "lightgbm":  # without importing lightgbm for other models
        return _wrap_lightgbm(getattr(obj, "booster_", obj), spec, source)
    import xgboost as xgb

    if isinstance(obj, xgb.XGBModel):
        return _wrap_xgboost(obj.get_booster(), spec, source, sklearn_api=True)
    if isinstance(obj, xgb.Booster):
        # XGBModel.save_model marks its files; xgb.train's Booster.save_model does not.
        return _wrap_xgboost(obj, spec, source, sklearn_api=obj.attr("scikit_learn") is not None)
    return _wrap_sklearn(obj, spec, source)


def _early_stopping(booster: Any, spec: ModelSpec, sklearn_api: bool) -> tuple[Any, str]:
    """The rounds to serve of a model that records an early-stopping `best_iteration` (the booster,
    sliced where they are fewer than it holds) and what the compile report says about it."""
    best = booster.attr("best_iteration")
    rounds = booster.num_boosted_rounds()
    if best is None or int(best) + 1 >= rounds:
        return booster, ""
    keep = int(best) + 1
    mode = spec.source.iterations
    if mode == "auto":
        mode = "best" if sklearn_api else "all"
    if mode == "best":
        why = "as XGBoost's scikit-learn predict does" if sklearn_api else "`source.iterations: best`"
        return booster[:keep], (f"; early stopping: the {keep} rounds up to its best iteration of {rounds} trained, {why} "
                                "(`source.iterations: all` serves every round)")
    why = "as Booster.predict does" if not sklearn_api else "`source.iterations: all`"
    return booster, (f"; every one of its {rounds} rounds, {why}, though early stopping found the best at {keep} "
                     "(`source.iterations: best` serves those)")


def _wrap_xgboost(booster: Any, spec: ModelSpec, source: str, *, sklearn_api: bool = False) -> SourceModel:
    booster, stopping = _early_stopping(booster, spec, sklearn_api)
    objective, num_class = _xgb_meta(booster)
    allowed = _XGB_OBJECTIVES[spec.task]
    if not any(objective == a or (a.endswith(":") and objective.startswith(a)) for a in allowed):
        raise SpecError(
            f"spec {source}: field `task`: the model's objective is {objective!r}, which does not produce a {spec.task} output "
            f"(expected {' or '.join(allowed)}); set `task` to match the model or retrain it"
        )
    n_features = int(booster.num_features())
    _check_features(n_features, booster.feature_names, spec, source)
    n_classes = num_class if spec.task == "multiclass" else (2 if spec.task == "binary" else None)
    rounds = booster.num_boosted_rounds()
    return SourceModel(
        name=spec.name,
        task=spec.task,
        family="xgboost",
        model=booster,
        n_features=n_features,
        n_classes=n_classes,
        objective=objective,
        description=f"XGBoost Booster, objective {objective}, {rounds} boosting rounds{stopping}",
    )


def lightgbm_has_categorical_splits(model_text: str) -> bool:
    """Any tree of a LightGBM model text splits on a category set (`num_cat=` > 0): `categorical_feature` or pandas category columns."""
    return any(line.startswith("num_cat=") and line != "num_cat=0" for line in model_text.splitlines())


def lightgbm_unexpressible(model_text: str) -> str | None:
    """What of a LightGBM model only LightGBM itself computes (the `native` candidate), said with the
    training setting and the fix, or None. Linear trees: each leaf is a linear function of the row;
    Treelite refuses the model and onnxmltools keeps only the leaves' constants (0.89 off on a small
    regressor). `zero_as_missing=True`: LightGBM scores 0.0 as missing; Treelite and onnxmltools
    compare it as a number (0.94 off on rows with a 0.0). decision_type's bits 2-3 are a split's
    missing type, 1 meaning "Zero"."""
    if "\nis_linear=1" in model_text:
        return ("the model has linear trees (`linear_tree=True`): its leaves are linear functions of the row, which only LightGBM itself "
                "computes (the `native` candidate); retrain with linear_tree=False for the other formats")
    if any((int(dt) >> 2) & 3 == 1 for line in model_text.splitlines() if line.startswith("decision_type=") for dt in line[14:].split()):
        return ("the model was trained with `zero_as_missing=True`, which scores an input of 0.0 as missing; only LightGBM itself does "
                "(the `native` candidate), the others compare 0.0 as a number; retrain with zero_as_missing=False and send missing values as NaN")
    return None


def _lgb_header(booster: Any) -> dict[str, str]:
    """The model text's header lines (`key=value` up to the first tree)."""
    head = booster.model_to_string(num_iteration=0).split("\nTree=")[0]
    return dict(line.split("=", 1) for line in head.splitlines() if "=" in line)


def _wrap_lightgbm(booster: Any, spec: ModelSpec, source: str) -> SourceModel:
    import lightgbm as lgb

    if not isinstance(booster, lgb.Booster):
        raise SpecError(f"spec {source}: field `source.path`: the file holds a {type(booster).__name__} from lightgbm, not a fitted model; fit it before saving")
    text = booster.model_to_string()
    header = _lgb_header(booster)
    objective = header.get("objective", "custom").split()[0]
    allowed = _LGB_OBJECTIVES[spec.task]
    if objective not in allowed:
        raise SpecError(
            f"spec {source}: field `task`: the LightGBM model's objective is {objective!r}, which does not produce a {spec.task} output "
            f"(expected {' or '.join(allowed)}); set `task` to match the model or retrain it"
            + (" (a custom objective's raw scores have no defined transform: train with a built-in objective)" if objective == "custom" else "")
        )
    n_features = int(booster.num_feature())
    names = booster.feature_name()
    # LightGBM names unnamed columns Column_0, Column_1...: that is no name to check against the spec.
    anonymous = all(n == f"Column_{i}" for i, n in enumerate(names))
    _check_features(n_features, None if anonymous else list(names), spec, source)
    num_class = int(header.get("num_class", "1"))
    n_classes = num_class if spec.task == "multiclass" else (2 if spec.task == "binary" else None)
    trees = int(booster.num_trees())
    cats = " with categorical splits" if lightgbm_has_categorical_splits(text) else ""
    return SourceModel(
        name=spec.name,
        task=spec.task,
        family="lightgbm",
        model=booster,
        n_features=n_features,
        n_classes=n_classes,
        objective=objective,
        description=f"LightGBM Booster, objective {objective}, {trees} trees{cats}",
    )


def _wrap_sklearn(est: Any, spec: ModelSpec, source: str) -> SourceModel:
    name = type(est).__name__
    if not hasattr(est, "predict"):
        raise SpecError(f"spec {source}: field `source.path`: the file holds a {name}, not a fitted model with predict()")
    n_features = getattr(est, "n_features_in_", None)
    if n_features is None:
        raise SpecError(f"spec {source}: field `source.path`: the {name} is not fitted (no n_features_in_); fit it before saving")
    names = getattr(est, "feature_names_in_", None)
    _check_features(int(n_features), None if names is None else list(names), spec, source)
    n_classes = None
    if spec.task in ("binary", "multiclass"):
        classes = getattr(est, "classes_", None)
        if classes is None or not hasattr(est, "predict_proba"):
            raise SpecError(f"spec {source}: field `task`: a {name} has no predict_proba/classes_, so it cannot serve a {spec.task} task; use regression or a classifier")
        n_classes = len(classes)
        if (spec.task == "binary") != (n_classes == 2):
            raise SpecError(f"spec {source}: field `task`: the {name} has {n_classes} classes; use task `{'binary' if n_classes == 2 else 'multiclass'}`")
    family = "sklearn-trees" if name in SKLEARN_TREE_ENSEMBLES else "sklearn"
    return SourceModel(
        name=spec.name,
        task=spec.task,
        family=family,
        model=est,
        n_features=int(n_features),
        n_classes=n_classes,
        description=f"scikit-learn {name}" + (f" ({' -> '.join(type(s).__name__ for _, s in est.steps)})" if name == "Pipeline" else ""),
    )


def _check_features(n_features: int, names: list[str] | None, spec: ModelSpec, source: str) -> None:
    if n_features != spec.n_features:
        raise SpecError(
            f"spec {source}: field `inputs.features`: the model takes {n_features} features but the spec lists {spec.n_features}; "
            "list exactly the model's input features, in training column order"
        )
    if names is not None and list(names) != list(spec.inputs.features):
        bad = next(i for i, (a, b) in enumerate(zip(names, spec.inputs.features)) if a != b)
        raise SpecError(
            f"spec {source}: field `inputs.features`: position {bad} is {spec.inputs.features[bad]!r} but the model was trained with {names[bad]!r} there; "
            "list the features in the model's training order"
        )
