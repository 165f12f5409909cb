"""The fraud request path: one transaction in, a probability and a decision out, with phase timings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from scorestack import schema
from scorestack.client.requests import ScoringPath, numeric_fields, record
from scorestack.client.metrics import RequestMetrics
from scorestack.client.timing import PhaseTimer
from scorestack.client.triton import TritonClient
from scorestack.errors import InputValidationError, RequestValidationError
from scorestack.features.fetch import FeatureFetcher, FeatureStatus
from scorestack.features.push import CounterUpdate, FeatureWriter
from scorestack.features.velocity import AsyncVelocityWriter
from scorestack.serve.runtime.scorestack_runtime import PARAM_DECISION_THRESHOLD


DEFAULT_THRESHOLD = 0.5
# Status code -> name, once: an enum lookup per feature cost ~2 µs each on every request.
_STATUS_NAMES = {int(s): s.name.lower() for s in FeatureStatus}

# The fraud feature definitions' velocity counters, moved by each scored transaction (features/repo/definitions.py).
VELOCITY_UPDATE = CounterUpdate(
    push_source="user_txn_velocity_push",
    key="user_id",
    features=schema.FRAUD_USER_VELOCITY,
    increments={"txn_count_1h": None, "txn_count_24h": None, "amount_sum_1h": "amount", "amount_sum_24h": "amount"},
)


@dataclass(frozen=True)
class FraudScore:
    probability: float
    decision: bool  # probability >= threshold: hold or review the payment
    threshold: float
    degraded: bool  # some store features were defaults (store slow or down)
    degraded_reason: str | None
    features: np.ndarray  # float32 [n_features], the vector that was scored, in model order
    feature_status: dict[str, str]  # per store feature: present / missing / stale / defaulted
    timings_ms: dict[str, float]  # validate, features, assemble, infer, total


class FraudService(ScoringPath):
    """Scores one transaction: features fetched first, request fields validated meanwhile, one Triton call.

    `transaction` is a mapping with `user_id` and every field of `schema.FRAUD_REQUEST`. The
    decision threshold is the spec's `serving.decision_threshold`, which the compiler wrote into the
    served model's config (`PARAM_DECISION_THRESHOLD`); pass `threshold` to override it.

    With a `writer`, each scored transaction moves its user's velocity counters (`counter_update`,
    default: transactions in the last hour/day +1, amount in the last hour/day + amount) through
    Feast's push API in the background: the score never waits for it, and the next fetch of that
    user sees it. Counters not read fresh are not written back (counted as `skipped`).

    With `velocity` (an AsyncVelocityWriter; pair it with a fetcher built with `windows=True`),
    each scored transaction is instead added atomically to its user's windowed counters, in the
    bucket of its time: exact under any number of replicas, and events age out of their window.
    Its id is the transaction's `transaction_id` when it has one (a retried request then counts
    once), else a fresh one. It takes precedence over `writer`.
    """

    request_fields: tuple[str, ...] = schema.FRAUD_REQUEST

    def __init__(
        self,
        triton: TritonClient,
        fetcher: FeatureFetcher,
        *,
        model: str = "fraud_xgb",
        threshold: float | None = None,
        feature_names: Sequence[str] = schema.FRAUD_FEATURES,
        feature_service: str = "fraud",
        deadline_s: float | None = None,
        writer: FeatureWriter | None = None,
        counter_update: CounterUpdate | None = VELOCITY_UPDATE,
        metrics: RequestMetrics | None = None,
        velocity: AsyncVelocityWriter | None = None,
    ) -> None:
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise RequestValidationError("threshold", f"must be within [0, 1], got {threshold}")
        super().__init__(triton, fetcher, model=model, feature_names=feature_names, feature_service=feature_service, deadline_s=deadline_s, metrics=metrics)
        self.threshold = threshold
        self.velocity = velocity
        self.writer = writer if velocity is None else None
        self.counter_update = counter_update if self.writer is not None else None
        if self.counter_update is not None:
            missing = sorted(set(self.counter_update.features) - set(fetcher.feature_names(feature_service)))
            if missing:
                raise RequestValidationError("counter_update", f"features {missing} are not in feature service {feature_service!r}")
            self._counter_cols = [self.feature_names.index(f) for f in self.counter_update.features]

    async def score(self, transaction: Mapping[str, Any]) -> FraudScore:
        timer = PhaseTimer()
        with timer.phase("validate"):
            if not isinstance(transaction, Mapping):
                raise InputValidationError("transaction", f"must be a mapping of field -> value, got {type(transaction).__name__}")
            if "user_id" not in transaction:
                raise InputValidationError("user_id", "missing; every transaction names its user")
            user = self.entity_id(transaction["user_id"], "user_id")
            # The fetch starts before the rest is validated, so store I/O overlaps the CPU work.
            fetch = asyncio.ensure_future(self.fetcher.fetch(self.feature_service, {"user_id": user}))
            try:
                # transaction_id, optional: the velocity counters' event id (a retried transaction counts once).
                record(transaction, ("user_id", *self.request_fields), name="", allowed=("transaction_id",))
                event_id = transaction.get("transaction_id")
                if event_id is not None and (isinstance(event_id, bool) or not isinstance(event_id, (str, int)) or event_id == ""):
                    raise InputValidationError("transaction_id", f"must be a non-empty string or an integer, got {event_id!r}")
                request_values = numeric_fields(transaction, self.request_fields)
            except BaseException:
                fetch.cancel()
                raise
        features, vector = await self._features_matrix(timer, fetch, request_values)
        unwritten = None
        if self.counter_update is not None:
            # This user's previous transaction may still be on its way to the store: score with it.
            unwritten = self.writer.unwritten(self.counter_update.push_source, user)
            if unwritten is not None:
                vector[0, self._counter_cols] = [float(unwritten[f][0]) for f in self.counter_update.features]
        with timer.phase("infer"):
            result = await self.triton.infer(self.model, {schema.INPUT_TENSOR: vector}, deadline_s=self.deadline_s)
        probability = float(result.outputs[schema.OUTPUT_TENSORS["binary"]].reshape(-1)[0])
        threshold = self.threshold if self.threshold is not None else await self._served_threshold()
        if self.velocity is not None:
            self.velocity.submit(user, transaction, event_id=None if event_id is None else str(event_id))
        elif self.counter_update is not None:
            self._write_back(user, features, transaction, unwritten)
        return FraudScore(
            probability=probability,
            decision=probability >= threshold,
            threshold=threshold,
            degraded=features.degraded,
            degraded_reason=features.reason,
            features=vector[0],
            feature_status=dict(zip(features.feature_names, [_STATUS_NAMES[s] for s in features.status[0].tolist()])),
            timings_ms=self._finish(timer),
        )

    def _write_back(self, user: int | str, features, transaction: Mapping[str, Any], unwritten) -> None:
        """Queue the counters' update (returns at once; the push runs in the writer's background)."""
        update, writer = self.counter_update, self.writer
        row = update.row(user, features, transaction, unwritten=unwritten)
        if row is None:
            writer.skip(update.push_source)
        else:
            writer.submit(update.push_source, row, entity=user)

    async def _served_threshold(self) -> float:
        """The served model's decision threshold (metadata is cached by the client: no extra call)."""
        info = await self.triton.model_info(self.model, deadline_s=self.deadline_s)
        raw = info.parameters.get(PARAM_DECISION_THRESHOLD, "")
        return float(raw) if raw.strip() else DEFAULT_THRESHOLD
