"""Converters for XGBoost models (Booster or sklearn API: XGBClassifier, XGBRegressor, XGBRanker)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from typing import Any, Iterator

from ._tree_commons import ONNX_OPSET, compile_tl2cgen, hummingbird_onnx, save_onnx_contract, tree_depth
from .model import SourceModel
from .registry import Artifact, ConvertContext, register_converter

# onnxmltools' XGBoost converter supports ai.onnx opsets up to 15.
_ONNXMLTOOLS_OPSET = min(ONNX_OPSET, 15)


def _anonymous(booster: Any) -> Any:
    """A copy without feature names: converters parse split names as `f<index>`."""
    b = booster.copy()
    b.feature_names = None
    b.feature_types = None
    return b


def base_score(booster: Any) -> list[float]:
    """The fitted base_score (XGBoost 3 writes it as a bracketed vector string)."""
    raw = json.loads(booster.save_config())["learner"]["learner_model_param"]["base_score"]
    return [float(v) for v in re.findall(r"[-+0-9.eE]+", raw)]


def sklearn_wrapper(source: SourceModel) -> Any:
    """The booster inside the sklearn class a converter expects for the task.

    Rankers are wrapped as regressors on purpose: onnxmltools refuses XGBRanker, and converting the
    raw Booster silently yields a classifier (docs/platform-notes.md).
    """
    import xgboost as xgb

    booster = _anonymous(source.model)
    if source.task in ("binary", "multiclass"):
        wrapper = xgb.XGBClassifier()
        wrapper._Booster = booster
        wrapper.n_classes_ = source.n_classes
        wrapper.objective = source.objective
    else:
        wrapper = xgb.XGBRegressor()
        wrapper._Booster = booster
        wrapper.objective = "reg:squarederror"
    return wrapper


def _onnx_input_model(source: SourceModel) -> Any:
    """What onnxmltools converts: the raw Booster for classifiers, an XGBRegressor wrapper otherwise."""
    if source.task in ("binary", "multiclass"):
        return _anonymous(source.model)
    return sklearn_wrapper(source)


def convert_xgboost_onnx(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """XGBoost -> ONNX TreeEnsemble through onnxmltools."""
    from onnxmltools.convert import convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    raw = convert_xgboost(
        _onnx_input_model(source),
        initial_types=[("features", FloatTensorType([None, source.n_features]))],
        target_opset=_ONNXMLTOOLS_OPSET,
    )
    src = "probabilities" if source.task in ("binary", "multiclass") else 0
    return save_onnx_contract(raw, workdir, ctx, src, source.n_classes, notes=["onnxmltools"])


def convert_xgboost_native(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """XGBoost itself inside the model runtime (Booster.inplace_predict)."""
    path = workdir / "model.json"
    source.model.save_model(str(path))
    return Artifact("native", "xgboost", "python", "model.json", path)


def _treelite(source: SourceModel) -> Any:
    import treelite

    return treelite.frontend.from_xgboost(_anonymous(source.model))


def convert_xgboost_tl2cgen(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """XGBoost -> Treelite -> C -> shared library (TL2cgen, machine's gcc)."""
    return compile_tl2cgen(_treelite(source), workdir, ctx)


def convert_xgboost_trees(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """XGBoost -> Treelite -> scorestack's branch-free tree kernel (compile/tree_kernel.py)."""
    from .tree_kernel import compile_tree_kernel

    return compile_tree_kernel(_treelite(source), workdir, ctx)


@contextlib.contextmanager
def _plain_base_score() -> Iterator[None]:
    """hummingbird parses base_score with float(); XGBoost 3 writes '[0.5]'. Unwrap it while converting."""
    import xgboost as xgb

    original = xgb.Booster.save_config

    def save_config(self: Any) -> str:
        cfg = json.loads(original(self))
        param = cfg["learner"]["learner_model_param"]
        vals = re.findall(r"[-+0-9.eE]+", param.get("base_score", "0.5"))
        if len(vals) == 1:
            param["base_score"] = vals[0]
        return json.dumps(cfg)

    xgb.Booster.save_config = save_config
    try:
        yield
    finally:
        xgb.Booster.save_config = original


def hummingbird_extra_config(source: SourceModel) -> dict[str, Any]:
    """hummingbird ignores a binary model's fitted base_score unless given as a margin (docs/platform-notes.md)."""
    extra: dict[str, Any] = {"n_features": source.n_features}
    if source.task == "binary":
        p = min(max(base_score(source.model)[0], 1e-12), 1 - 1e-12)
        extra["base_prediction"] = [math.log(p / (1 - p))]
    return extra


def _max_depth(booster: Any) -> int:
    return max((tree_depth(json.loads(t)) for t in booster.get_dump(dump_format="json")), default=0)


def convert_xgboost_hummingbird(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """XGBoost -> hummingbird tensorized trees -> ONNX."""
    from ._tree_commons import hummingbird_available
    from .registry import Skip

    if not hummingbird_available():
        raise Skip("hummingbird not installed (pip install 'scorestack[hummingbird]')")
    with _plain_base_score():
        return hummingbird_onnx(sklearn_wrapper(source), workdir, ctx, hummingbird_extra_config(source), _max_depth(source.model))


register_converter("xgboost", "onnx", convert_xgboost_onnx)
register_converter("xgboost", "native", convert_xgboost_native)
register_converter("xgboost", "tl2cgen", convert_xgboost_tl2cgen)
register_converter("xgboost", "trees", convert_xgboost_trees)
register_converter("xgboost", "hummingbird", convert_xgboost_hummingbird)
