"""The compiler: turn a trained scikit-learn, XGBoost or image (PyTorch/ONNX) model and a spec into the fastest verified Triton model folder.

Public entry points: `compile_model`, `compile_many`, `load_spec`; the report is `CompileReport`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scorestack._lazy import lazy_exports

if TYPE_CHECKING:  # (re-exported: `name as name`); imports stay lazy: `scorestack --help` must not load XGBoost and ONNX
    from .jobs import JobResult as JobResult, compile_many as compile_many
    from .pipeline import compile_model as compile_model
    from .report import CompileReport as CompileReport
    from .spec import ModelSpec as ModelSpec, load_spec as load_spec

_EXPORTS = {
    name: f"{__name__}.{module}"
    for name, module in {
        "compile_model": "pipeline",
        "compile_many": "jobs",
        "JobResult": "jobs",
        "CompileReport": "report",
        "ModelSpec": "spec",
        "load_spec": "spec",
    }.items()
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
