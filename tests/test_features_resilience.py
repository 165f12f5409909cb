"""The circuit breaker and the TTL cache, on a fake clock."""

from __future__ import annotations

from scorestack.features.resilience import BreakerState, CircuitBreaker, TTLCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=1.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    breaker.record_success()  # resets the run
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 1.0
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    breaker.record_failure()  # probe failed: open for another cool-down
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 2.5
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.opened == 2


def test_cache_expires_and_stays_bounded():
    clock = Clock()
    cache: TTLCache[str] = TTLCache(max_entries=10, clock=clock)
    cache.put("a", "x", ttl_s=5)
    cache.put("never", "y", ttl_s=0)  # ttl 0: not cached
    assert cache.get("a") == "x" and cache.get("never") is None
    clock.now = 5.1
    assert cache.get("a") is None
    for i in range(25):
        cache.put(i, str(i), ttl_s=60)
    assert len(cache) <= 10 and cache.get(24) == "24"


def test_cache_get_many_equals_get_per_key_and_drops_expired():
    clock = Clock()
    cache: TTLCache[str] = TTLCache(clock=clock)
    cache.put(("v", 1), "one", ttl_s=5)
    cache.put(("v", 2), "two", ttl_s=50)
    assert cache.get_many([("v", 1), ("v", 3), ("v", 2)]) == ["one", None, "two"]
    clock.now = 6.0
    assert cache.get_many([("v", 1), ("v", 2)]) == [None, "two"]
    assert len(cache) == 1  # the expired entry went, as get() removes it
