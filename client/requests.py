"""What the fraud and ranking request paths share: the scoring base class and where features go.

Input validation lives in one module for the fetch layer and the request paths alike
(`scorestack.validation`); its functions are re-exported here for the paths' convenience.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from scorestack.errors import RequestValidationError
from scorestack.validation import entity_id, entity_ids, number, numeric_fields, record

if TYPE_CHECKING:
    import asyncio

    from scorestack.client.timing import PhaseTimer
    from scorestack.client.metrics import RequestMetrics
    from scorestack.client.triton import TritonClient
    from scorestack.features.fetch import FeatureFetcher

__all__ = ["ScoringPath", "column_plan", "entity_id", "number", "numeric_fields", "record"]


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
        metrics: "RequestMetrics | None" = None,
    ) -> None:
        self.triton = triton
        self.metrics = metrics  # per-phase histograms for `scorestack diagnose --client-metrics`
        self.fetcher = fetcher
        self.model = model
        self.feature_service = feature_service
        self.deadline_s = deadline_s
        self.feature_names = tuple(feature_names)
        self._store_cols, self._request_cols = column_plan(self.feature_names, fetcher.feature_names(feature_service), self.request_fields)
        # The join keys' Feast types decide what an id may be (scorestack.validation.entity_id).
        self.key_types: dict[str, str] = {k: t for k, t in fetcher.inputs(feature_service).items()}

    def _finish(self, timer: "PhaseTimer") -> dict[str, float]:
        """The request's phase timings, also observed into the exported histograms when there are any."""
        timings = timer.finish()
        if self.metrics is not None:
            self.metrics.observe(timings)
        return timings

    def entity_id(self, value: Any, key: str, field: str | None = None) -> int | str:
        """`value` checked as an id of join key `key` of the feature service (one rule everywhere)."""
        return entity_id(value, field or key, self.key_types.get(key, "Int64"))

    def entity_ids(self, values: Any, key: str, field: str) -> list[int | str]:
        """`entity_id` over a list (or array) of ids, the offender named `field[i]`."""
        return entity_ids(values.tolist() if isinstance(values, np.ndarray) else values, field, self.key_types.get(key, "Int64"))

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
