"""Lossy passes for image models: structured channel pruning (layers rebuilt smaller) and distillation to a
smaller CNN, each kept as a candidate variant only within the spec's accuracy budget on the held-out images.

Each pass returns the model it built (None when it could not build one) and its report; the report's
`accepted` says whether the model stays within the budget, and only then does the compiler use it.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from .model import Holdout
from .report import PassReport
from .spec import ChannelPruningSpec, StudentSpec
from .verify import accuracy
from .vision import ONNX, TORCH, Images, VisionSource, to_float


def _train_data(source: VisionSource, train: Images):  # -> TrainData
    import torch

    from .vision_models import TrainData

    return TrainData(to_float(source.image, train.X), torch.from_numpy(train.y))


def teacher_logits(source: VisionSource):  # -> Callable[[torch.Tensor], torch.Tensor]
    """The source model as a teacher: preprocessed float32 images -> logits (log-probabilities when it returns probabilities)."""
    import torch

    if source.family == ONNX:
        import onnxruntime as ort

        session = ort.InferenceSession(source.model.SerializeToString(), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.asarray(session.run(None, {name: x.numpy()})[0], dtype=np.float32))
    else:
        model = source.model

        def run(x: torch.Tensor) -> torch.Tensor:
            return model(x)

    if source.image.source_output == "probabilities":
        return lambda x: torch.log(torch.clamp(run(x), min=1e-12))  # a softmax of log p is p again
    return run


def parameters(model: Any) -> int | None:
    """Trainable parameters of a torch module (None for a TorchScript or ONNX source)."""
    from .vision_models import n_parameters

    try:
        return n_parameters(model)
    except AttributeError:
        return None


def prune_channels(
    source: VisionSource, holdout: Holdout, train: Images | None, spec: ChannelPruningSpec, budget: float, threads: int
) -> tuple[VisionSource | None, PassReport]:
    """Rank each prunable conv's output channels by L1 norm, rebuild the model with the top `keep_ratio`, fine-tune, check the budget."""
    report = PassReport(name="channel_pruning", accepted=False, reason="", metric="accuracy", quality_budget=budget)
    if source.family != TORCH or not hasattr(source.model, "prune_channels"):
        report.reason = (
            f"{source.description} does not define prune_channels(keep_ratio) (the project's SmallCNN and SmallResNet do): "
            "structured pruning rebuilds layers, which needs the model's own structure"
        )
        return None, report
    if train is None or train.y is None:
        report.reason = "fine-tuning after pruning needs labelled training images: set `train_images` in the spec"
        return None, report
    if holdout.y is None:
        report.reason = "held-out images have no labels (y): accuracy cannot be measured"
        return None, report
    src_acc = accuracy(source.predict(holdout.X), holdout.y)
    t0 = time.perf_counter()
    small = copy.deepcopy(source.model).prune_channels(spec.keep_ratio).eval()
    pruned = VisionSource(
        source.name, source.task, TORCH, small, source.n_features, source.n_classes, None,
        f"{type(small).__name__}({', '.join(f'{k}={v}' for k, v in small.config().items())}), {parameters(small):,} parameters",
        [*source.history, f"channels pruned to {spec.keep_ratio:.0%} by L1 norm, fine-tuned {spec.epochs} epochs"], image=source.image,
    )
    before_ft = accuracy(pruned.predict(holdout.X), holdout.y)
    from .vision_models import train as train_model

    # Fine-tuned on the labels and on the unpruned model's outputs: the pruned network relearns what it lost from its own source.
    train_model(small, _train_data(source, train), spec.epochs, spec.learning_rate, teacher=teacher_logits(source), soft_weight=spec.soft_weight, threads=threads)
    acc = accuracy(pruned.predict(holdout.X), holdout.y)
    drop = src_acc - acc
    report.source_quality, report.result_quality, report.quality_drop = src_acc, acc, drop
    report.details = {
        "parameters_before": parameters(source.model),
        "parameters_after": parameters(small),
        "architecture_after": small.config(),
        "accuracy_before_fine_tune": before_ft,
        "fine_tune_s": round(time.perf_counter() - t0, 2),
    }
    report.accepted = drop <= budget + 1e-12
    verdict = "within" if report.accepted else "exceeds"
    report.reason = f"accuracy {src_acc:.2%} -> {acc:.2%} (drop {100 * drop:.2f} points {verdict} the budget {100 * budget:.2f}); {parameters(source.model):,} -> {parameters(small):,} parameters"
    return pruned, report


def distill_student(
    teacher: VisionSource, holdout: Holdout, train: Images | None, spec: StudentSpec, budget: float, threads: int
) -> tuple[VisionSource | None, PassReport]:
    """Train the project's SmallCNN with `spec.widths` on the teacher's softened outputs plus the labels; keep it within the budget."""
    from .vision_models import SmallCNN
    from .vision_models import train as train_model

    report = PassReport(name="distillation", accepted=False, reason="", metric="accuracy", quality_budget=budget)
    if train is None or train.y is None:
        report.reason = "distillation needs labelled training images: set `train_images` in the spec"
        return None, report
    if holdout.y is None:
        report.reason = "held-out images have no labels (y): accuracy cannot be measured"
        return None, report
    t0 = time.perf_counter()
    image = teacher.image.model_copy(update={"source_output": "logits"})
    student = SmallCNN(int(teacher.n_classes or 0), image.channels, spec.widths)
    train_model(
        student, _train_data(teacher, train), spec.epochs, spec.learning_rate, teacher=teacher_logits(teacher),
        temperature=spec.temperature, soft_weight=spec.soft_weight, threads=threads,
    )
    distilled = VisionSource(
        teacher.name, teacher.task, TORCH, student.eval(), teacher.n_features, teacher.n_classes, None,
        f"SmallCNN(widths={list(spec.widths)}) student, {parameters(student):,} parameters",
        [*teacher.history, f"distilled (T={spec.temperature:g}, soft weight {spec.soft_weight:g}, {spec.epochs} epochs)"], image=image,
    )
    t_acc = accuracy(teacher.predict(holdout.X), holdout.y)
    s_acc = accuracy(distilled.predict(holdout.X), holdout.y)
    drop = t_acc - s_acc
    report.source_quality, report.result_quality, report.quality_drop = t_acc, s_acc, drop
    report.details = {
        "teacher_parameters": parameters(teacher.model),
        "student_parameters": parameters(student),
        "train_s": round(time.perf_counter() - t0, 2),
    }
    report.accepted = drop <= budget + 1e-12
    verdict = "within" if report.accepted else "exceeds"
    report.reason = f"student accuracy {s_acc:.2%} vs teacher {t_acc:.2%} (drop {100 * drop:.2f} points {verdict} the budget {100 * budget:.2f})"
    return distilled, report
