"""Model specs: the YAML a user writes to ask for a compiled model, validated once, at the edge."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError, ValidationInfo, field_validator

from scorestack import limits, schema
from scorestack.errors import SpecError

Task = Literal["binary", "multiclass", "regression", "ranking", "image-classification"]
# torch-module: a state dict (`path`) for the nn.Module class named by `source.module`; torchscript:
# a torch.jit.save file; onnx-model: an ONNX graph. The three vision sources take float32 [N, C, H, W]
# already normalized: the compiler folds the declared preprocessing in front of them.
SourceFormat = Literal["xgboost-json", "xgboost-ubj", "lightgbm-text", "joblib", "pickle", "torch-module", "torchscript", "onnx-model"]
Format = Literal["onnx", "onnx-int8", "native", "tl2cgen", "trees", "linear", "hummingbird", "tensorrt", "tensorrt-int8", "onnx-tensorrt"]
VISION_SOURCES = ("torch-module", "torchscript", "onnx-model")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Strict):
    """The trained model to compile."""

    path: Path
    format: SourceFormat
    trusted: bool = False  # joblib/pickle/torch-module/torchscript run code on load: only load files the user vouches for
    # An early-stopped XGBoost model (it records `best_iteration`): `best` serves the rounds up to it, as
    # XGBoost's scikit-learn predict does; `all` every round, as Booster.predict does; `auto` what the
    # API that saved it predicts (best for XGBClassifier/XGBRegressor files and objects, all for xgb.train's).
    iterations: Literal["auto", "best", "all"] = "auto"
    # torch-module: the importable class "package.module:ClassName" and its constructor arguments.
    module: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    module_kwargs: dict[str, Any] = Field(default_factory=dict)


class ImageSpec(_Strict):
    """The uint8 image a client sends, and the preprocessing the compiler folds into the graph.

    The served graph takes uint8 [batch, *shape] in `layout` and computes
    ((pixel * scale) - mean[c]) / std[c] in float32, in [N, C, H, W], before the source model."""

    layout: Literal["HWC", "CHW"] = "HWC"
    height: PositiveInt
    width: PositiveInt
    channels: PositiveInt = 3
    scale: PositiveFloat = 1.0 / 255.0
    mean: list[float] = Field(default_factory=lambda: [0.0])
    std: list[PositiveFloat] = Field(default_factory=lambda: [1.0])
    # What the source model returns: logits (a softmax is folded in) or probabilities (kept as they are).
    source_output: Literal["logits", "probabilities"] = "logits"

    @field_validator("mean", "std")
    @classmethod
    def _per_channel(cls, v: list[float], info: ValidationInfo) -> list[float]:
        c = info.data.get("channels")
        if c is not None and len(v) not in (1, c):
            raise ValueError(f"has {len(v)} values; give one per channel ({c}) or one for all")
        return v

    @property
    def shape(self) -> tuple[int, int, int]:
        """The wire shape of one image, in the declared layout."""
        if self.layout == "HWC":
            return (self.height, self.width, self.channels)
        return (self.channels, self.height, self.width)


class InputSpec(_Strict):
    """The input tensor: one float32 column per feature, in this order; or (image-classification) a uint8 image."""

    features: list[str] | None = Field(None, min_length=1)
    dtype: Literal["float32", "uint8"] = "float32"
    image: ImageSpec | None = None

    @field_validator("features")
    @classmethod
    def _unique(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        dup = sorted({f for f in v if v.count(f) > 1})
        if dup:
            raise ValueError(f"feature names must be unique; repeated: {', '.join(dup)}")
        return v


class ServingSpec(_Strict):
    """The load the model must serve: expected batch sizes (with weights) and a latency budget."""

    # Each at most scorestack.limits.MAX_ROWS_PER_REQUEST: the largest becomes max_batch_size, which is
    # Triton's own rows-per-request limit, so the server refuses what the clients refuse.
    batch_sizes: list[Annotated[int, Field(gt=0, le=limits.MAX_ROWS_PER_REQUEST)]] = Field(default_factory=lambda: [1, 64], min_length=1)
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
    max_batch_size: Annotated[int, Field(gt=0, le=limits.MAX_ROWS_PER_REQUEST)] | None = None
    # Serve several verified formats, each on the batch sizes where it was measured fastest
    # (compile/dispatch.py); false keeps one format for every batch size.
    dispatch: bool = True
    # Serve TL2cgen / tree-kernel artifacts through scorestack's native Triton backend (a C library
    # in the version folder, serve/native.py) instead of the Python backend; false: Python backend.
    native_backend: bool = True
    # Triton's queue policy: reject a request that waited in the queue past the budget's slack
    # (timeout_action REJECT, max_queue_size). On by default, and both settings cost something on
    # Triton 2.51 (benchmarks/results/queue_policy.md): with it, the batcher does not pre-fetch and,
    # when every instance is busy, can miss an instance's wake-up and hold requests ~500 ms, which
    # are then rejected; without it, overload queues until the callers' deadlines, and a burst of
    # cancelled calls crashed tritonserver's gRPC frontend (fixed in Triton 24.12, not in 2.51).
    queue_policy: bool = True
    # Triton's scheduling. "dynamic": the derived dynamic batching (with the queue policy above). "none": no
    # batcher, each request is its own execution on the instances that run at once (the batcher's hand-off
    # costs a lone request tens of µs; without it there is no queue policy either: Triton 2.51's belongs to
    # the batcher, so overload is bounded in the client, TritonClient(max_in_flight=...)). "auto": both are
    # measured side by side in the local Triton during the serving check, at one caller and at
    # `concurrency` callers, and no batching is emitted only when it is faster at one caller and no slower
    # at `concurrency` (the compile report shows both measurements).
    batching: Literal["dynamic", "none", "auto"] = "dynamic"
    # The concurrent callers the model is expected to see at peak (what "auto" measures besides one).
    concurrency: Annotated[int, Field(gt=0, le=1024)] = 64

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


class ChannelPruningSpec(_Strict):
    """Image models: remove the lowest-L1 convolution channels (layers rebuilt smaller), then fine-tune briefly."""

    enabled: bool = True
    keep_ratio: float = Field(default=0.5, gt=0, lt=1)  # share of each prunable layer's channels kept (rounded to a multiple of 8: vision_models.kept_channels)
    epochs: PositiveInt = 5
    learning_rate: PositiveFloat = 2e-3
    soft_weight: float = Field(default=0.5, ge=0, le=1)  # share of the unpruned model's softened outputs in the fine-tuning loss


class StudentSpec(_Strict):
    """Image models: train a smaller CNN (the project's SmallCNN) on the teacher's softened outputs plus the labels."""

    enabled: bool = True
    widths: list[PositiveInt] = Field(default_factory=lambda: [8, 16, 32], min_length=1)
    epochs: PositiveInt = 15
    learning_rate: PositiveFloat = 3e-3
    temperature: PositiveFloat = 4.0
    soft_weight: float = Field(default=0.7, ge=0, le=1)  # share of the teacher's softened outputs in the loss


class OptimizationSpec(_Strict):
    pruning: PruningSpec | None = None
    distillation: DistillationSpec | None = None
    channel_pruning: ChannelPruningSpec | None = None  # image-classification
    student: StudentSpec | None = None  # image-classification


# Relative tolerance per task when the spec gives none: a candidate passes where
# |candidate - source| <= tolerance + relative_tolerance * |source|. Regression and ranking scores
# can be in the hundreds, where float32 rounding alone exceeds an absolute 1e-5; probabilities lie in [0, 1].
DEFAULT_RELATIVE_TOLERANCE = {"regression": 1e-5, "ranking": 1e-5, "binary": 0.0, "multiclass": 0.0, "image-classification": 0.0}


class VerificationSpec(_Strict):
    tolerance: PositiveFloat = 1e-5  # absolute
    relative_tolerance: float | None = Field(default=None, ge=0)  # None: the task's default (DEFAULT_RELATIVE_TOLERANCE)
    sample_rows: PositiveInt = 256  # rows checked one at a time (batch 1)
    # image-classification: the largest accuracy drop (a fraction: 0.005 = 0.5 percentage points) on the
    # held-out images a lossy candidate (INT8, pruned, distilled) may have against the source model.
    accuracy_budget: float = Field(default=0.005, ge=0, le=1)


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
    # The longest one candidate's native build (TL2cgen's gcc) may take; a build estimated or found to
    # take longer is stopped and the candidate skipped, its estimate in the report (docs/compile.md).
    build_budget_s: PositiveFloat = 20.0
    # image-classification: .npz of uint8 images X (INT8 calibration; default: the first held-out images)
    # and of labelled training images X, y (fine-tuning after pruning, distillation).
    calibration: Path | None = None
    train_images: Path | None = None

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

    @field_validator("inputs")
    @classmethod
    def _inputs_match_task(cls, v: InputSpec, info: ValidationInfo) -> InputSpec:
        task = info.data.get("task")
        if task == "image-classification":
            if v.image is None:
                raise ValueError("an image-classification model needs `image:` (height, width, channels, layout, mean, std)")
            if v.features is not None:
                raise ValueError("an image-classification model takes `image:`, not `features:`")
        elif task is not None:
            if v.features is None:
                raise ValueError(f"a {task} model needs `features:` (the input feature names in column order)")
            if v.image is not None:
                raise ValueError(f"`image:` applies to image-classification models only (task is {task})")
        return v

    @field_validator("source")
    @classmethod
    def _module_for_torch(cls, v: SourceSpec) -> SourceSpec:
        if v.format == "torch-module" and v.module is None:
            raise ValueError("a torch-module source needs `module: package.module:ClassName` (the class the state dict belongs to)")
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
        """Input values per row: features, or pixels of one image."""
        if self.inputs.image is not None:
            h, w, c = self.inputs.image.height, self.inputs.image.width, self.inputs.image.channels
            return h * w * c
        return len(self.inputs.features or [])

    @property
    def is_vision(self) -> bool:
        return self.task == "image-classification"

    @property
    def relative_tolerance(self) -> float:
        """The relative tolerance verification uses: the spec's, or the task's default."""
        given = self.verification.relative_tolerance
        return DEFAULT_RELATIVE_TOLERANCE.get(self.task, 0.0) if given is None else given


# Field-specific advice appended to validation messages: the fix, not just the fault.
_FIXES = {
    "verification.tolerance": "set a positive number such as 1e-5",
    "verification.relative_tolerance": "set a number >= 0 such as 1e-5 (|Δ| may be tolerance + relative_tolerance * |source|), or omit it for the task's default",
    "verification.sample_rows": "set a positive row count such as 256",
    "source.format": "use one of xgboost-json, xgboost-ubj, lightgbm-text, joblib, pickle (tabular), torch-module, torchscript, onnx-model (image models)",
    "source.module": "name the model class as package.module:ClassName (importable in this environment)",
    "inputs.image": "describe the image: height, width, channels, layout (HWC or CHW), mean and std per channel",
    "calibration": "give a .npz file with uint8 images X, or omit it to calibrate on held-out images",
    "train_images": "give a .npz file with uint8 images X and labels y",
    "verification.accuracy_budget": "give the largest accuracy drop allowed as a fraction, such as 0.005 (0.5 points)",
    "source.path": "give the model file's path, relative to the spec file",
    "source.trusted": "write `trusted: true` only for files you produced yourself",
    "task": "use one of binary, multiclass, regression, ranking, image-classification",
    "name": "use letters, digits, '_', '-' or '.', starting with a letter or digit",
    "inputs.features": "list the model's input feature names in column order",
    "inputs.dtype": "features are float32 and images uint8; write `dtype: float32` or `dtype: uint8`",
    "outputs": "omit `outputs` to use the task's standard tensor name",
    "serving.latency_budget_ms": "set the per-request budget in milliseconds, such as 5",
    "serving.batch_sizes": "list the batch sizes you expect, such as [1, 64], each at most scorestack.limits.MAX_ROWS_PER_REQUEST (4096)",
    "serving.batch_weights": "give one positive weight per batch size, or omit it",
    "serving.decision_threshold": "give a probability in [0, 1] (binary models only), or omit it for 0.5",
    "serving.keep_versions": "give how many model versions to keep and serve, such as 2",
    "serving.max_batch_size": "give the largest batch Triton may execute (at least the largest of batch_sizes, at most 4096), or omit it",
    "serving.dispatch": "write true (serve the fastest format per batch size) or false (one format for all)",
    "threads": "give a thread count such as 1, or a list such as [1, 2]",
    "holdout": "give a .npz file with arrays X and y (and group for ranking)",
    "formats": "use some of onnx, onnx-int8, native, tl2cgen, trees, linear, hummingbird, tensorrt, tensorrt-int8, onnx-tensorrt",
    "target": "use cpu or gpu",
    "build_budget_s": "give the seconds one candidate's native build may take, such as 60",
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
    for key in ("calibration", "train_images"):
        if getattr(spec, key) is not None:
            updates[key] = _resolve(base_dir, getattr(spec, key))
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
