"""Converters for scikit-learn estimators and Pipelines (scalers, linear models, tree ensembles)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

from ._tree_commons import ONNX_OPSET, compile_tl2cgen, hummingbird_onnx, save_onnx_contract
from .model import SourceModel
from .registry import Artifact, ConvertContext, register_converter

_TARGET_OPSET = {"": ONNX_OPSET, "ai.onnx.ml": 3}


def _final_estimator(model: Any) -> Any:
    return model.steps[-1][1] if hasattr(model, "steps") else model


@contextlib.contextmanager
def _int_missing_flags() -> Iterator[None]:
    """skl2onnx passes HistGradientBoosting's boolean `missing_go_to_left` into an ints attribute
    (`AttributeProto.ints: Expected an int, got a boolean`); cast it to int while converting."""
    from skl2onnx.common import tree_ensemble

    original = tree_ensemble.add_node

    def add_node(*args: Any, **kwargs: Any) -> Any:
        if "nodes_missing_value_tracks_true" in kwargs:
            kwargs["nodes_missing_value_tracks_true"] = int(kwargs["nodes_missing_value_tracks_true"])
        return original(*args, **kwargs)

    tree_ensemble.add_node = add_node
    try:
        yield
    finally:
        tree_ensemble.add_node = original


def convert_sklearn_onnx(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn estimator or Pipeline -> ONNX through skl2onnx (ZipMap off)."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    model = source.model
    classifier = source.task in ("binary", "multiclass")
    options = {id(_final_estimator(model)): {"zipmap": False}} if classifier else None
    with _int_missing_flags(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = convert_sklearn(
            model,
            initial_types=[("features", FloatTensorType([None, source.n_features]))],
            options=options,
            target_opset=_TARGET_OPSET,
        )
    src = "probabilities" if classifier else 0
    return save_onnx_contract(raw, workdir, ctx, src, source.n_classes, notes=["skl2onnx, zipmap off"])


def _portable_pickler(fh: Any) -> Any:
    """A pickler writing numpy random generators in the form numpy 1.x and 2.x both read.

    numpy 2 pickles a Generator (HistGradientBoosting keeps one) or a RandomState (a
    GradientBoosting's trees do) with its BitGenerator *class* as the constructor argument, which
    numpy 1.26 (the server environment) refuses: "<class 'numpy.random._pcg64.PCG64'> is not a known
    BitGenerator module". The name and the state dict are what both versions accept. A plain pickle
    (joblib.load reads it): joblib's own pickler writes object arrays, such as a forest's
    `estimators_`, through a nested default pickler that this override would not reach.
    """
    import pickle

    import numpy as np
    from numpy.random import _pickle as rp

    generator_ctor = getattr(rp, "__generator_ctor")
    bit_generator_ctor = getattr(rp, "__bit_generator_ctor")
    randomstate_ctor = getattr(rp, "__randomstate_ctor")

    class PortablePickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, np.random.Generator):
                return generator_ctor, (type(obj.bit_generator).__name__,), obj.bit_generator.state
            if isinstance(obj, np.random.RandomState):
                return randomstate_ctor, (type(obj._bit_generator).__name__,), obj.get_state(legacy=False)
            if isinstance(obj, np.random.BitGenerator):
                return bit_generator_ctor, (type(obj).__name__,), obj.state
            return NotImplemented

    return PortablePickler(fh, protocol=4)


def convert_sklearn_native(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn itself inside the model runtime (joblib file; predict_proba or predict)."""
    path = workdir / "model.joblib"
    with open(path, "wb") as fh:
        _portable_pickler(fh).dump(source.model)
    classifier = source.task in ("binary", "multiclass")
    return Artifact(
        "native",
        "sklearn",
        "python",
        "model.joblib",
        path,
        output_column=1 if source.task == "binary" else None,
        method="predict_proba" if classifier else "predict",
    )


def _treelite(source: SourceModel) -> Any:
    import treelite

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return treelite.sklearn.import_model(source.model)


def convert_sklearn_tl2cgen(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn tree ensemble -> Treelite -> C -> shared library (TL2cgen)."""
    return compile_tl2cgen(_treelite(source), workdir, ctx)


def convert_sklearn_trees(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn boosted trees -> Treelite -> scorestack's branch-free tree kernel (compile/tree_kernel.py)."""
    from .tree_kernel import compile_tree_kernel

    return compile_tree_kernel(_treelite(source), workdir, ctx)


def convert_sklearn_linear(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn linear model (and the scalers before it) -> scorestack's linear kernel (compile/linear_kernel.py)."""
    from .linear_kernel import compile_linear_kernel

    return compile_linear_kernel(source.model, workdir, ctx)


def _max_depth(model: Any) -> int | None:
    est = _final_estimator(model)
    depths = []
    for e in getattr(est, "estimators_", []):
        for t in (e if hasattr(e, "__len__") else [e]):
            if hasattr(t, "tree_"):
                depths.append(int(t.tree_.max_depth))
    for stage in getattr(est, "_predictors", []):
        for p in stage:
            depths.append(int(p.nodes["depth"].max()))
    return max(depths) if depths else None


def convert_sklearn_hummingbird(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """scikit-learn estimator or Pipeline -> hummingbird tensorized operators -> ONNX."""
    return hummingbird_onnx(source.model, workdir, ctx, {}, _max_depth(source.model))


register_converter("sklearn-trees", "onnx", convert_sklearn_onnx)
register_converter("sklearn-trees", "native", convert_sklearn_native)
register_converter("sklearn-trees", "tl2cgen", convert_sklearn_tl2cgen)
register_converter("sklearn-trees", "trees", convert_sklearn_trees)
register_converter("sklearn-trees", "hummingbird", convert_sklearn_hummingbird)
register_converter("sklearn", "onnx", convert_sklearn_onnx)
register_converter("sklearn", "native", convert_sklearn_native)
register_converter("sklearn", "hummingbird", convert_sklearn_hummingbird)
register_converter("sklearn", "linear", convert_sklearn_linear)
