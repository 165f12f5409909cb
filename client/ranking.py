"""The ranking request path: one user and hundreds of candidates in, candidates ordered by score out."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from scorestack import limits, schema
from scorestack.client.requests import ScoringPath, numeric_fields, record
from scorestack.client.metrics import RequestMetrics
from scorestack.client.timing import PhaseTimer
from scorestack.client.triton import TritonClient
from scorestack.errors import InferenceError, InputValidationError, RequestValidationError
from scorestack.features.fetch import FeatureFetcher

DEFAULT_MAX_CANDIDATES = limits.MAX_CANDIDATES


@dataclass(frozen=True)
class RankedList:
    item_ids: list[int | str]  # best first (ints or strings, as the item join key is typed)
    scores: np.ndarray  # float32, aligned with item_ids
    degraded: bool
    degraded_reason: str | None
    chunks: int  # Triton calls made (concurrently)
    timings_ms: dict[str, float]  # validate, features, assemble, infer, total


class RankingService(ScoringPath):
    """Ranks candidates for a user: user and item features in one concurrent fetch, batched inference.

    Lists longer than `chunk_size` (default: the model's max_batch_size) are split into chunks that
    Triton scores concurrently. `benchmarks/bench_e2e.py` measures chunk plans: on 2 cores
    the largest chunk the model accepts was fastest (1000 candidates: 5.4 ms p50 in chunks of 200
    against 8.7 ms in chunks of 50, and fewer queue-timeout rejections), so smaller chunks are
    opt-in for machines with more cores.

    At most `max_in_flight` chunks of one request are in Triton at once; 0 sends every chunk at once.
    The default (None), for a model with a queue timeout, is one less than its instance count (read
    from its config), at least 1: a chunk is sent when an instance is free, so a request's own chunks
    do not wait in Triton's queue behind one another (sent all at once, the last chunks of 1000-2000
    candidates ran out of the queue timeout: 1-17 of 30 requests rejected at concurrency 1), and one
    instance is always left waiting: Triton 2.51's batcher hands work only to a waiting instance and
    is not woken by one going idle, so with every instance busy on this request's chunks the next
    chunk could wait for its 500 ms timer and be rejected (2 of 80 requests of 1000 candidates with
    one chunk per instance in flight, Triton on one core; benchmarks/results/request_path_0439.md). A model
    without a queue policy (`serving.queue_policy: false`) rejects nothing for time and its batcher
    pre-fetches: every chunk goes at once.
    """

    request_fields: tuple[str, ...] = schema.RANKING_REQUEST  # the request's `context`

    def __init__(
        self,
        triton: TritonClient,
        fetcher: FeatureFetcher,
        *,
        model: str = "ranking_xgb",
        feature_names: Sequence[str] = schema.RANKING_FEATURES,
        feature_service: str = "ranking",
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        chunk_size: int | None = None,
        max_in_flight: int | None = None,
        deadline_s: float | None = None,
        metrics: RequestMetrics | None = None,
    ) -> None:
        if max_candidates > limits.MAX_CANDIDATES:
            raise RequestValidationError(
                "max_candidates", f"{max_candidates} exceeds scorestack.limits.MAX_CANDIDATES ({limits.MAX_CANDIDATES}); raise it there"
            )
        super().__init__(triton, fetcher, model=model, feature_names=feature_names, feature_service=feature_service, deadline_s=deadline_s, metrics=metrics)
        if chunk_size is not None and chunk_size < 1:
            raise RequestValidationError("chunk_size", f"must be >= 1 (or None: the model's max_batch_size), got {chunk_size}")
        if max_in_flight is not None and max_in_flight < 0:
            raise RequestValidationError("max_in_flight", f"must be >= 0 (0: every chunk at once; None: one less than the model's instance count, or every chunk where it has no queue timeout), got {max_in_flight}")
        self.max_candidates = max_candidates
        self.chunk_size = chunk_size
        self.max_in_flight = max_in_flight

    def _validate_candidates(self, candidate_ids: Any) -> list[int | str]:
        if isinstance(candidate_ids, (str, bytes)) or not isinstance(candidate_ids, Sequence | np.ndarray):
            raise InputValidationError("candidate_ids", f"must be a list of item ids, got {type(candidate_ids).__name__}")
        n = len(candidate_ids)
        if n == 0:
            raise InputValidationError("candidate_ids", "empty; send at least one candidate")
        if n > self.max_candidates:
            raise InputValidationError("candidate_ids", f"{n} candidates exceed the limit of {self.max_candidates}; split the request")
        ids = self.entity_ids(candidate_ids, "item_id", "candidate_ids")
        if len(set(ids)) != n:
            seen: set[int | str] = set()
            dup = next(i for i in ids if i in seen or seen.add(i))
            raise InputValidationError("candidate_ids", f"duplicate item id {dup!r}; send each candidate once")
        return ids

    async def rank(self, user_id: Any, candidate_ids: Any, context: Mapping[str, Any]) -> RankedList:
        timer = PhaseTimer()
        with timer.phase("validate"):
            user = self.entity_id(user_id, "user_id")
            items = self._validate_candidates(candidate_ids)
            fetch = asyncio.ensure_future(self.fetcher.fetch(self.feature_service, {"user_id": user, "item_id": items}))
            try:
                ctx = numeric_fields(record(context, self.request_fields, name="context"), self.request_fields, "context.")
            except BaseException:
                fetch.cancel()
                raise
        features, batch = await self._features_matrix(timer, fetch, ctx)
        n = len(items)
        with timer.phase("infer"):
            info = await self.triton.model_info(self.model, deadline_s=self.deadline_s)
            size = min(self.chunk_size or n, info.max_batch_size or n)
            chunks = [batch[i : i + size] for i in range(0, n, size)]
            window = self.default_window(info) if self.max_in_flight is None else self.max_in_flight
            results = await self._infer_chunks(chunks, window if 0 < window < len(chunks) else len(chunks))
            scores = np.concatenate([r.outputs[schema.OUTPUT_TENSORS["ranking"]].reshape(-1) for r in results])
        order = np.argsort(-scores, kind="stable")
        return RankedList(
            item_ids=[items[i] for i in order],
            scores=scores[order],
            degraded=features.degraded,
            degraded_reason=features.reason,
            chunks=len(chunks),
            timings_ms=self._finish(timer),
        )

    @staticmethod
    def default_window(info) -> int:
        """Chunks in flight by default: one less than the model's instances (at least 1), so one instance is always
        waiting for the batcher; 0 (every chunk at once) when the model has no queue timeout."""
        return max(1, info.instances - 1) if info.queue_timeout_us > 0 else 0

    async def _infer_chunks(self, chunks: list[np.ndarray], window: int) -> list:
        """Score the chunks with at most `window` of them in Triton at once; results in chunk order."""
        if window >= len(chunks):
            return await asyncio.gather(*(self.triton.infer(self.model, {schema.INPUT_TENSOR: c}, deadline_s=self.deadline_s) for c in chunks))
        results: list = [None] * len(chunks)
        position = iter(range(len(chunks)))
        # One deadline for the whole request, as when every chunk is sent at once.
        end = time.monotonic() + (self.deadline_s or self.triton.deadline_s)

        async def lane() -> None:
            # Each lane takes the next chunk when its previous one came back: `window` chunks in flight.
            for i in position:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise InferenceError(f"model {self.model!r}: deadline exceeded after {i} of {len(chunks)} chunks")
                results[i] = await self.triton.infer(self.model, {schema.INPUT_TENSOR: chunks[i]}, deadline_s=remaining)

        lanes = [asyncio.ensure_future(lane()) for _ in range(window)]
        try:
            await asyncio.gather(*lanes)
        except BaseException:
            for task in lanes:  # the request failed: its other chunks are not sent
                task.cancel()
            raise
        return results
