"""Image sources besides a torch module: a TorchScript file and an ONNX graph compile to the same uint8
contract, and the folded preprocessing equals the declared one computed independently here in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml

from scorestack.compile import compile_model
from scorestack.compile.vision_models import SmallResNet

IMAGE = {"layout": "HWC", "height": 16, "width": 16, "channels": 3, "scale": 1 / 255, "mean": [0.5, 0.4, 0.3], "std": [0.25, 0.2, 0.15]}


def _expected(model: torch.nn.Module, X: np.ndarray) -> np.ndarray:
    """The declared preprocessing written out by hand: HWC -> CHW, x/255, minus mean, over std; softmax of the logits."""
    x = X.astype(np.float64).transpose(0, 3, 1, 2) / 255.0
    x = (x - np.array(IMAGE["mean"])[None, :, None, None]) / np.array(IMAGE["std"])[None, :, None, None]
    with torch.no_grad():
        logits = model(torch.from_numpy(x.astype(np.float32))).double().numpy()
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, torch.nn.Module, np.ndarray]:
    root = tmp_path_factory.mktemp("vision_sources")
    torch.manual_seed(1)
    model = SmallResNet(n_classes=5, in_channels=3, widths=[8, 16]).eval()
    with torch.no_grad():  # non-trivial batch-norm statistics, so folding them is actually checked
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    torch.jit.save(torch.jit.trace(model, torch.zeros(1, 3, 16, 16)), str(root / "model.ts"))
    torch.onnx.export(
        model, (torch.zeros(2, 3, 16, 16),), str(root / "model_float.onnx"), input_names=["x"], output_names=["logits"],
        dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}}, opset_version=17, dynamo=False,
    )
    rng = np.random.default_rng(0)
    X = rng.integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    np.savez(root / "holdout.npz", X=X, y=rng.integers(0, 5, 64))
    return root, model, X


@pytest.mark.parametrize("fmt,path,trusted", [("torchscript", "model.ts", True), ("onnx-model", "model_float.onnx", False)])
def test_torchscript_and_onnx_sources_serve_the_declared_preprocessing(sources, fmt: str, path: str, trusted: bool) -> None:
    root, model, X = sources
    spec = {
        "name": f"src_{fmt}",
        "source": {"path": path, "format": fmt, "trusted": trusted},
        "task": "image-classification",
        "inputs": {"dtype": "uint8", "image": IMAGE},
        "serving": {"batch_sizes": [1, 8], "dispatch": False},
        "verification": {"tolerance": 1e-4, "sample_rows": 16},
        "formats": ["onnx"],
        "holdout": "holdout.npz",
    }
    (root / f"{fmt}.yaml").write_text(yaml.safe_dump(spec))
    report = compile_model(root / f"{fmt}.yaml", root / "repo")
    assert report.source.family == {"torchscript": "torchscript-vision", "onnx-model": "onnx-vision"}[fmt]
    assert report.selected.format == "onnx" and report.serve_check.status == "passed" and report.serve_check.label_agreement == 1.0
    artifact = root / "repo" / spec["name"] / str(report.version) / "model.onnx"
    got = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"]).run(None, {"images": X})[0]
    want = _expected(model, X)
    assert got.shape == (64, 5)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert (got.argmax(1) == want.argmax(1)).all()
