"""TensorRT for image models: the generated tensorrt_plan config against Triton's schema, and the skip path
where TensorRT is missing (a clear reason in the report, the ONNX artifact emitted and served)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from scorestack.compile import compile_model, emit
from scorestack.compile.registry import Artifact
from scorestack.compile.report import TritonSettings
from scorestack.compile.spec import parse_spec
from scorestack.compile.vision_models import SmallCNN
from scorestack.errors import ConfigError
from scorestack.triton_config import load_config, parse_config

IMAGE = {"layout": "CHW", "height": 16, "width": 16, "channels": 3, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2]}


def _spec_dict(tmp_path: Path, **extra) -> dict:
    return {
        "name": "tiny_cnn",
        "source": {"path": "tiny.pt", "format": "torch-module", "module": "scorestack.compile.vision_models:SmallCNN", "module_kwargs": {"n_classes": 4, "in_channels": 3, "widths": [4, 8]}, "trusted": True},
        "task": "image-classification",
        "inputs": {"dtype": "uint8", "image": IMAGE},
        "target": "gpu",
        "serving": {"batch_sizes": [1, 16], "latency_budget_ms": 20, "dispatch": False},
        "verification": {"tolerance": 1e-4, "sample_rows": 16},
        "holdout": "holdout.npz",
        **extra,
    }


def _emitted(tmp_path, art: Artifact, kind: str):
    """The spec and settings, the config emit writes for `art` from them, its text, and Triton's own parse of it."""
    spec = parse_spec(_spec_dict(tmp_path), "tiny.yaml", tmp_path)
    settings = TritonSettings(max_batch_size=16, max_queue_delay_us=100, default_timeout_us=10000, max_queue_size=64, instance_count=1, instance_kind=kind, threads=1, rules=[])
    cfg = emit.write_config(tmp_path / "tiny_cnn", emit.build_config(spec, art, settings, 4))
    text = (tmp_path / "tiny_cnn" / "config.pbtxt").read_text()
    parsed = load_config(tmp_path / "tiny_cnn" / "config.pbtxt")  # Triton's own model_config.proto
    assert parsed == cfg
    return spec, settings, cfg, text, parsed


def test_tensorrt_plan_config_validates_against_tritons_schema(tmp_path) -> None:
    art = Artifact("tensorrt", "tensorrt", "tensorrt", "model.plan", tmp_path / "model.plan", exact=False)
    _, _, cfg, text, parsed = _emitted(tmp_path, art, "KIND_GPU")
    assert parsed.platform == "tensorrt_plan" and parsed.backend == "" and parsed.default_model_filename == "model.plan"
    assert parsed.max_batch_size == 16
    (inp,) = parsed.input
    assert inp.name == "images" and inp.data_type == parsed.input[0].data_type and list(inp.dims) == [3, 16, 16]
    assert "TYPE_UINT8" in text and "KIND_GPU" in text
    assert parsed.output[0].name == "probabilities" and list(parsed.output[0].dims) == [4]
    assert parsed.model_warmup[0].inputs["images"].dims == [3, 16, 16]
    # The schema check is real: a misspelled platform field is refused by name.
    with pytest.raises(ConfigError, match="platfrom"):
        parse_config(text.replace("platform:", "platfrom:"), "config.pbtxt")


def test_onnx_tensorrt_accelerator_config_validates_against_tritons_schema(tmp_path) -> None:
    art = Artifact("onnx-tensorrt", "onnxruntime", "onnxruntime", "model.onnx", tmp_path / "model.onnx", exact=False)
    spec, settings, cfg, text, parsed = _emitted(tmp_path, art, "KIND_CPU")
    assert parsed.backend == "onnxruntime" and parsed.platform == "" and parsed.default_model_filename == "model.onnx"
    # The accelerator applies to GPU instances only: the group is KIND_GPU whatever the CPU-side settings said.
    assert [g.kind for g in parsed.instance_group] == [parsed.instance_group[0].KIND_GPU]
    (accel,) = parsed.optimization.execution_accelerators.gpu_execution_accelerator
    assert accel.name == "tensorrt"
    assert dict(accel.parameters) == {
        "precision_mode": "FP16", "max_workspace_size_bytes": "1073741824", "trt_engine_cache_enable": "1", "trt_engine_cache_path": "/tmp/scorestack_trt_cache",
    }
    assert not parsed.optimization.execution_accelerators.cpu_execution_accelerator
    assert 'name: "tensorrt"' in text and 'key: "precision_mode"' in text and 'value: "FP16"' in text
    # The schema check is real: a misspelled accelerator field is refused by name.
    with pytest.raises(ConfigError, match="gpu_execution_acelerator"):
        parse_config(text.replace("gpu_execution_accelerator", "gpu_execution_acelerator"), "config.pbtxt")
    # Plain ONNX candidates carry no accelerator block.
    plain = emit.build_config(spec, Artifact("onnx", "onnxruntime", "onnxruntime", "model.onnx", tmp_path / "model.onnx"), settings, 4)
    assert not plain.HasField("optimization")


def test_onnx_tensorrt_candidate_skips_with_the_reason(tmp_path) -> None:
    from scorestack.compile.convert_tensorrt import convert_ort_tensorrt, ort_tensorrt_available
    from scorestack.compile.registry import ConvertContext, Skip

    ctx = ConvertContext(task="image-classification", n_features=3 * 16 * 16, target="cpu", sample=np.zeros((1, 3, 16, 16), np.uint8))
    with pytest.raises(Skip, match="target is cpu: the TensorRT execution accelerator runs on NVIDIA GPUs"):
        convert_ort_tensorrt(None, tmp_path, ctx)
    reason = ort_tensorrt_available()
    if reason is None:  # a GPU machine with onnxruntime's TensorRT provider: nothing to skip for
        return
    import onnxruntime as ort

    assert "TensorrtExecutionProvider" in reason
    gpu_ctx = ConvertContext(task="image-classification", n_features=3 * 16 * 16, target="gpu", sample=ctx.sample)
    with pytest.raises(Skip) as exc:
        convert_ort_tensorrt(None, tmp_path, gpu_ctx)
    assert str(exc.value) == reason
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        assert reason.startswith(f"onnxruntime {ort.__version__} has no TensorrtExecutionProvider")


def test_without_tensorrt_the_stage_says_so_and_the_onnx_artifact_is_emitted(tmp_path) -> None:
    has_tensorrt = importlib.util.find_spec("tensorrt") is not None
    torch.manual_seed(0)
    torch.save(SmallCNN(n_classes=4, in_channels=3, widths=[4, 8]).eval().state_dict(), tmp_path / "tiny.pt")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "holdout.npz", X=rng.integers(0, 256, (48, 3, 16, 16), dtype=np.uint8), y=rng.integers(0, 4, 48))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(_spec_dict(tmp_path, formats=["onnx", "tensorrt", "tensorrt-int8"])))
    report = compile_model(tmp_path / "tiny.yaml", tmp_path / "repo")
    by = {c.format: c for c in report.candidates}
    if has_tensorrt:
        # Where TensorRT is installed (a GPU machine) its absence cannot be produced: the engines
        # must then have been attempted, not skipped for a missing library.
        for fmt in ("tensorrt", "tensorrt-int8"):
            assert not (by[fmt].reason or "").startswith("tensorrt not installed"), by[fmt].reason
        return
    for fmt in ("tensorrt", "tensorrt-int8"):
        assert by[fmt].status == "skipped"
        assert by[fmt].reason.startswith("tensorrt not installed (") and "No module named 'tensorrt'" in by[fmt].reason
    assert report.selected.format == "onnx" and report.serve_check.status == "passed"
    cfg = load_config(tmp_path / "repo" / "tiny_cnn" / "config.pbtxt")
    assert cfg.backend == "onnxruntime" and cfg.default_model_filename == "model.onnx" and list(cfg.input[0].dims) == [3, 16, 16]
    assert (tmp_path / "repo" / "tiny_cnn" / "1" / "model.onnx").exists()
    md = (tmp_path / "repo" / "tiny_cnn" / "report.md").read_text()
    assert "tensorrt not installed" in md
    assert json.loads((tmp_path / "repo" / "tiny_cnn" / "report.json").read_text())["source"]["input_shape"] == [3, 16, 16]
