"""TensorRT engines from the tensorized (hummingbird) ONNX graph, for `target: gpu`.

TensorRT cannot parse ai.onnx.ml TreeEnsemble ops, so the engine is built from hummingbird's
tensor-op graph. TensorRT is not installable on the project's CPU machines (PLATFORM_NOTES): there
this converter reports "skipped" with the reason. Written against TensorRT 10's Python API;
UNVERIFIED on a GPU machine so far.
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


def tensorrt_runner(path: Path, output_name: str):
    """Run a plan in-process on the GPU (device buffers through torch.cuda)."""
    trt = _import_tensorrt()
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device visible to torch")
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    context = engine.create_execution_context()
    stream = torch.cuda.Stream()

    def _run(x: np.ndarray) -> np.ndarray:
        xin = torch.from_numpy(np.ascontiguousarray(x)).cuda()
        context.set_input_shape(schema.INPUT_TENSOR, tuple(xin.shape))
        out_shape = tuple(context.get_tensor_shape(output_name))
        out = torch.empty(out_shape, dtype=torch.float32, device="cuda")
        context.set_tensor_address(schema.INPUT_TENSOR, xin.data_ptr())
        context.set_tensor_address(output_name, out.data_ptr())
        context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return out.cpu().numpy()

    return _run


for _family in ("xgboost", "sklearn-trees", "sklearn"):
    register_converter(_family, "tensorrt", convert_tensorrt)
