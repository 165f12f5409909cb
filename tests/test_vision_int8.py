"""Static INT8 of image graphs: what ONNX Runtime runs after its own optimizations (the structure that made
INT8 faster than fp32 on the demo CNNs, benchmarks/results/vision.md), and that the graph rewrites keep values."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from scorestack.compile.convert_torch import export_fp32, quantize_int8
from scorestack.compile.vision import VisionSource
from scorestack.compile.spec import ImageSpec
from scorestack.compile.vision_models import SmallCNN, SmallResNet

IMAGE = ImageSpec(layout="HWC", height=16, width=16, channels=1, scale=1 / 255, mean=[0.2], std=[0.3])


def _source(model: torch.nn.Module) -> VisionSource:
    return VisionSource("tiny", "image-classification", "torch-vision", model.eval(), 16 * 16, model.n_classes, image=IMAGE)


def _session(path, optimized=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (96, 16, 16, 1), dtype=np.uint8)


@pytest.mark.parametrize("arch", ["cnn", "resnet"])
def test_int8_graph_runs_quantized_kernels_after_a_fp32_stem(tmp_path, images, arch) -> None:
    torch.manual_seed(0)
    model = SmallCNN(4, 1, [16, 32, 64]) if arch == "cnn" else SmallResNet(4, 1, [16, 32, 64])
    with torch.no_grad():  # trained-like batch-norm statistics (default ones fold into identical, shared zero biases)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    fp32, _ = export_fp32(_source(model), tmp_path / "fp32")
    out = tmp_path / "int8" / "model-int8.onnx"
    out.parent.mkdir()
    notes = quantize_int8(fp32, out, images[:64])
    assert "uint8 activations" in notes[0] and "kept in fp32: the preprocessing (4 nodes) and the stem" in notes[0]

    # The Relu -> MaxPool reorder (and everything else done before calibration) keeps the fp32 values.
    prepared = out.with_name("prepared.onnx")
    want = _session(fp32).run(None, {"images": images})[0]
    got = _session(prepared).run(None, {"images": images})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if arch == "cnn":
        ops = [n.op_type for n in onnx.load(str(prepared)).graph.node]
        first_conv = ops.index("Conv")
        assert ops[first_conv + 1 : first_conv + 3] == ["MaxPool", "Relu"]

    optimized = tmp_path / "optimized.onnx"
    _session(out, optimized)
    graph = onnx.load(str(optimized)).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    deep_convs = 2 if arch == "cnn" else 9  # every conv but the stem (the residual net: 3 blocks x (2 + a 1x1 shortcut))
    assert ops["QLinearConv"] == deep_convs and ops["Conv"] == 1
    # The preprocessing is not quantized, and no pool runs on uint8 in NCHW (the slow kernel): the only
    # plain MaxPool is the fp32 one of the stem, and it does not read a QuantizeLinear.
    assert ops["QLinearMul"] == 0 and ops["QuantizeLinear"] == 2 and ops["DequantizeLinear"] == 2
    produced_by = {o: n.op_type for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type == "MaxPool":
            assert produced_by.get(node.input[0]) != "QuantizeLinear"
    if arch == "resnet":
        assert ops["QLinearAdd"] == 3  # the residual sums run quantized (uint8 activations)
