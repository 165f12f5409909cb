"""Lossy optimization passes: ensemble pruning and distillation, each accepted only within its quality budget.

Quality is the task metric on held-out labels (binary: ROC AUC, multiclass: accuracy, regression:
negative RMSE, ranking: NDCG@10); a pass's "drop" is the source's metric minus the result's, both
measured on rows the pass did not choose on.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .model import Holdout, SourceModel
from .report import PassReport
from .spec import DistillationSpec, PruningSpec


_PASS_FIELDS = tuple(PassReport.model_fields)


def _pass_report(*values: Any, **named: Any) -> PassReport:
    """A PassReport from positional values in field order (name, accepted, reason, metric, ...)."""
    return PassReport(**dict(zip(_PASS_FIELDS, values)), **named)


def ndcg_at(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, k: int = 10) -> float:
    """Mean NDCG@k over query groups (gain 2^rel - 1)."""
    vals = []
    start = 0
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    for size in groups:
        s, y = scores[start : start + size], labels[start : start + size]
        start += size
        kk = min(k, size)
        order = np.argsort(-s, kind="stable")[:kk]
        ideal = np.sort(y)[::-1][:kk]
        idcg = float(((2.0**ideal - 1) * disc[:kk]).sum())
        if idcg > 0:
            vals.append(float(((2.0 ** y[order] - 1) * disc[:kk]).sum()) / idcg)
    return float(np.mean(vals)) if vals else 0.0


def quality(task: str, scores: np.ndarray, data: Holdout) -> tuple[str, float]:
    """The task metric (higher is better)."""
    from sklearn.metrics import roc_auc_score

    y = data.y
    if task == "binary":
        return "auc", float(roc_auc_score(y, scores[:, 0]))
    if task == "multiclass":
        return "accuracy", float(np.mean(scores.argmax(1) == y))
    if task == "regression":
        return "neg_rmse", -float(np.sqrt(np.mean((scores[:, 0] - y) ** 2)))
    return "ndcg@10", ndcg_at(scores[:, 0], y, data.groups)


def _prefix(source: SourceModel, k: int) -> SourceModel:
    """The same ensemble keeping only its first k boosting rounds (or trees)."""
    if source.family == "xgboost":
        model = source.model[0:k]  # Booster slicing: a real, smaller model (no iteration_range at serving)
    elif source.family == "lightgbm":
        import lightgbm as lgb

        model = lgb.Booster(model_str=source.model.model_to_string(num_iteration=k))  # the first k iterations, a real model
    else:
        model = copy.deepcopy(source.model)
        if hasattr(model, "_predictors"):  # HistGradientBoosting
            model._predictors = model._predictors[:k]
            model.n_iter_ = k
        else:  # GradientBoosting (2-D array of stages), RandomForest/ExtraTrees (list of trees)
            model.estimators_ = model.estimators_[:k]
            model.n_estimators = k
    return SourceModel(source.name, source.task, source.family, model, source.n_features, source.n_classes, source.objective, source.description, [*source.history, f"pruned to {k} rounds"])


def _rounds(source: SourceModel) -> int | None:
    if source.family == "xgboost":
        return int(source.model.num_boosted_rounds())
    if source.family == "lightgbm":
        return int(source.model.current_iteration())
    m = source.model
    if hasattr(m, "_predictors"):
        return len(m._predictors)
    if hasattr(m, "estimators_") and source.family == "sklearn-trees":
        return len(m.estimators_)
    return None


def prune(source: SourceModel, holdout: Holdout, spec: PruningSpec) -> tuple[SourceModel, PassReport]:
    """Smallest prefix of the ensemble whose metric drop stays within the budget.

    The held-out rows are split in two halves (whole query groups for ranking); a prefix is accepted
    only if it stays within the budget on both, so a lucky fit to one half is not enough.
    """
    rounds = _rounds(source)
    if rounds is None:
        return source, _pass_report("pruning", False, f"not an additive tree ensemble ({source.description})")
    if holdout.y is None:
        return source, _pass_report("pruning", False, "held-out rows have no labels (y): quality cannot be measured")
    halves = holdout.halves()
    metric, base_a = quality(source.task, source.predict(halves[0].X), halves[0])
    _, base_b = quality(source.task, source.predict(halves[1].X), halves[1])
    _, base_all = quality(source.task, source.predict(holdout.X), holdout)
    result = _pass_report("pruning", False, "", metric, base_all, None, None, spec.quality_budget, rounds, rounds)
    step = max(1, rounds // 50)
    for k in range(max(spec.min_trees, step), rounds, step):
        cand = _prefix(source, k)
        _, qa = quality(source.task, cand.predict(halves[0].X), halves[0])
        if base_a - qa > spec.quality_budget:
            continue
        _, qb = quality(source.task, cand.predict(halves[1].X), halves[1])
        if base_b - qb > spec.quality_budget:
            continue
        _, q_all = quality(source.task, cand.predict(holdout.X), holdout)
        result.accepted = True
        result.result_quality, result.quality_drop, result.trees_after = q_all, base_all - q_all, k
        result.details = {"drop_first_half": base_a - qa, "drop_second_half": base_b - qb, "step": step}
        result.reason = f"kept {k} of {rounds} rounds; {metric} {base_all:.4f} -> {q_all:.4f}"
        return cand, result
    result.reason = "no shorter prefix stays within the quality budget on both halves of the held-out rows"
    return source, result


def _top_overlap(a: np.ndarray, b: np.ndarray, frac: float = 0.01) -> float:
    k = max(1, int(round(len(a) * frac)))
    ta = set(np.argsort(-a, kind="stable")[:k])
    tb = set(np.argsort(-b, kind="stable")[:k])
    return len(ta & tb) / k


def _teacher_score(task: str, scores: np.ndarray) -> np.ndarray:
    return scores[:, 0] if task != "multiclass" else scores.max(1)


def distill(teacher: SourceModel, holdout: Holdout, spec: DistillationSpec, train: Holdout | None, threads: int = 2, seed: int = 0) -> tuple[SourceModel, PassReport]:
    """Train a smaller XGBoost student on a mix of the teacher's scores and the labels; keep it only within budget."""
    import xgboost as xgb
    from sklearn.metrics import average_precision_score, roc_auc_score

    if holdout.y is None:
        return teacher, _pass_report("distillation", False, "held-out rows have no labels (y): quality cannot be measured")
    if train is None:
        train, evaluate = holdout.halves()
        where = "first half of the held-out rows"
    else:
        evaluate = holdout
        where = "distillation.train_rows"
    if train.y is None:
        return teacher, _pass_report("distillation", False, "training rows have no labels (y)")
    task = teacher.task
    t_train = teacher.predict(train.X)
    params: dict[str, Any] = {
        "max_depth": spec.max_depth,
        "eta": spec.learning_rate,
        "tree_method": "hist",
        "nthread": threads,
        "seed": seed,
    }
    if task == "binary":
        params["objective"] = "binary:logistic"
        label = spec.soft_weight * t_train[:, 0] + (1 - spec.soft_weight) * train.y
    elif task == "multiclass":
        params.update(objective="multi:softprob", num_class=teacher.n_classes)
        label = train.y  # hard labels: XGBoost has no soft multi-class target
    elif task == "regression":
        params["objective"] = "reg:squarederror"
        label = spec.soft_weight * t_train[:, 0] + (1 - spec.soft_weight) * train.y
    else:  # ranking: regress the teacher's scores (order within groups is what is served)
        params["objective"] = "reg:squarederror"
        label = t_train[:, 0]
    dtrain = xgb.DMatrix(train.X, label=label)
    booster = xgb.train(params, dtrain, num_boost_round=spec.n_estimators)
    student = SourceModel(
        teacher.name,
        task,
        "xgboost",
        booster,
        teacher.n_features,
        teacher.n_classes,
        params["objective"],
        f"XGBoost student ({spec.n_estimators} trees, depth {spec.max_depth}) distilled from {teacher.description}",
        [*teacher.history, "distilled"],
    )
    s_eval, t_eval = student.predict(evaluate.X), teacher.predict(evaluate.X)
    metric, q_t = quality(task, t_eval, evaluate)
    _, q_s = quality(task, s_eval, evaluate)
    drop = q_t - q_s
    details: dict[str, Any] = {"trained_on": where, "soft_weight": spec.soft_weight, "top1pct_overlap": _top_overlap(_teacher_score(task, t_eval), _teacher_score(task, s_eval))}
    if task == "binary":
        details.update(
            teacher_auc=float(roc_auc_score(evaluate.y, t_eval[:, 0])),
            student_auc=float(roc_auc_score(evaluate.y, s_eval[:, 0])),
            teacher_pr_auc=float(average_precision_score(evaluate.y, t_eval[:, 0])),
            student_pr_auc=float(average_precision_score(evaluate.y, s_eval[:, 0])),
        )
    if task == "ranking":
        details.update(teacher_ndcg10=q_t, student_ndcg10=q_s)
    result = _pass_report("distillation", drop <= spec.quality_budget, "", metric, q_t, q_s, drop, spec.quality_budget, teacher.n_trees, student.n_trees, details)
    if result.accepted:
        result.reason = f"student {metric} {q_s:.4f} vs teacher {q_t:.4f} (drop {drop:.4g} <= {spec.quality_budget:g})"
        return student, result
    result.reason = f"student {metric} {q_s:.4f} vs teacher {q_t:.4f}: drop {drop:.4g} exceeds the budget {spec.quality_budget:g}"
    return teacher, result
