"""Converters for LightGBM models (a native model text file, or an LGBMClassifier/LGBMRegressor/LGBMRanker).

The source is always the `lightgbm.Booster` (the loader unwraps the scikit-learn API object). Treelite
reads it for TL2cgen and the tree kernel; onnxmltools' `convert_lightgbm` writes the ONNX graph; the
native candidate is the model text file run by LightGBM in the server environment. Linear trees and
`zero_as_missing=True` only LightGBM itself computes: every other candidate refuses them by name
(compile/loaders.py lightgbm_unexpressible, checked where they are registered), and the native one serves them.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

from ._tree_commons import ONNX_OPSET, compile_tl2cgen, save_onnx_contract
from .loaders import lightgbm_has_categorical_splits, lightgbm_unexpressible
from .model import SourceModel
from .registry import Artifact, ConvertContext, Converter, Skip, register_converter

# onnxmltools' LightGBM converter, like its XGBoost one, writes ai.onnx opsets up to 15.
_ONNXMLTOOLS_OPSET = min(ONNX_OPSET, 15)
CATEGORICAL_FIX = "encode the column as a number (ordinal or one-hot) and retrain without `categorical_feature`"


def _model_text(source: SourceModel) -> str:
    """The model's text (LightGBM writes it anew on every call: megabytes for large ensembles), once per source model."""
    if "lightgbm_text" not in source.cache:
        source.cache["lightgbm_text"] = source.model.model_to_string()
    return source.cache["lightgbm_text"]


def _refuse_categorical(source: SourceModel, fmt: str) -> None:
    if lightgbm_has_categorical_splits(_model_text(source)):
        raise Skip(f"categorical splits (LightGBM `categorical_feature`): {fmt} compares features with thresholds only; {CATEGORICAL_FIX}")


def _expressible_only(convert: Converter) -> Converter:
    """A converter of a LightGBM model into another format than LightGBM's own: it refuses, by name, what
    only LightGBM computes (lightgbm_unexpressible) before converting. Applied where the converters are
    registered, so no format other than `native` can serve such a model by omission."""

    @functools.wraps(convert)
    def checked(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
        why = lightgbm_unexpressible(_model_text(source))
        if why:
            raise Skip(why)
        return convert(source, workdir, ctx)

    return checked


def _treelite(source: SourceModel) -> Any:
    import treelite

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return treelite.frontend.from_lightgbm(source.model)


def convert_lightgbm_onnx(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """LightGBM -> ONNX TreeEnsemble through onnxmltools (ZipMap off); categorical splits become BRANCH_EQ chains."""
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    if "\naverage_output" in _model_text(source):
        # onnxmltools sums a random forest's trees instead of averaging them (0.45 off on a 30-tree binary model).
        raise Skip("LightGBM random forest (`boosting=rf`, averaged trees): onnxmltools sums the trees instead of averaging them")
    if source.objective == "multiclassova":
        # One independent sigmoid per class; onnxmltools normalizes them like softmax probabilities (0.58 off).
        raise Skip("objective multiclassova (one sigmoid per class, not normalized): onnxmltools normalizes the class scores; use objective=multiclass for ONNX")
    classifier = source.task in ("binary", "multiclass")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = convert_lightgbm(
            source.model,
            initial_types=[("features", FloatTensorType([None, source.n_features]))],
            target_opset=_ONNXMLTOOLS_OPSET,
            zipmap=False,
        )
    # onnxmltools imports the lowest ai.onnx opset its own nodes need (9 here); the contract's Slice
    # takes its bounds as inputs (opset >= 10), and the nodes it wrote read the same at 15.
    for op in raw.opset_import:
        if op.domain in ("", "ai.onnx") and op.version < _ONNXMLTOOLS_OPSET:
            op.version = _ONNXMLTOOLS_OPSET
    return save_onnx_contract(raw, workdir, ctx, "probabilities" if classifier else 0, source.n_classes, notes=["onnxmltools"])


def convert_lightgbm_native(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """LightGBM itself inside the model runtime (its C API: one row through the single-row fast path)."""
    path = workdir / "model.txt"
    source.model.save_model(str(path))
    return Artifact("native", "lightgbm", "python", "model.txt", path)


def convert_lightgbm_tl2cgen(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """LightGBM -> Treelite -> C -> shared library (TL2cgen, machine's gcc); categorical splits included."""
    return compile_tl2cgen(_treelite(source), workdir, ctx)


def convert_lightgbm_trees(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """LightGBM -> Treelite -> scorestack's branch-free tree kernel (compile/tree_kernel.py)."""
    from .tree_kernel import compile_tree_kernel

    _refuse_categorical(source, "the tree kernel")
    return compile_tree_kernel(_treelite(source), workdir, ctx)


def convert_lightgbm_hummingbird(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """Refused: hummingbird's LightGBM trees send a missing value (NaN) down a fixed branch."""
    # LightGBM sends NaN the split's learned way (missing_type NaN), or scores it as 0.0 (missing_type
    # None); hummingbird 0.4.11 does neither: 0.97 off on NaN rows of a 40-tree binary model, exact on the
    # others. A holdout without NaN would verify it and serving would then be wrong on the first NaN.
    raise Skip("hummingbird ignores LightGBM's missing-value handling (rows with NaN take the wrong branch), so it cannot be verified for every input")


register_converter("lightgbm", "onnx", _expressible_only(convert_lightgbm_onnx))
register_converter("lightgbm", "native", convert_lightgbm_native)
register_converter("lightgbm", "tl2cgen", _expressible_only(convert_lightgbm_tl2cgen))
register_converter("lightgbm", "trees", _expressible_only(convert_lightgbm_trees))
register_converter("lightgbm", "hummingbird", convert_lightgbm_hummingbird)  # refuses every LightGBM model (TensorRT's path too)
