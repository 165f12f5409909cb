"""Model specs: the YAML a user writes to ask for a compiled model, validated once, at the edge."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, ValidationInfo, field_validator

from scorestack import schema
from scorestack.errors import SpecError

Task = Literal["binary", "multiclass", "regression", "ranking"]
SourceFormat = Literal["xgboost-json", "xgboost-ubj", "joblib", "pickle"]
Format = Literal["onnx", "native", "tl2cgen", "hummingbird", "tensorrt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Strict):
    """The trained model to compile."""

    path: Path
    format: SourceFormat
    trusted: bool = False  # joblib/pickle run code on load: only load files the user vouches for


class InputSpec(_Strict):
    """The input tensor: one float32 column per feature, in this order."""

    features: list[str] = Field(min_length=1)
    dtype: Literal["float32"] = "float32"

    @field_validator("features")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dup = sorted({f for f in v if v.count(f) > 1})
        if dup:
            raise ValueError(f"feature names must be unique; repeated: {', '.join(dup)}")
        return v


class ServingSpec(_Strict):
    """The load the model must serve: expected batch sizes (with weights) and a latency budget."""

    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 64], min_length=1)
    batch_weights: list[PositiveFloat] | None = None
    latency_budget_ms: PositiveFloat = 10.0
    # Binary models: the probability at or above which the service decides "positive" (e.g. hold
    # the payment). Written into config.pbtxt so every client reads the same value from Triton.
    decision_threshold: float | None = Field(None, ge=0.0, le=1.0)
    # Versions kept in the repository and served side by side (Triton's version policy `latest`):
    # a recompile adds a version, the oldest beyond this count is removed.
    keep_versions: PositiveInt = 2
    # The largest batch Triton may form or accept (max_batch_size); default: the largest batch size.
    # Candidates are measured on a grid of every power of two up to it, not only on batch_sizes.
    max_batch_size: PositiveInt | None = None
    # Serve several verified formats, each on the batch sizes where it was measured fastest
    # (compile/dispatch.py); false keeps one format for every batch size.
    dispatch: bool = True

    @field_validator("batch_weights")
    @classmethod
    def _weights_match(cls, v: list[float] | None, info: ValidationInfo) -> list[float] | None:
        sizes = info.data.get("batch_sizes")
        if v is not None and sizes is not None and len(v) != len(sizes):
            raise ValueError(f"has {len(v)} entries but batch_sizes has {len(sizes)}")
        return v

    @field_validator("max_batch_size")
    @classmethod
    def _covers_batch_sizes(cls, v: int | None, info: ValidationInfo) -> int | None:
        sizes = info.data.get("batch_sizes")
        if v is not None and sizes and v < max(sizes):
            raise ValueError(f"is {v}, below the largest batch size {max(sizes)}")
        return v

    @property
    def max_batch(self) -> int:
        return self.max_batch_size or max(self.batch_sizes)

    def weights(self) -> dict[int, float]:
        """Normalized weight per batch size (equal weights by default)."""
        raw = self.batch_weights or [1.0] * len(self.batch_sizes)
        total = float(sum(raw))
        return {b: w / total for b, w in zip(self.batch_sizes, raw)}


class PruningSpec(_Strict):
    """Keep the smallest prefix of trees whose quality stays within the budget."""

    enabled: bool = True
    quality_budget: float = Field(default=0.002, ge=0)  # largest allowed drop of the task metric
    min_trees: PositiveInt = 1


class DistillationSpec(_Strict):
    """Train a smaller XGBoost student on the teacher's scores and the labels."""

    enabled: bool = True
    quality_budget: float = Field(default=0.005, ge=0)
    n_estimators: PositiveInt = 50
    max_depth: PositiveInt = 4
    learning_rate: PositiveFloat = 0.1
    soft_weight: float = Field(default=0.5, ge=0, le=1)  # share of the teacher's score in the target
    train_rows: Path | None = None  # .npz with X (and y); default: half of the held-out rows


class OptimizationSpec(_Strict):
    pruning: PruningSpec | None = None
    distillation: DistillationSpec | None = None


class VerificationSpec(_Strict):
    tolerance: PositiveFloat = 1e-5
    sample_rows: PositiveInt = 256  # rows checked one at a time (batch 1)


class ModelSpec(_Strict):
    """One model to compile; relative paths are resolved against the spec file's folder."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    source: SourceSpec
    task: Task
    inputs: InputSpec
    outputs: list[str] | None = None
    target: Literal["cpu", "gpu"] = "cpu"
    serving: ServingSpec = Field(default_factory=ServingSpec)
    optimization: OptimizationSpec = Field(default_factory=OptimizationSpec)
    verification: VerificationSpec = Field(default_factory=VerificationSpec)
    threads: list[PositiveInt] = Field(default_factory=lambda: [1], min_length=1)
    holdout: Path
    formats: list[Format] | None = None  # restrict the candidates (default: every registered format)

    @field_validator("threads", mode="before")
    @classmethod
    def _threads_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) else v

    @field_validator("outputs")
    @classmethod
    def _outputs_follow_contract(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        task = info.data.get("task")
        if v is not None and task is not None and v != [schema.OUTPUT_TENSORS[task]]:
            raise ValueError(f"a {task} model exposes exactly one output named {schema.OUTPUT_TENSORS[task]!r}")
        return v

    @field_validator("serving")
    @classmethod
    def _threshold_only_for_binary(cls, v: ServingSpec, info: ValidationInfo) -> ServingSpec:
        task = info.data.get("task")
        if v.decision_threshold is not None and task is not None and task != "binary":
            raise ValueError(f"decision_threshold applies to binary models only (task is {task})")
        return v

    @property
    def output_name(self) -> str:
        return schema.OUTPUT_TENSORS[self.task]

    @property
    def n_features(self) -> int:
        return len(self.inputs.features)


# Field-specific advice appended to validation messages: the fix, not just the fault.
_FIXES = {
    "verification.tolerance": "set a positive number such as 1e-5",
    "verification.sample_rows": "set a positive row count such as 256",
    "source.format": "use one of xgboost-json, xgboost-ubj, joblib, pickle",
    "source.path": "give the model file's path, relative to the spec file",
    "source.trusted": "write `trusted: true` only for files you produced yourself",
    "task": "use one of binary, multiclass, regression, ranking",
    "name": "use letters, digits, '_', '-' or '.', starting with a letter or digit",
    "inputs.features": "list the model's input feature names in column order",
    "inputs.dtype": "inputs are float32; write `dtype: float32`",
    "outputs": "omit `outputs` to use the task's standard tensor name",
    "serving.latency_budget_ms": "set the per-request budget in milliseconds, such as 5",
    "serving.batch_sizes": "list the batch sizes you expect, such as [1, 64]",
    "serving.batch_weights": "give one positive weight per batch size, or omit it",
    "serving.decision_threshold": "give a probability in [0, 1] (binary models only), or omit it for 0.5",
    "serving.keep_versions": "give how many model versions to keep and serve, such as 2",
    "serving.max_batch_size": "give the largest batch Triton may execute (at least the largest of batch_sizes), or omit it",
    "serving.dispatch": "write true (serve the fastest format per batch size) or false (one format for all)",
    "threads": "give a thread count such as 1, or a list such as [1, 2]",
    "holdout": "give a .npz file with arrays X and y (and group for ranking)",
    "formats": "use some of onnx, native, tl2cgen, hummingbird, tensorrt",
    "target": "use cpu or gpu",
}

def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


_MESSAGES = {
    "greater_than": lambda e: f"must be > {_num(e['ctx']['gt'])}",
    "greater_than_equal": lambda e: f"must be >= {_num(e['ctx']['ge'])}",
    "less_than_equal": lambda e: f"must be <= {_num(e['ctx']['le'])}",
    "missing": lambda e: "is required",
    "extra_forbidden": lambda e: "is not a known field",
}


def _field_name(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    return ".".join(parts) or "<root>"


def _fix_for(field: str) -> str | None:
    while field:
        if field in _FIXES:
            return _FIXES[field]
        field = field.rpartition(".")[0]
    return None


def format_validation_error(source: str, exc: ValidationError) -> str:
    """One line per problem: `spec X: field `a.b`: what is wrong (got V); how to fix it`."""
    lines = []
    for err in exc.errors():
        field = _field_name(err["loc"])
        make = _MESSAGES.get(err["type"])
        what = make(err) if make else re.sub(r"^Value error, ", "", err["msg"])
        got = "" if err["type"] in ("missing",) else f" (got {err.get('input')!r})"
        if isinstance(err.get("input"), (dict, list)) and err["type"] != "extra_forbidden":
            got = ""
        fix = _fix_for(field)
        lines.append(f"spec {source}: field `{field}`: {what}{got}" + (f"; {fix}" if fix else ""))
    return "\n".join(lines)


def _resolve(base: Path, p: Path | None) -> Path | None:
    if p is None:
        return None
    p = p.expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def parse_spec(data: Any, source: str, base_dir: Path) -> ModelSpec:
    """Validate a spec mapping; resolve relative paths against `base_dir`."""
    if not isinstance(data, dict):
        raise SpecError(f"spec {source}: expected a mapping of fields at the top level, got {type(data).__name__}")
    try:
        spec = ModelSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(source, exc)) from None
    updates: dict[str, Any] = {
        "source": spec.source.model_copy(update={"path": _resolve(base_dir, spec.source.path)}),
        "holdout": _resolve(base_dir, spec.holdout),
    }
    dist = spec.optimization.distillation
    if dist is not None and dist.train_rows is not None:
        updates["optimization"] = spec.optimization.model_copy(
            update={"distillation": dist.model_copy(update={"train_rows": _resolve(base_dir, dist.train_rows)})}
        )
    return spec.model_copy(update=updates)


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a spec YAML file; raise SpecError naming the field and the fix."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"spec {path}: cannot read the file ({exc.strerror}); check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"spec {path.name}: not valid YAML: {exc}") from None
    return parse_spec(data, path.name, path.resolve().parent)


def dump_spec(spec: ModelSpec) -> str:
    """YAML text for a spec (paths as given)."""
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False)
