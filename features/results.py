"""What one fetch returns: values in the model's order, a status per value, timings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class FeatureStatus(IntEnum):
    """Per value: where it came from. Codes are stored in `FeatureResult.status` (int8)."""

    PRESENT = 0  # read from the store (or the cache), within its view's ttl
    MISSING = 1  # the store has no value for this entity: declared default used
    STALE = 2  # read, but older than its view's ttl: the stored value is kept, flagged
    DEFAULTED = 3  # the store was not read in time (timeout, error, open breaker): default used


@dataclass(frozen=True)
class FetchTimings:
    """Seconds spent by one fetch."""

    total_s: float  # the whole call, validation to matrix
    store_s: float  # the store round trip this call waited for (0 when served from the cache)


@dataclass(frozen=True)
class FeatureResult:
    """Store-backed features of one service for the entity rows asked, in the model's order."""

    service: str
    feature_names: tuple[str, ...]
    values: np.ndarray  # float32 [n_rows, n_features]
    status: np.ndarray  # int8 FeatureStatus codes, same shape
    degraded: bool  # some values are defaults because the store failed or was too slow
    reason: str | None  # why degraded: "timeout", "breaker_open", "error: <type>: <message>"
    cache_hits: int  # entity rows (per view) served from the cache
    backend: str
    timings: FetchTimings

    def count(self, status: FeatureStatus) -> int:
        """How many values have this status."""
        return int(np.count_nonzero(self.status == status))

    def feature_status(self) -> dict[str, FeatureStatus]:
        """The worst status per feature over all rows (DEFAULTED > STALE > MISSING > PRESENT)."""
        worst = self.status.max(axis=0) if len(self.status) else np.zeros(len(self.feature_names), np.int8)
        return {name: FeatureStatus(int(code)) for name, code in zip(self.feature_names, worst)}
