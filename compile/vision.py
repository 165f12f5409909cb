"""Image classifiers as compiler sources: load a torch module, TorchScript file or ONNX graph, fold the
spec's uint8 preprocessing in front of it, and give the reference `predict` every candidate is checked against.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scorestack.errors import SpecError

from .model import SourceModel
from .spec import ImageSpec, ModelSpec

# Families of image sources (registry keys): a torch nn.Module (prunable, distillable), a TorchScript
# module, an ONNX graph. All three take float32 [N, C, H, W] normalized by the spec's preprocessing.
TORCH, TORCHSCRIPT, ONNX = "torch-vision", "torchscript-vision", "onnx-vision"
VISION_FAMILIES = (TORCH, TORCHSCRIPT, ONNX)
_FAMILY = {"torch-module": TORCH, "torchscript": TORCHSCRIPT, "onnx-model": ONNX}


@dataclass(frozen=True)
class Images:
    """Labelled uint8 images in the spec's wire layout ([n, *image.shape])."""

    X: np.ndarray
    y: np.ndarray | None


def load_images(path: Path, spec: ModelSpec, source: str, field_name: str, need_labels: bool = True) -> Images:
    """Read an .npz holding uint8 images X in the declared layout (and labels y)."""
    image = spec.inputs.image
    assert image is not None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise SpecError(f"spec {source}: field `{field_name}`: cannot read {path} ({exc}); give a .npz file with uint8 images X and labels y") from None
    if "X" not in arrays:
        raise SpecError(f"spec {source}: field `{field_name}`: {path.name} has no array `X` (has {sorted(arrays)}); save it with np.savez(path, X=images, y=labels)")
    X = arrays["X"]
    if X.dtype != np.uint8 or X.ndim != 4 or tuple(X.shape[1:]) != image.shape or len(X) == 0:
        raise SpecError(
            f"spec {source}: field `{field_name}`: X is {X.dtype} {tuple(X.shape)} but the spec declares uint8 images of shape "
            f"{list(image.shape)} ({image.layout}); save X as uint8 [n, {', '.join(map(str, image.shape))}]"
        )
    y = arrays.get("y")
    if y is None and need_labels:
        raise SpecError(f"spec {source}: field `{field_name}`: {path.name} has no labels `y`; save the class index of every image as y")
    if y is not None:
        y = np.asarray(y).ravel().astype(np.int64)
        if len(y) != len(X):
            raise SpecError(f"spec {source}: field `{field_name}`: {len(y)} labels for {len(X)} images")
    return Images(np.ascontiguousarray(X), y)


# --- the preprocessing folded into every served graph -----------------------------------------------
def _torch():
    import torch

    return torch


def preprocess_module(image: ImageSpec):  # -> torch.nn.Module
    """uint8 [N, *shape] -> float32 [N, C, H, W]: ((x * scale) - mean) / std as one multiply-add per channel."""
    torch = _torch()

    class Preprocess(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            c = image.channels
            mean = torch.tensor((image.mean * c)[:c] if len(image.mean) == 1 else image.mean, dtype=torch.float32)
            std = torch.tensor((image.std * c)[:c] if len(image.std) == 1 else image.std, dtype=torch.float32)
            # One multiply and one add per pixel: scale/std and -mean/std folded ahead of time.
            self.register_buffer("a", (image.scale / std).reshape(1, c, 1, 1))
            self.register_buffer("b", (-mean / std).reshape(1, c, 1, 1))
            self.hwc = image.layout == "HWC"

        def forward(self, x):
            x = x.to(torch.float32)
            if self.hwc:
                x = x.permute(0, 3, 1, 2)
            return x * self.a + self.b

    return Preprocess()


def served_module(model: Any, image: ImageSpec):  # -> torch.nn.Module
    """The whole served graph in torch: preprocessing, the source model, softmax (when it returns logits)."""
    torch = _torch()
    pre = preprocess_module(image)
    softmax = image.source_output == "logits"

    class Served(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.model = pre, model

        def forward(self, x):
            y = self.model(self.pre(x))
            return torch.softmax(y, dim=1) if softmax else y

    return Served().eval()


# --- loading ----------------------------------------------------------------------------------------
@dataclass
class VisionSource(SourceModel):
    """An image-classification source (a torch module, TorchScript or an ONNX graph) with the spec's
    ImageSpec (wire layout and folded preprocessing); its reference predictions are class
    probabilities [n, k] through the source framework's own path."""

    image: ImageSpec | None = None

    @property
    def framework(self) -> str:
        return "onnx" if self.family == ONNX else "torch"

    @property
    def n_trees(self) -> int | None:
        return None

    def predict(self, X: np.ndarray) -> np.ndarray:
        return predict(self, X)


def import_class(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def load_vision_source(spec: ModelSpec, source: str) -> VisionSource:
    """Load a torch-module / torchscript / onnx source, check its output width, and wrap it as a VisionSource."""
    src, image = spec.source, spec.inputs.image
    assert image is not None
    if src.format not in _FAMILY:
        raise SpecError(f"spec {source}: field `source.format`: {src.format} holds a tabular model; an image-classification model comes as torch-module, torchscript or onnx-model")
    if not src.path.exists():
        raise SpecError(f"spec {source}: field `source.path`: {src.path} does not exist; give the model file's path, relative to the spec file")
    if src.format in ("torch-module", "torchscript") and not src.trusted:
        raise SpecError(
            f"spec {source}: field `source.trusted`: refusing to load {src.path.name} ({src.format}): a torch-module source imports "
            f"and runs the class {src.module!r} and a TorchScript file runs its code. If you produced the file yourself, set "
            "`trusted: true` under `source`; otherwise export the model to ONNX (format: onnx-model), which carries no code."
        )
    torch = _torch()
    try:
        if src.format == "torch-module":
            assert src.module is not None
            try:
                cls = import_class(src.module)
            except (ImportError, AttributeError) as exc:
                raise SpecError(f"spec {source}: field `source.module`: cannot import {src.module!r} ({exc}); name an importable class as package.module:ClassName") from None
            model = cls(**src.module_kwargs)
            state = torch.load(src.path, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
            model.eval()
            desc = f"torch {cls.__name__}({', '.join(f'{k}={v}' for k, v in src.module_kwargs.items())})"
        elif src.format == "torchscript":
            model = torch.jit.load(str(src.path), map_location="cpu").eval()
            desc = f"TorchScript {getattr(model, 'original_name', type(model).__name__)}"
        else:
            import onnx

            model = onnx.load(str(src.path))
            onnx.checker.check_model(model)
            desc = f"ONNX graph (opset {max(o.version for o in model.opset_import if o.domain in ('', 'ai.onnx'))})"
    except SpecError:
        raise
    except Exception as exc:  # any library error means "this file is not a loadable model"
        raise SpecError(
            f"spec {source}: field `source.path`: cannot load {src.path.name} as {src.format}: {type(exc).__name__}: {str(exc)[:300]}; "
            "check that the file is complete and that `source.format` (and `source.module`) match it"
        ) from None
    sm = VisionSource(name=spec.name, task=spec.task, family=_FAMILY[src.format], model=model, n_features=spec.n_features, description=desc, image=image)
    probe = np.zeros((2, *image.shape), dtype=np.uint8)
    try:
        out = sm.predict(probe)
    except Exception as exc:  # a model that cannot run on the declared images is a spec error
        raise SpecError(
            f"spec {source}: field `inputs.image`: the model does not run on float32 [N, {image.channels}, {image.height}, {image.width}] "
            f"(the declared images after preprocessing): {type(exc).__name__}: {str(exc)[:300]}"
        ) from None
    sm.n_classes = int(out.shape[1])
    if src.format == "torch-module":
        from .vision_models import n_parameters

        sm.description += f", {n_parameters(model):,} parameters"
    return sm


def predict(sm: Any, X: np.ndarray, batch: int = 256) -> np.ndarray:
    """Reference class probabilities [n, k] (float64) through the source framework's own path."""
    image = sm.image
    if sm.family == ONNX:
        import onnxruntime as ort

        session = sm.cache.get("session")
        if session is None:
            session = sm.cache["session"] = ort.InferenceSession(sm.model.SerializeToString(), providers=["CPUExecutionProvider"])
        torch = _torch()
        pre = preprocess_module(image)
        name = session.get_inputs()[0].name
        outs = []
        with torch.no_grad():
            for i in range(0, len(X), batch):
                x = pre(torch.from_numpy(np.ascontiguousarray(X[i : i + batch]))).numpy()
                y = torch.from_numpy(np.asarray(session.run(None, {name: x})[0], dtype=np.float32))
                outs.append((torch.softmax(y, 1) if image.source_output == "logits" else y).numpy())
        return np.concatenate(outs).astype(np.float64)
    torch = _torch()
    served = served_module(sm.model, image)
    with torch.no_grad():
        out = [served(torch.from_numpy(np.ascontiguousarray(X[i : i + batch]))).numpy() for i in range(0, len(X), batch)]
    return np.concatenate(out).astype(np.float64)


def to_float(image: ImageSpec, X: np.ndarray):  # -> torch.Tensor
    """Preprocessed float32 [N, C, H, W] (the source model's input) from uint8 wire images, in plain NCHW memory order.

    From HWC images the preprocessing's permute leaves channels-last strides, which for one channel also
    count as contiguous, so `.contiguous()` keeps them. torch 2.13's CPU convolution backward on such a
    tensor, with 2 threads and a layer of odd width (11, 22, 45 channels), aborted the process ("double
    free or corruption"; reproduced with random weights and data), so training data is copied to NCHW."""
    torch = _torch()
    with torch.no_grad():
        return preprocess_module(image)(torch.from_numpy(np.ascontiguousarray(X))).clone(memory_format=torch.contiguous_format)
