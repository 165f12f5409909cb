"""TensorRT engines from the tensorized (hummingbird) ONNX graph, for `target: gpu`.

TensorRT cannot parse ai.onnx.ml TreeEnsemble ops, so the engine is built from hummingbird's
tensor-op graph. TensorRT is not installable on the project's CPU machines (PLATFORM_NOTES): there
this converter reports "skipped" with the reason. Written against TensorRT 10's Python API; the
plan runs through the model runtime's TensorRT runner (serve/runtime/scorestack_runtime.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scorestack import schema

from .loaders import SourceModel
from .registry import Artifact, ConvertContext, Skip, converter_for, register_converter

MAX_BATCH = 4096
OPT_BATCH = 64


def _import_tensorrt():
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - stub wheels fail with OSError/ImportError alike
        raise Skip(f"tensorrt not installed ({type(exc).__name__}: {exc})") from None
    return trt


def convert_tensorrt(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """Tree ensemble -> hummingbird ONNX -> TensorRT plan (explicit batch, one optimization profile)."""
    if ctx.target != "gpu":
        raise Skip("target is cpu: TensorRT engines run on NVIDIA GPUs (set `target: gpu`)")
    trt = _import_tensorrt()
    hb_dir = workdir / "hummingbird"
    hb_dir.mkdir(exist_ok=True)
    onnx_art = converter_for(source.family, "hummingbird")(source, hb_dir, ctx)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_art.path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse the ONNX graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    profile = builder.create_optimization_profile()
    n = ctx.n_features
    profile.set_shape(schema.INPUT_TENSOR, (1, n), (OPT_BATCH, n), (MAX_BATCH, n))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    path = workdir / "model.plan"
    path.write_bytes(bytes(plan))
    return Artifact("tensorrt", "tensorrt", "tensorrt", "model.plan", path, notes=[f"TensorRT {trt.__version__}, profile 1/{OPT_BATCH}/{MAX_BATCH}"])


for _family in ("xgboost", "sklearn-trees", "sklearn"):
    register_converter(_family, "tensorrt", convert_tensorrt)
