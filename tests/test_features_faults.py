"""Faults for real: a Redis of the test's own is stopped or paused under the fetch layer.

The fetch must return a degraded result with the declared defaults within its budget (never an
exception, never a hang), the breaker must open after repeated failures and close again once
Redis is back.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import redis

from scorestack import schema
from scorestack.demo import data as demo_data
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher, FeatureStatus
from scorestack.features.resilience import BreakerState

BUDGET_S = 0.05
# Redis 7.0 holds even CLIENT UNPAUSE while paused, so a pause is waited out, not lifted.
PAUSE_MS = 2000
FAILURES = 3
COOLDOWN_S = 0.3
CASES = [("feast_async", "fraud"), ("direct", "fraud"), ("direct", "ranking")]


@pytest.fixture
def repo(private_redis, tmp_path):
    repo = demo_features.init_repo(tmp_path / "repo", online="redis", redis_url=private_redis.url, n_users=200, n_items=100)
    store.apply(repo)
    store.materialize(repo)
    return repo


def _rows(service: str):
    return {"user_id": 5} if service == "fraud" else {"user_id": 5, "item_id": [1, 2, 3]}


def _expected(service: str) -> np.ndarray:
    users = demo_data.make_users(200).set_index("user_id")
    if service == "fraud":
        return users.loc[[5], list(schema.FRAUD_USER_PROFILE + schema.FRAUD_USER_VELOCITY)].to_numpy()
    items = demo_data.make_items(100).set_index("item_id").loc[[1, 2, 3], list(schema.RANKING_ITEM)].to_numpy()
    user = np.repeat(users.loc[[5], list(schema.RANKING_USER)].to_numpy(), 3, axis=0)
    return np.hstack([user, items])


def _fetcher(repo, backend):
    return FeatureFetcher(
        store.feature_store(repo),
        backend=backend,
        timeout_s=BUDGET_S,
        breaker_failures=FAILURES,
        breaker_cooldown_s=COOLDOWN_S,
        cache=False,  # every fetch must reach the store
    )


async def _degraded_fetches(fetcher, backend, service, expected_reason: str):
    defaults = np.concatenate([v.defaults for v in fetcher._plans[service].views])
    for _ in range(FAILURES):
        start = time.perf_counter()
        result = await fetcher.fetch(service, _rows(service))
        elapsed = time.perf_counter() - start
        assert elapsed < 10 * BUDGET_S, f"fetch took {elapsed:.3f}s against a {BUDGET_S}s budget"
        assert result.degraded and result.reason.startswith(expected_reason), result.reason
        assert (result.status == FeatureStatus.DEFAULTED).all()
        np.testing.assert_array_equal(result.values, np.broadcast_to(defaults, result.values.shape))
    assert fetcher.breaker(backend).state is BreakerState.OPEN
    assert fetcher.registry.get_sample_value("scorestack_feature_breaker_state", {"backend": backend}) == 1
    # Open: no more calls to the store, still defaults, still fast.
    trips = fetcher.round_trips(backend)
    result = await fetcher.fetch(service, _rows(service))
    assert result.degraded and result.reason == "breaker_open"
    assert fetcher.round_trips(backend) == trips


async def _recovers(fetcher, backend, service):
    await asyncio.sleep(COOLDOWN_S * 1.2)
    result = await fetcher.fetch(service, _rows(service))  # the half-open probe
    assert not result.degraded, result.reason
    assert fetcher.breaker(backend).state is BreakerState.CLOSED
    assert fetcher.registry.get_sample_value("scorestack_feature_breaker_state", {"backend": backend}) == 0
    np.testing.assert_array_equal(result.values, _expected(service))


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "service"), CASES)
async def test_redis_stopped(private_redis, repo, backend, service):
    async with _fetcher(repo, backend) as fetcher:
        healthy = await fetcher.fetch(service, _rows(service))
        assert not healthy.degraded
        np.testing.assert_array_equal(healthy.values, _expected(service))

        private_redis.stop()
        await _degraded_fetches(fetcher, backend, service, "error")

        private_redis.start()  # an empty Redis on the same port: load it again
        store.materialize(repo)
        await _recovers(fetcher, backend, service)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "service"), CASES)
async def test_redis_paused(private_redis, repo, backend, service):
    admin = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    async with _fetcher(repo, backend) as fetcher:
        assert not (await fetcher.fetch(service, _rows(service))).degraded
        admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
        paused_until = time.monotonic() + PAUSE_MS / 1000
        await _degraded_fetches(fetcher, backend, service, "timeout")
        await asyncio.sleep(max(paused_until - time.monotonic(), 0) + 0.05)
        await _recovers(fetcher, backend, service)
    admin.close()


@pytest.mark.slow
async def test_budget_holds_while_a_store_read_hangs(private_redis, repo):
    """Coalesced waiters each keep their own deadline while the shared read hangs."""
    admin = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    async with _fetcher(repo, "direct") as fetcher:
        admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
        start = time.perf_counter()
        results = await asyncio.gather(*(fetcher.fetch("fraud", {"user_id": u}) for u in range(1, 21)))
        elapsed = time.perf_counter() - start
        await asyncio.sleep(PAUSE_MS / 1000)
    admin.close()
    assert elapsed < 10 * BUDGET_S
    assert all(r.degraded and r.reason == "timeout" for r in results)
    assert fetcher.round_trips("direct") == 1
