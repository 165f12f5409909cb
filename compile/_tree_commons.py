"""Tree-ensemble logic shared by every framework's converters: TL2cgen builds and hummingbird exports."""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .onnx_graph import to_contract
from .registry import Artifact, ConvertContext, Skip, output_column

ONNX_OPSET = 17
# hummingbird's perf_tree_trav strategy (chosen for deep trees) writes 2^depth nodes per tree:
# a depth-18 model came out at 819 MB (PLATFORM_NOTES); refuse before wasting the time.
HUMMINGBIRD_MAX_DEPTH = 12
TL2CGEN_ARTIFACT = "model-tl2cgen.so"  # a name no `import` can resolve (see emit.check_artifact_name)


def compile_tl2cgen(treelite_model: Any, workdir: Path, ctx: ConvertContext, notes: list[str] | None = None) -> Artifact:
    """Compile a Treelite model to a shared library with the machine's gcc."""
    if shutil.which("gcc") is None:
        raise Skip("gcc not found: TL2cgen needs a C compiler")
    import tl2cgen

    # Not `model.so`: beside the runtime's model.py, Python would import the library as the model.
    path = workdir / TL2CGEN_ARTIFACT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl2cgen.export_lib(
            treelite_model,
            toolchain="gcc",
            libpath=str(path),
            params={"parallel_comp": max(1, ctx.compile_threads * 2)},
            nthread=ctx.compile_threads,
        )
    predictor = tl2cgen.Predictor(str(path), nthread=1)
    raw = np.asarray(predictor.predict(tl2cgen.DMatrix(ctx.sample[:4])))
    column = output_column(ctx.task, raw)
    del predictor
    return Artifact("tl2cgen", "tl2cgen", "python", TL2CGEN_ARTIFACT, path, output_column=column, notes=list(notes or []))


def hummingbird_available() -> bool:
    return importlib.util.find_spec("hummingbird") is not None and importlib.util.find_spec("torch") is not None


def hummingbird_onnx(model: Any, workdir: Path, ctx: ConvertContext, extra_config: dict[str, Any], max_depth: int | None, notes: list[str] | None = None) -> Artifact:
    """Tensorize trees with hummingbird (torch backend) and export them to ONNX under the tensor contract.

    The ONNX export goes through torch's TorchScript exporter (`dynamo=False`): hummingbird's own ONNX
    path fails under torch 2.13.
    """
    if not hummingbird_available():
        raise Skip("hummingbird not installed (pip install 'scorestack[hummingbird]')")
    if max_depth is not None and max_depth > HUMMINGBIRD_MAX_DEPTH:
        raise Skip(f"trees of depth {max_depth} > {HUMMINGBIRD_MAX_DEPTH}: hummingbird's tensorized form would be too large")
    import hummingbird.ml as hb
    import torch

    sample = np.ascontiguousarray(ctx.sample[:8], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        container = hb.convert(model, "torch", sample, extra_config=dict(extra_config))
        module = container.model
        classifier = ctx.task in ("binary", "multiclass")
        out_names = ["label", "probabilities"] if classifier else ["prediction"]
        path = workdir / "model.onnx"
        raw_path = workdir / "hummingbird_raw.onnx"
        torch.onnx.export(
            module,
            (torch.from_numpy(sample),),
            str(raw_path),
            dynamo=False,
            input_names=["input"],
            output_names=out_names,
            dynamic_axes={n: {0: "batch"} for n in ["input", *out_names]},
            opset_version=ONNX_OPSET,
        )
    raw = onnx.load(str(raw_path))
    raw_path.unlink()
    if classifier:
        probs = np.asarray(container.predict_proba(sample))
        column = 1 if ctx.task == "binary" else None
        width = 1 if ctx.task == "binary" else probs.shape[1]
        src = "probabilities"
    else:
        column, width, src = None, 1, "prediction"
    contract = to_contract(raw, ctx.task, ctx.n_features, src, column=column, n_outputs=width)
    onnx.save(contract, str(path))
    return Artifact("hummingbird", "onnxruntime", "onnxruntime", "model.onnx", path, notes=list(notes or []))


def save_onnx_contract(raw: onnx.ModelProto, workdir: Path, ctx: ConvertContext, source_output: str | int, n_classes: int | None, fmt: str = "onnx", notes: list[str] | None = None) -> Artifact:
    """Rewrite a converter's graph to the tensor contract and save it as model.onnx."""
    if ctx.task == "binary":
        column, width = 1, 1
    elif ctx.task == "multiclass":
        column, width = None, int(n_classes or 0)
    else:
        column, width = None, 1
    contract = to_contract(raw, ctx.task, ctx.n_features, source_output, column=column, n_outputs=width)
    path = workdir / "model.onnx"
    onnx.save(contract, str(path))
    return Artifact(fmt, "onnxruntime", "onnxruntime", "model.onnx", path, notes=list(notes or []))


def tree_depth(node: dict[str, Any]) -> int:
    """Depth of a tree given as XGBoost's JSON dump (nested `children`)."""
    kids = node.get("children")
    return 0 if not kids else 1 + max(tree_depth(k) for k in kids)
