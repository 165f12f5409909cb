"""TensorRT engines for `target: gpu`: from the tensorized (hummingbird) ONNX graph of tree models, and from the exported graph of image models.

TensorRT cannot parse ai.onnx.ml TreeEnsemble ops, so the engine is built from hummingbird's
tensor-op graph. TensorRT is not installable on the project's CPU machines (docs/platform-notes.md): there
this converter reports "skipped" with the reason. Written against TensorRT 10's Python API; the
plan runs through the model runtime's TensorRT runner (serve/runtime/scorestack_runtime.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scorestack import schema

from .model import SourceModel
from .registry import Artifact, ConvertContext, Skip, converter_for, register_converter

MAX_BATCH = 4096
OPT_BATCH = 64


def _import_tensorrt():
    try:
        import tensorrt as trt
    except Exception as exc:  # stub wheels fail with OSError/ImportError alike
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


for _family in ("xgboost", "lightgbm", "sklearn-trees", "sklearn"):
    register_converter(_family, "tensorrt", convert_tensorrt)


# --- image models: an engine from the exported ONNX graph (uint8 images in, probabilities out) -------
VISION_OPT_BATCH = 8


def _calibrator(trt, images: np.ndarray, batch: int, cache: Path):
    """An entropy calibrator (TensorRT's IInt8EntropyCalibrator2) fed the calibration images from GPU buffers."""
    import torch

    class Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            super().__init__()
            self.batches = [images[i : i + batch] for i in range(0, len(images) - batch + 1, batch)] or [images]
            self.i = 0
            self.device = None  # kept alive while TensorRT reads it

        def get_batch_size(self) -> int:
            return int(len(self.batches[0]))

        def get_batch(self, names):
            if self.i >= len(self.batches):
                return None
            self.device = torch.from_numpy(np.ascontiguousarray(self.batches[self.i])).cuda()
            self.i += 1
            return [int(self.device.data_ptr())]

        def read_calibration_cache(self):
            return cache.read_bytes() if cache.exists() else None

        def write_calibration_cache(self, data) -> None:
            cache.write_bytes(bytes(data))

    return Calibrator()


def build_vision_engine(
    onnx_path: Path, out: Path, *, precision: str, image_shape: tuple[int, ...], max_batch: int, calibration: np.ndarray | None = None
) -> list[str]:
    """Serialize a TensorRT engine for an image graph: explicit batch, one optimization profile 1 / opt / max_batch.

    precision: "fp16" (FP16 kernels allowed) or "int8" (INT8 with FP16 fallback, scales from an entropy
    calibrator over `calibration`). Raises Skip when TensorRT is not installed, RuntimeError when it fails."""
    trt = _import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse the ONNX graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    opt = min(VISION_OPT_BATCH, max_batch)
    profile = builder.create_optimization_profile()
    profile.set_shape(schema.IMAGE_INPUT_TENSOR, (1, *image_shape), (opt, *image_shape), (max_batch, *image_shape))
    config.add_optimization_profile(profile)
    notes = [f"TensorRT {trt.__version__}, {precision}, optimization profile 1/{opt}/{max_batch}"]
    config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        if calibration is None or len(calibration) == 0:
            raise Skip("INT8 engine: no calibration images (spec `calibration`)")
        config.set_flag(trt.BuilderFlag.INT8)
        config.int8_calibrator = _calibrator(trt, calibration, min(32, max_batch, len(calibration)), out.with_suffix(".calibration"))
        config.set_calibration_profile(profile)
        notes.append(f"INT8 entropy calibration on {len(calibration)} images")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    out.write_bytes(bytes(plan))
    return notes


def _vision_engine(precision: str):
    def convert(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
        """Image classifier -> fp32 ONNX (preprocessing folded in) -> TensorRT engine (model.plan, platform tensorrt_plan)."""
        if ctx.target != "gpu":
            raise Skip("target is cpu: TensorRT engines run on NVIDIA GPUs (set `target: gpu`); the ONNX candidates serve this model")
        _import_tensorrt()
        from .convert_torch import export_fp32

        onnx_path, notes = export_fp32(source, workdir / "onnx")
        path = workdir / "model.plan"
        notes += build_vision_engine(onnx_path, path, precision=precision, image_shape=tuple(source.image.shape), max_batch=ctx.max_batch_size or 32, calibration=ctx.calibration)
        fmt = "tensorrt" if precision == "fp16" else "tensorrt-int8"
        # FP16/INT8 kernels are not exact: the engine is accepted within the accuracy budget, like ONNX INT8.
        return Artifact(fmt, "tensorrt", "tensorrt", "model.plan", path, exact=False, notes=notes)

    return convert


for _family in ("torch-vision", "torchscript-vision", "onnx-vision"):
    register_converter(_family, "tensorrt", _vision_engine("fp16"))
    register_converter(_family, "tensorrt-int8", _vision_engine("int8"))


# --- image models: ONNX Runtime with Triton's TensorRT execution accelerator -------------------------
# Triton's onnxruntime backend builds TensorRT engines itself when the model config names the
# "tensorrt" gpu_execution_accelerator (onnxruntime_backend README, "ONNX Runtime with TensorRT
# optimization"): the artifact stays the fp32 ONNX graph, and subgraphs TensorRT cannot take run on
# ONNX Runtime's CUDA provider. Keys are the backend's (precision_mode -> trt_fp16_enable,
# max_workspace_size_bytes -> trt_max_workspace_size, trt_engine_cache_enable/path).
ORT_TENSORRT_FORMAT = "onnx-tensorrt"
ORT_TENSORRT_PARAMETERS: dict[str, str] = {
    "precision_mode": "FP16",
    "max_workspace_size_bytes": str(1 << 30),
    # Engines are built at model load (seconds to minutes); the cache keeps them across restarts.
    "trt_engine_cache_enable": "1",
    "trt_engine_cache_path": "/tmp/scorestack_trt_cache",
}


def ort_tensorrt_available() -> str | None:
    """None when ONNX Runtime here can run a session on its TensorRT execution provider, else the reason it cannot.

    `get_available_providers()` alone is not proof: onnxruntime-gpu lists TensorrtExecutionProvider and,
    without the TensorRT/CUDA libraries, silently falls back to CPU at session creation; so a one-node
    session is created and the provider it actually got is checked."""
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no TensorrtExecutionProvider (providers: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu with TensorRT on a GPU machine"
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    except Exception as exc:  # a provider that fails to load raises various errors
        return f"onnxruntime's TensorrtExecutionProvider failed to start ({type(exc).__name__}: {exc})"
    if "TensorrtExecutionProvider" not in session.get_providers():
        return "onnxruntime lists TensorrtExecutionProvider but fell back to CPU (no GPU, or the TensorRT/CUDA libraries are missing)"
    return None


def convert_ort_tensorrt(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """Image classifier -> fp32 ONNX served by Triton's onnxruntime backend with the TensorRT accelerator (FP16).

    The config block is added by compile/emit.py for this format (ORT_TENSORRT_PARAMETERS)."""
    if ctx.target != "gpu":
        raise Skip("target is cpu: the TensorRT execution accelerator runs on NVIDIA GPUs (set `target: gpu`); the ONNX candidates serve this model")
    reason = ort_tensorrt_available()
    if reason is not None:
        raise Skip(reason)
    from .convert_torch import FP32_ARTIFACT, export_fp32

    path, notes = export_fp32(source, workdir)
    params = ", ".join(f"{k}={v}" for k, v in ORT_TENSORRT_PARAMETERS.items())
    notes.append(f"served by Triton's onnxruntime backend with gpu_execution_accelerator tensorrt ({params})")
    # FP16 engines are not exact: accepted within the accuracy budget, like the other reduced-precision formats.
    return Artifact(ORT_TENSORRT_FORMAT, "onnxruntime", "onnxruntime", FP32_ARTIFACT, path, exact=False, notes=notes)


for _family in ("torch-vision", "torchscript-vision", "onnx-vision"):
    register_converter(_family, ORT_TENSORRT_FORMAT, convert_ort_tensorrt)
