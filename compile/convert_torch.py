"""Image classifiers (torch modules, TorchScript, ONNX graphs) -> ONNX fp32 and ONNX Runtime static INT8.

Every graph takes the contract's uint8 `images` and returns `probabilities`: the spec's preprocessing
(scale, mean/std, layout) and the softmax are part of the exported graph, so clients send raw pixels.
"""

from __future__ import annotations

import shutil
from pathlib import Path
import numpy as np

from scorestack import schema

from .model import SourceModel
from .registry import Artifact, ConvertContext, Skip, register_converter
from .vision import ONNX, TORCHSCRIPT, VISION_FAMILIES, preprocess_module, served_module

OPSET = 17  # what the Triton 24.11 image's ONNX Runtime (1.19.2) implements, and TensorRT 10 parses
FP32_ARTIFACT = "model.onnx"
INT8_ARTIFACT = "model-int8.onnx"
CALIBRATION_BATCH = 32


def _dynamic_axes() -> dict[str, dict[int, str]]:
    out = schema.OUTPUT_TENSORS["image-classification"]
    return {schema.IMAGE_INPUT_TENSOR: {0: "batch"}, out: {0: "batch"}}


def _export_torch(source: SourceModel, path: Path) -> None:
    """torch.onnx.export (TorchScript exporter: it handles ScriptModules and gives plain opset-17 graphs) with a dynamic batch axis."""
    import torch

    served = served_module(source.model, source.image)
    example = torch.zeros((2, *source.image.shape), dtype=torch.uint8)
    with torch.no_grad():
        torch.onnx.export(
            served,
            (example,),
            str(path),
            input_names=[schema.IMAGE_INPUT_TENSOR],
            output_names=[schema.OUTPUT_TENSORS["image-classification"]],
            dynamic_axes=_dynamic_axes(),
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )


def _torchscript_graph(source: SourceModel, path: Path):  # -> onnx.ModelProto
    """A TorchScript module as an ONNX graph on its own float32 [N, C, H, W] input (a ScriptModule cannot be
    traced inside the preprocessing wrapper; exported alone, it joins the preprocessing like an ONNX source)."""
    import onnx
    import torch

    image = source.image
    example = torch.zeros((2, image.channels, image.height, image.width), dtype=torch.float32)
    with torch.no_grad():
        torch.onnx.export(
            source.model, (example,), str(path), input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=OPSET, dynamo=False,
        )
    return onnx.load(str(path))


def _export_onnx_source(source: SourceModel, path: Path, model=None) -> None:
    """Prepend the preprocessing graph (exported from the same torch module) to the source ONNX graph and append the softmax."""
    import onnx
    import torch
    from onnx import compose, helper

    model = source.model if model is None else model
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if len(model.graph.input) != 1 or len(model.graph.output) != 1:
        raise ValueError(f"the source graph has {len(model.graph.input)} inputs and {len(model.graph.output)} outputs; an image classifier takes one and returns one")
    pre_path = path.with_name("preprocess.onnx")
    example = torch.zeros((2, *source.image.shape), dtype=torch.uint8)
    torch.onnx.export(
        preprocess_module(source.image), (example,), str(pre_path), input_names=[schema.IMAGE_INPUT_TENSOR], output_names=["normalized"],
        dynamic_axes={schema.IMAGE_INPUT_TENSOR: {0: "batch"}, "normalized": {0: "batch"}}, opset_version=opset, dynamo=False,
    )
    pre = onnx.load(str(pre_path))
    pre.ir_version = model.ir_version
    body = compose.add_prefix(model, "source/")
    merged = compose.merge_models(pre, body, io_map=[("normalized", body.graph.input[0].name)])
    out_name = schema.OUTPUT_TENSORS["image-classification"]
    last = merged.graph.output[0]
    if source.image.source_output == "logits":
        merged.graph.node.append(helper.make_node("Softmax", [last.name], [out_name], axis=1))
    else:
        merged.graph.node.append(helper.make_node("Identity", [last.name], [out_name]))
    new_out = helper.make_tensor_value_info(out_name, onnx.TensorProto.FLOAT, ["batch", source.n_classes])
    merged.graph.ClearField("output")
    merged.graph.output.append(new_out)
    onnx.save(merged, str(path))


def _simplify(raw: Path, path: Path) -> list[str]:
    """Check the graph, then let ONNX Runtime's basic (provider-independent) optimizations fold constants and fuse batch norms offline."""
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(onnx.load(str(raw)), full_check=True)
    before = len(onnx.load(str(raw)).graph.node)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(path)
    options.log_severity_level = 3
    ort.InferenceSession(str(raw), options, providers=["CPUExecutionProvider"])
    simplified = onnx.load(str(path))
    onnx.checker.check_model(simplified)
    return [f"graph checked; simplified from {before} to {len(simplified.graph.node)} nodes (constant folding, batch norm fused)"]


def export_fp32(source: SourceModel, workdir: Path) -> tuple[Path, list[str]]:
    """The fp32 ONNX graph of an image source with preprocessing and softmax folded in; returns its path and notes."""
    workdir.mkdir(parents=True, exist_ok=True)
    raw = workdir / "exported.onnx"
    if source.family == ONNX:
        _export_onnx_source(source, raw)
    elif source.family == TORCHSCRIPT:
        _export_onnx_source(source, raw, _torchscript_graph(source, workdir / "torchscript.onnx"))
    else:
        _export_torch(source, raw)
    path = workdir / FP32_ARTIFACT
    return path, _simplify(raw, path)


def convert_onnx(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """Image classifier -> fp32 ONNX (uint8 images in, probabilities out); exact: must match the source within the tolerance."""
    path, notes = export_fp32(source, workdir)
    return Artifact("onnx", "onnxruntime", "onnxruntime", FP32_ARTIFACT, path, notes=notes)


class _Reader:
    """ONNX Runtime's CalibrationDataReader protocol over the calibration images, in batches."""

    def __init__(self, images: np.ndarray) -> None:
        self.batches = [images[i : i + CALIBRATION_BATCH] for i in range(0, len(images), CALIBRATION_BATCH)]
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.batches):
            return None
        self.i += 1
        return {schema.IMAGE_INPUT_TENSOR: np.ascontiguousarray(self.batches[self.i - 1])}

    def rewind(self) -> None:
        self.i = 0


def _argmax(path: Path, images: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return np.asarray(s.run(None, {schema.IMAGE_INPUT_TENSOR: images})[0]).argmax(1)


def quantize_int8(fp32: Path, out: Path, calibration: np.ndarray) -> list[str]:
    """Static INT8 (QDQ, uint8 activations and int8 weights, min/max calibration) of an fp32 graph.

    What decides the speed here (ORT profiler and side-by-side timings on the demo CNNs, benchmarks/results/vision.md):
    - uint8 activations (the u8s8 kernels): with int8 activations ONNX Runtime left 7 of the residual
      network's 10 convolutions in fp32 between Q/DQ pairs (0.5x of fp32); with uint8 all 9 deep ones and
      the residual Adds run quantized.
    - The preprocessing (Cast, layout, scale/normalize) stays fp32: quantized it became QLinearMul/QLinearAdd.
    - The stem stays fp32: a convolution reading the image with fewer than MIN_INT8_CONV_DEPTH multiply-adds
      per output (1 x 3 x 3 = 9 on the digits) ran 4.7x slower as QLinearConv than as fp32 (28 vs 6 µs at batch 1),
      together with its Relu/MaxPool. Its Relu -> MaxPool is reordered to MaxPool -> Relu (the same values:
      max commutes with a monotonic function) so the first QuantizeLinear follows the Relu: after a MaxPool,
      ONNX Runtime's QDQPropagationTransformer moves it ahead of the pool, which then runs as an NCHW uint8
      MaxPool 8x slower than fp32 (24 vs 3 µs at batch 1, 1574 vs 43 µs at batch 32).
    Weights use 7 of their 8 bits (`reduce_range`): on x86 CPUs without VNNI the u8s8 kernels saturate 8-bit
    products. Per-channel weight scales usually keep more accuracy, not always for small layers: both are built
    and the one that agrees more with fp32 on the calibration images is kept (per-channel on a tie)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = out.with_name("prepared.onnx")
    try:
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=False)
    except Exception:  # pre-processing is an optimization; quantize the graph as it is
        shutil.copy2(fp32, prepared)
    reference = _argmax(fp32, calibration)
    preprocessing, stem = _fp32_regions(prepared)
    excluded = preprocessing + stem
    tried: dict[bool, tuple[float, Path]] = {}
    for per_channel in (True, False):
        path = out.with_name(f"int8-{'channel' if per_channel else 'tensor'}.onnx")
        quantize_static(
            str(prepared),
            str(path),
            _Reader(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            reduce_range=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            nodes_to_exclude=excluded,
        )
        tried[per_channel] = (float(np.mean(_argmax(path, calibration) == reference)), path)
    best = max(tried, key=lambda k: (tried[k][0], k))
    shutil.copy2(tried[best][1], out)
    stem_convs = [n for n in stem if n.endswith("Conv")]
    return [
        f"static INT8 QDQ (uint8 activations, 7-bit int8 weights) calibrated on {len(calibration)} images; {'per-channel' if best else 'per-tensor'} weight scales kept "
        f"(argmax agreement with fp32 on the calibration images: per-channel {tried[True][0]:.2%}, per-tensor {tried[False][0]:.2%}); "
        f"kept in fp32: the preprocessing ({len(preprocessing)} nodes)"
        + (f" and the stem ({', '.join(stem_convs)}: fewer than {MIN_INT8_CONV_DEPTH} multiply-adds per output, with its {len(stem) - len(stem_convs)} activation/pool node(s))" if stem else "")
    ]


# A convolution reading the image whose outputs each need fewer multiply-adds than this (C_in x kH x kW)
# stays fp32: the digits CNNs' first conv (1 x 3 x 3 = 9) ran 4.7x slower as QLinearConv than as fp32
# (28 vs 6 µs at batch 1, 765 vs 104 µs at batch 32; ORT profiler, AVX512-VNNI) while the deeper ones ran 2-3x faster.
MIN_INT8_CONV_DEPTH = 32
_ELEMENTWISE = {"Cast", "Transpose", "Mul", "Add", "Sub", "Div", "Identity"}
_STEM_FOLLOWERS = {"Relu", "MaxPool", "Clip", "AveragePool", "BatchNormalization"}


def _fp32_regions(path: Path) -> tuple[list[str], list[str]]:
    """The preprocessing nodes (the elementwise chain from the image input) and the stem (shallow convs reading
    the preprocessed image, with the Relu/pool nodes that follow each); rewrites `path` so that in the stem a
    Relu -> MaxPool pair runs MaxPool -> Relu (see quantize_int8)."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    preprocessing, frontier = [], [i.name for i in graph.input]
    while len(frontier) == 1 and len(consumers.get(frontier[0], [])) == 1 and consumers[frontier[0]][0].op_type in _ELEMENTWISE:
        node = consumers[frontier[0]][0]
        preprocessing.append(node.name)
        frontier = list(node.output)
    weights = {t.name: list(t.dims) for t in graph.initializer}
    stem = []
    for node in consumers.get(frontier[0], []) if len(frontier) == 1 else []:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        _, cin, *kernel = weights[node.input[1]]
        if cin * int(np.prod(kernel)) >= MIN_INT8_CONV_DEPTH:
            continue
        chain = [node]
        while len(consumers.get(chain[-1].output[0], [])) == 1 and consumers[chain[-1].output[0]][0].op_type in _STEM_FOLLOWERS:
            chain.append(consumers[chain[-1].output[0]][0])
        if len(chain) == 1 and [c.op_type for c in consumers.get(node.output[0], [])].count("Relu") == 1:
            chain += [c for c in consumers[node.output[0]] if c.op_type == "Relu"]  # a Relu feeding several nodes (a residual stem)
        for a, b in zip(chain, chain[1:]):
            if a.op_type == "Relu" and b.op_type == "MaxPool" and len(consumers.get(a.output[0], [])) == 1:
                _swap(graph, a, b)
        stem += [n.name for n in chain]
    onnx.save(model, str(path))
    return preprocessing, stem


def _swap(graph, relu, pool) -> None:
    """x -> Relu -> m -> MaxPool -> y  becomes  x -> MaxPool -> m -> Relu -> y (same values)."""
    x, mid, y = relu.input[0], relu.output[0], pool.output[0]
    pool.input[0], pool.output[0], relu.input[0], relu.output[0] = x, mid, mid, y
    nodes = list(graph.node)
    i, j = nodes.index(relu), nodes.index(pool)
    nodes[i], nodes[j] = pool, relu
    graph.ClearField("node")
    graph.node.extend(nodes)
    for info in [v for v in graph.value_info if v.name == mid]:  # its shape changed (pooled)
        graph.value_info.remove(info)


def convert_onnx_int8(source: SourceModel, workdir: Path, ctx: ConvertContext) -> Artifact:
    """Image classifier -> ONNX Runtime static INT8 (lossy: accepted within the spec's accuracy budget)."""
    if ctx.calibration is None or len(ctx.calibration) == 0:
        raise Skip("no calibration images (spec `calibration`, or held-out images)")
    fp32, notes = export_fp32(source, workdir / "fp32")
    path = workdir / INT8_ARTIFACT
    notes = notes + quantize_int8(fp32, path, ctx.calibration)
    return Artifact("onnx-int8", "onnxruntime", "onnxruntime", INT8_ARTIFACT, path, exact=False, notes=notes)


for _family in VISION_FAMILIES:
    register_converter(_family, "onnx", convert_onnx)
    register_converter(_family, "onnx-int8", convert_onnx_int8)
