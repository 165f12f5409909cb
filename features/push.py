"""Real-time features written back through Feast's push API, off the request's critical path.

`FeatureWriter.submit(push_source, row)` returns at once; the push runs in one background worker
thread (Feast's `push` is synchronous on SQLite, and one thread keeps a user's pushes in order),
bounded by a timeout and a queue limit. Every outcome is counted: pushed, failed, timed out, or
dropped because the queue was full; nothing is lost silently.

`CounterUpdate` says how one scored event moves a view's counters (e.g. the fraud path's
transactions in the last hour and amount in the last day): the new row is the values just fetched
plus this event, written with the event's time, so the next fetch of that entity sees it and the
view's ttl reports it stale like any stored value.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from scorestack.errors import FeatureError
from scorestack.features.results import FeatureResult, FeatureStatus

if TYPE_CHECKING:
    import feast
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)
OUTCOMES = ("pushed", "failed", "timeout", "dropped", "skipped")


@dataclass(frozen=True)
class CounterUpdate:
    """How one event updates the counters of one view, read from the fetch that scored it.

    Args:
        push_source: the Feast PushSource that feeds the view.
        key: the view's join key (the entity the event belongs to).
        features: every feature of the view, as the fetch returned them (Feast's push writes whole rows).
        increments: feature -> the event field added to it, or None to add 1 (a count).
    """

    push_source: str
    key: str
    features: tuple[str, ...]
    increments: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.increments) - set(self.features))
        if unknown:
            raise FeatureError(f"increments: {unknown} are not among the view's features {list(self.features)}")

    def row(
        self,
        entity: Any,
        fetched: FeatureResult,
        event: Mapping[str, Any],
        now: datetime | None = None,
        unwritten: Mapping[str, list] | None = None,
    ) -> dict[str, Any] | None:
        """The view's new row after `event`, or None when the fetch did not read current counters.

        Counters that were not read fresh (missing, stale past the view's ttl, or defaulted because
        the store was slow) are not a base to add to: writing them back would store a guess as fact.
        `unwritten`, a row of this entity still on its way to the store (`FeatureWriter.unwritten`),
        is the base instead: it is newer than anything the fetch could have read.
        """
        if unwritten is not None:
            values = np.array([float(unwritten[f][0]) for f in self.features], dtype=np.float64)
        else:
            position = {name: i for i, name in enumerate(fetched.feature_names)}
            missing = [f for f in self.features if f not in position]
            if missing:
                raise FeatureError(f"features: {missing} are not in feature service {fetched.service!r}'s result")
            columns = [position[f] for f in self.features]
            if not (fetched.status[0, columns] == FeatureStatus.PRESENT).all():
                return None
            values = fetched.values[0, columns].astype(np.float64)
        row: dict[str, Any] = {self.key: [entity]}
        for name, value in zip(self.features, values.tolist()):
            if name in self.increments:
                source = self.increments[name]
                value += 1.0 if source is None else float(event[source])
            row[name] = [np.float32(value)]
        row["event_timestamp"] = [now or datetime.now(timezone.utc)]
        return row


class FeatureWriter:
    """Pushes rows to Feast push sources in the background; `submit` never blocks the caller.

    Args:
        store: the `feast.FeatureStore` whose push sources are written (online store only).
        timeout_s: how long one push may take before it is counted as timed out.
        max_pending: pushes queued or running beyond this are dropped (and counted), so a slow
            store cannot grow memory without bound.
        registry: Prometheus registry for `scorestack_feature_pushes_total{push_source, outcome}`.
    """

    def __init__(
        self,
        store: "feast.FeatureStore",
        *,
        timeout_s: float = 1.0,
        max_pending: int = 256,
        registry: "CollectorRegistry | None" = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter

        from scorestack.features.metrics import in_process_values

        if not timeout_s > 0 or max_pending < 1:
            raise FeatureError(f"timeout_s must be > 0 and max_pending >= 1, got {timeout_s}, {max_pending}")
        self.store = store
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.registry = registry if registry is not None else CollectorRegistry()
        with in_process_values():
            self._pushes = Counter(
                "scorestack_feature_pushes_total",
                "Rows written back through Feast's push API, by outcome (pushed, failed, timeout, dropped, skipped).",
                ["push_source", "outcome"],
                registry=self.registry,
            )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="scorestack-push")
        self._tasks: set[asyncio.Task] = set()
        # (push source, entity) -> (sequence, row) of the latest push not yet in the store: a second
        # event of the entity arriving before it lands builds on it instead of on the older store value.
        self._unwritten: dict[tuple[str, Any], tuple[int, dict[str, list]]] = {}
        self._sequence = 0

    def _count(self, push_source: str, outcome: str) -> None:
        # A labelled child's value is created on first use: create it in process memory, not in the
        # multiprocess files `import feast` switches prometheus_client to (shared by every registry
        # of the process, so two writers would count into each other).
        from scorestack.features.metrics import in_process_values

        with in_process_values():
            child = self._pushes.labels(push_source, outcome)
        child.inc()

    def count(self, push_source: str, outcome: str) -> int:
        """How many pushes to `push_source` ended with `outcome` (one of OUTCOMES)."""
        value = self.registry.get_sample_value("scorestack_feature_pushes_total", {"push_source": push_source, "outcome": outcome})
        return int(value or 0)

    def skip(self, push_source: str) -> None:
        """Count an event that was not written back (its counters were not read fresh)."""
        self._count(push_source, "skipped")

    def unwritten(self, push_source: str, entity: Any) -> dict[str, list] | None:
        """The latest row submitted for `entity` that is not yet in the store (None when all landed)."""
        entry = self._unwritten.get((push_source, entity))
        return entry[1] if entry is not None else None

    def submit(self, push_source: str, row: Mapping[str, list], entity: Any = None) -> bool:
        """Queue one push of `row` (columns of equal length); False when the queue was full (dropped).

        With `entity`, the row is remembered as unwritten until its push ends (see `unwritten`).
        """
        if len(self._tasks) >= self.max_pending:
            self._count(push_source, "dropped")
            logger.warning("push to %s dropped: %d pushes pending", push_source, len(self._tasks))
            return False
        self._sequence += 1
        key = (push_source, entity) if entity is not None else None
        if key is not None:
            self._unwritten[key] = (self._sequence, dict(row))
        task = asyncio.get_running_loop().create_task(self._push(push_source, dict(row), key, self._sequence))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _push_sync(self, push_source: str, row: dict[str, list]) -> None:
        import pandas as pd

        # The DataFrame is built here, in the worker thread, not on the event loop.
        self.store.push(push_source, pd.DataFrame(row))

    async def _push(self, push_source: str, row: dict[str, list], key: tuple | None = None, sequence: int = 0) -> None:
        try:
            await self._write(push_source, row)
        finally:
            # Landed, failed or timed out: from now on the store is the truth for this entity.
            if key is not None and self._unwritten.get(key, (None,))[0] == sequence:
                del self._unwritten[key]

    async def _write(self, push_source: str, row: dict[str, list]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._executor, self._push_sync, push_source, row), self.timeout_s)
        except TimeoutError:
            self._count(push_source, "timeout")
            logger.warning("push to %s timed out after %.3f s", push_source, self.timeout_s)
        except Exception as exc:  # a failed write-back is counted and logged, never raised into scoring
            self._count(push_source, "failed")
            logger.warning("push to %s failed: %s: %s", push_source, type(exc).__name__, exc)
        else:
            self._count(push_source, "pushed")

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (at most `timeout_s`) for the pushes submitted so far."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        await self.drain(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
