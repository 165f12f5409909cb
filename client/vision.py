"""The vision request path: raw uint8 images in, classes and probabilities out over gRPC, with phase timings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from scorestack import schema
from scorestack.client.metrics import RequestMetrics
from scorestack.client.timing import PhaseTimer
from scorestack.client.triton import TritonClient
from scorestack.errors import RequestValidationError


@dataclass(frozen=True)
class Classification:
    classes: np.ndarray  # int64 [n]: the top class of each image
    probabilities: np.ndarray  # float32 [n, n_classes]
    requests: int  # gRPC requests sent (a batch over max_batch_size is split)
    attempts: int  # including retries of UNAVAILABLE
    timings_ms: dict[str, float]  # validate, infer, decode, total


class VisionService:
    """Classifies images with a compiled image model served by Triton.

    Images travel as the raw uint8 pixels the model's contract declares (`images`, [H, W, C] or
    [C, H, W] per image); scaling and normalization run inside the served graph, so a request
    carries a quarter of the bytes float32 would. Deadlines and retries are the TritonClient's:
    every request gets the remaining deadline (also Triton's queue timeout), and only UNAVAILABLE
    is retried, with backoff, inside it.

    With `metrics` (a `RequestMetrics`), each request's phases are observed into its exported
    histograms, as on the fraud and ranking paths, for `scorestack diagnose --client-metrics`.
    """

    def __init__(
        self, triton: TritonClient, *, model: str = "digits_cnn", deadline_s: float | None = None, metrics: RequestMetrics | None = None
    ) -> None:
        self.triton = triton
        self.model = model
        self.deadline_s = deadline_s
        self.metrics = metrics  # per-phase histograms for `scorestack diagnose --client-metrics`

    async def classify(self, images: np.ndarray) -> Classification:
        """`images`: uint8 [n, *image shape] or one image [*image shape]."""
        timer = PhaseTimer()
        with timer.phase("validate"):
            info = await self.triton.model_info(self.model, deadline_s=self.deadline_s)
            shape = _image_shape(info)
            batch = _as_batch(images, shape)
            step = info.max_batch_size or len(batch)
            chunks = [batch[i : i + step] for i in range(0, len(batch), step)]
        with timer.phase("infer"):
            results = await asyncio.gather(
                *(self.triton.infer(self.model, {schema.IMAGE_INPUT_TENSOR: c}, deadline_s=self.deadline_s) for c in chunks)
            )
        with timer.phase("decode"):
            out = schema.OUTPUT_TENSORS["image-classification"]
            probabilities = np.concatenate([r.outputs[out].reshape(len(c), -1) for r, c in zip(results, chunks)])
            classes = probabilities.argmax(1).astype(np.int64)
        timings = timer.finish()
        if self.metrics is not None:
            self.metrics.observe(timings)
        return Classification(classes, probabilities, len(chunks), sum(r.attempts for r in results), timings)


def _image_shape(info) -> tuple[int, ...]:
    for t in info.inputs:
        if t.name == schema.IMAGE_INPUT_TENSOR:
            if t.datatype != "UINT8":
                raise RequestValidationError("model", f"model {info.name!r} takes {t.datatype} images; the vision path sends UINT8 pixels")
            return tuple(t.shape[1:] if info.max_batch_size else t.shape)
    raise RequestValidationError("model", f"model {info.name!r} has no {schema.IMAGE_INPUT_TENSOR!r} input (inputs: {[t.name for t in info.inputs]}); is it an image model?")


def _as_batch(images: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(images, np.ndarray):
        raise RequestValidationError("images", f"must be a numpy array of uint8 pixels, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise RequestValidationError("images", f"dtype {images.dtype}: send raw uint8 pixels (0-255) as the model declares; convert with np.clip(x, 0, 255).astype(np.uint8)")
    if images.shape == shape:
        images = images[None]
    if images.ndim != len(shape) + 1 or tuple(images.shape[1:]) != shape or len(images) == 0:
        raise RequestValidationError("images", f"shape {list(images.shape)}: the model takes images of shape {list(shape)} (one image, or [n, {', '.join(map(str, shape))}])")
    return np.ascontiguousarray(images)
