"""Validation of fraud and ranking requests at the edge: every error names the field and the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

from typing import TYPE_CHECKING

import numpy as np

from scorestack.errors import RequestValidationError

if TYPE_CHECKING:
    import asyncio

    from scorestack.client.timing import PhaseTimer
    from scorestack.client.triton import TritonClient
    from scorestack.features.fetch import FeatureFetcher

_INT64_MAX = 2**63 - 1


def entity_id(value: Any, field: str) -> int:
    """A positive int64 entity id (bools and floats are refused: an id is not a measurement)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestValidationError(field, f"must be an integer id, got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 < value <= _INT64_MAX:
        raise RequestValidationError(field, f"must be a positive int64 id, got {value}")
    return value


def number(value: Any, field: str) -> float:
    """A finite real number; bools count as 0/1 for flag fields."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise RequestValidationError(field, f"must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise RequestValidationError(field, f"must be finite, got {value}; send a real value (NaN and infinity are not allowed)")
    if abs(value) > 3.4e38:
        raise RequestValidationError(field, f"{value} does not fit float32")
    return value


def record(payload: Any, required: Sequence[str], *, name: str, allowed: Sequence[str] = ()) -> dict[str, Any]:
    """Check that `payload` is a mapping with exactly the `required` (+ `allowed`) keys."""
    if not isinstance(payload, Mapping):
        raise RequestValidationError(name, f"must be a mapping of field -> value, got {type(payload).__name__}")
    missing = [f for f in required if f not in payload]
    if missing:
        raise RequestValidationError(f"{name}.{missing[0]}" if name else missing[0], f"missing; required fields: {', '.join(missing)}")
    known = set(required) | set(allowed)
    unknown = sorted(str(k) for k in payload if k not in known)
    if unknown:
        raise RequestValidationError(f"{name}.{unknown[0]}" if name else unknown[0], f"unknown field; expected only {', '.join(sorted(known))}")
    return dict(payload)


def numeric_fields(payload: Mapping[str, Any], fields: Sequence[str], prefix: str = "") -> np.ndarray:
    return np.array([number(payload[f], f"{prefix}{f}") for f in fields], dtype=np.float32)


def column_plan(model_features: Sequence[str], store_features: Sequence[str], request_fields: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the store features and of the request fields in the model's feature order.

    The model's features must be exactly the store's plus the request's, each once.
    """
    position = {n: i for i, n in enumerate(model_features)}
    unknown = [n for n in (*store_features, *request_fields) if n not in position]
    if unknown or len(store_features) + len(request_fields) != len(model_features):
        missing = sorted(set(model_features) - set(store_features) - set(request_fields))
        raise RequestValidationError(
            "feature_names",
            f"model features must be the feature service's plus the request's fields; not in the model: {unknown}; "
            f"in the model but provided by neither: {missing}",
        )
    return (
        np.array([position[n] for n in store_features], dtype=np.intp),
        np.array([position[n] for n in request_fields], dtype=np.intp),
    )


class ScoringPath:
    """What the fraud and ranking paths share: the Triton client, the feature fetcher, and where the
    store's features and the request's fields go in the model's feature order."""

    request_fields: tuple[str, ...] = ()

    def __init__(
        self,
        triton: "TritonClient",
        fetcher: "FeatureFetcher",
        *,
        model: str,
        feature_names: Sequence[str],
        feature_service: str,
        deadline_s: float | None,
    ) -> None:
        self.triton = triton
        self.fetcher = fetcher
        self.model = model
        self.feature_service = feature_service
        self.deadline_s = deadline_s
        self.feature_names = tuple(feature_names)
        self._store_cols, self._request_cols = column_plan(self.feature_names, fetcher.feature_names(feature_service), self.request_fields)

    async def _features_matrix(self, timer: "PhaseTimer", fetch: "asyncio.Future", request_values: np.ndarray):
        """Wait for the fetch (phase `features_wait`; the fetch's own time is `features`), then
        assemble the model's input: store features and request fields in the model's order."""
        with timer.phase("features_wait"):
            features = await fetch
        timer.set("features", features.timings.total_s * 1e3)
        with timer.phase("assemble"):
            matrix = np.empty((len(features.values), len(self.feature_names)), dtype=np.float32)
            matrix[:, self._store_cols] = features.values
            matrix[:, self._request_cols] = request_values
        return features, matrix
