"""Converter registry: "which formats can this model become" is a lookup by model family.

Each source framework's converters live in one module (`convert_xgboost`, `convert_lightgbm`, `convert_sklearn`,
`convert_tensorrt`) that ends with a short table of `register_converter(...)` calls.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np


class Skip(Exception):
    """A converter does not apply here (library not installed, wrong target); the message says why."""


@dataclass(frozen=True)
class ConvertContext:
    """What a converter may use besides the model: the spec's task and target, and sample rows."""

    task: str
    n_features: int
    target: str
    sample: np.ndarray  # a few held-out rows (hummingbird test input, output-width probing)
    compile_threads: int = 2
    calibration: np.ndarray | None = None  # image models: uint8 images for INT8 calibration (spec `calibration`)
    max_batch_size: int = 0  # the largest batch the model serves (TensorRT's optimization profile)
    build_budget_s: float = 20.0  # the longest a native build (TL2cgen's gcc) may take: the spec's build_budget_s


@dataclass(frozen=True)
class DispatchBand:
    """One band of a dispatch artifact: batches of min_rows..max_rows rows run `artifact` with `runtime`.

    config.pbtxt carries the bands as the plan compile/dispatch.py `dispatch_parameter` writes."""

    format: str
    min_rows: int
    max_rows: int
    runtime: str
    artifact: str  # file name inside the version folder
    output_column: int | None = None
    method: str | None = None



@dataclass
class Artifact:
    """One converted model on disk and how the model runtime runs it (serve/runtime/scorestack_runtime.py)."""

    format: str  # onnx | onnx-int8 | native | tl2cgen | trees | linear | hummingbird | tensorrt | dispatch (several, by batch size)
    runtime: str  # a key of the runtime's RUNNERS table (onnxruntime | xgboost | sklearn | tl2cgen | tensorrt), or "dispatch"
    backend: str  # Triton backend: onnxruntime | python | tensorrt
    artifact_name: str  # file name inside the version folder
    path: Path  # where the artifact lies now
    exact: bool = True  # an exact conversion must match its source within the tolerance
    output_column: int | None = None
    method: str | None = None  # sklearn native: predict_proba | predict
    notes: list[str] = field(default_factory=list)
    bands: tuple[DispatchBand, ...] = ()  # format "dispatch": the formats by batch size (compile/dispatch.py)


Converter = Callable[["object", Path, ConvertContext], Artifact]

_REGISTRY: dict[str, dict[str, Converter]] = {}
_MODULES = ("convert_xgboost", "convert_lightgbm", "convert_sklearn", "convert_tensorrt", "convert_torch")
_loaded = False


def register_converter(family: str, fmt: str, fn: Converter) -> None:
    """Declare that models of `family` can become `fmt` through `fn(source, workdir, ctx)`."""
    _REGISTRY.setdefault(family, {})[fmt] = fn


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in _MODULES:
            importlib.import_module(f"{__package__}.{mod}")
        _loaded = True


def formats_for(family: str) -> list[str]:
    """Every format a model of this family can become, in registration order."""
    _load()
    return list(_REGISTRY.get(family, {}))


def converter_for(family: str, fmt: str) -> Converter:
    _load()
    try:
        return _REGISTRY[family][fmt]
    except KeyError:
        raise Skip(f"no {fmt} converter for {family} models") from None


def output_column(task: str, raw: np.ndarray) -> int | None:
    """Which column of a 2-D raw output is the contract's output: binary [n, 2] -> 1, else none."""
    width = raw.reshape(len(raw), -1).shape[1]
    if task == "binary" and width == 2:
        return 1
    if width != 1 and task != "multiclass":
        raise ValueError(f"unexpected output width {width} for a {task} model")
    return None
