"""The fetch layer's guards: a circuit breaker for a failing store and a TTL cache for slow views."""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Callable, Generic, Hashable, Iterable, TypeVar

V = TypeVar("V")


class BreakerState(IntEnum):
    """Exported as the value of `scorestack_feature_breaker_state`."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Stops calling a store after `failure_threshold` consecutive failures.

    After `cooldown_s` one probe call is let through (half-open): success closes the breaker, failure
    opens it for another cool-down. Calls refused while open get defaults without touching the store.
    """

    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or cooldown_s < 0:
            raise ValueError(f"failure_threshold must be >= 1 and cooldown_s >= 0, got {failure_threshold}, {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened = 0  # times it opened, for tests and logs
        self._opened_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the store now (moves open -> half-open after the cool-down)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
            return True  # the probe
        return False  # open, or half-open with the probe still in flight

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            if self.state is not BreakerState.OPEN:
                self.opened += 1
            self.state = BreakerState.OPEN
            self._opened_at = self._clock()


class TTLCache(Generic[V]):
    """A bounded in-process cache whose entries expire `ttl_s` after insertion (oldest evicted first)."""

    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._data: dict[Hashable, tuple[float, V]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> V | None:
        return self.get_many((key,))[0]

    def get_many(self, keys: Iterable[Hashable]) -> list[V | None]:
        """`get` for each key, with one clock read for all of them."""
        now, data, out = self._clock(), self._data, []
        for key in keys:
            entry = data.get(key)
            if entry is not None and entry[0] < now:
                del data[key]
                entry = None
            out.append(None if entry is None else entry[1])
        return out

    def put(self, key: Hashable, value: V, ttl_s: float) -> None:
        if ttl_s <= 0:
            return
        self._data.pop(key, None)
        if len(self._data) >= self.max_entries:
            for old in list(self._data)[: max(1, self.max_entries // 10)]:
                del self._data[old]
        self._data[key] = (self._clock() + ttl_s, value)

    def clear(self) -> None:
        self._data.clear()
