"""Real-time write-back: a scored transaction's velocity counters pushed through Feast's push API
change what the next fetch of that user returns (SQLite and Redis), and failures are counted."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from scorestack import schema
from scorestack.client.fraud import VELOCITY_UPDATE
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher, FeatureStatus
from scorestack.features.push import FeatureWriter


def _repo(tmp_path, online: str, redis_url: str | None, project: str):
    repo = demo_features.init_repo(tmp_path / "repo", online=online, redis_url=redis_url, n_users=60, n_items=5, project=project)
    store.apply(repo)
    store.materialize(repo)
    return repo


@pytest.fixture(params=["sqlite", "redis"])
def repo(request, tmp_path):
    if request.param == "sqlite":
        return _repo(tmp_path, "sqlite", None, "t_push")
    server = request.getfixturevalue("private_redis")  # a Redis of its own: pushes write for real
    return _repo(tmp_path, "redis", server.url, "t_push")


def _velocity(result) -> np.ndarray:
    return result.values[0, [result.feature_names.index(f) for f in schema.FRAUD_USER_VELOCITY]]


async def test_pushed_transaction_changes_the_next_fetch(repo):
    fs = store.feature_store(repo)
    writer = FeatureWriter(store.feature_store(repo), timeout_s=5.0)
    async with FeatureFetcher(fs, timeout_s=5.0) as fetcher:
        before = await fetcher.fetch("fraud", {"user_id": 7})
        assert (before.status == FeatureStatus.PRESENT).all()
        row = VELOCITY_UPDATE.row(7, before, {"amount": 12.5})
        assert writer.submit(VELOCITY_UPDATE.push_source, row)
        await writer.drain()
        after = await fetcher.fetch("fraud", {"user_id": 7})
        second = VELOCITY_UPDATE.row(7, after, {"amount": 100.0})  # a second transaction a moment later
        writer.submit(VELOCITY_UPDATE.push_source, second)
        await writer.drain()
        third = await fetcher.fetch("fraud", {"user_id": 7})
        unknown = await fetcher.fetch("fraud", {"user_id": 999_999})
    await writer.close()
    old, new, newer = _velocity(before), _velocity(after), _velocity(third)
    index = {f: i for i, f in enumerate(schema.FRAUD_USER_VELOCITY)}
    expected = old.astype(np.float64).copy()
    expected[[index["txn_count_1h"], index["txn_count_24h"]]] += 1
    expected[[index["amount_sum_1h"], index["amount_sum_24h"]]] += 12.5
    np.testing.assert_allclose(new, expected.astype(np.float32), rtol=1e-6)
    expected[[index["txn_count_1h"], index["txn_count_24h"]]] += 1
    expected[[index["amount_sum_1h"], index["amount_sum_24h"]]] += 100.0
    np.testing.assert_allclose(newer, expected.astype(np.float32), rtol=1e-6)
    assert (after.status == FeatureStatus.PRESENT).all() and (third.status == FeatureStatus.PRESENT).all()
    # The profile view is untouched, and Feast's own read agrees with the fetch.
    np.testing.assert_array_equal(after.values[0, : len(schema.FRAUD_USER_PROFILE)], before.values[0, : len(schema.FRAUD_USER_PROFILE)])
    online = fs.get_online_features(features=fs.get_feature_service("fraud"), entity_rows=[{"user_id": 7}]).to_dict()
    np.testing.assert_allclose(newer, np.float32([online[f][0] for f in schema.FRAUD_USER_VELOCITY]), rtol=1e-6)
    assert writer.count(VELOCITY_UPDATE.push_source, "pushed") == 2
    # An unknown user's counters were not read: nothing to add to, nothing written.
    assert VELOCITY_UPDATE.row(999_999, unknown, {"amount": 1.0}) is None


async def test_pushed_values_age_like_stored_ones(repo):
    """A pushed row carries its event's time: older than the view's ttl (velocity: 1 hour), the next
    fetch reports it `stale` and counts it, like any stored value; stale counters are then no base
    for another write-back."""
    fs = store.feature_store(repo)
    writer = FeatureWriter(store.feature_store(repo), timeout_s=5.0)
    user = 50_101  # not among the repository's 60 users: only the push writes it
    old = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=2)
    pushed = [np.float32(i + 0.5) for i in range(len(schema.FRAUD_USER_VELOCITY))]
    row = {"user_id": [user], **{f: [v] for f, v in zip(schema.FRAUD_USER_VELOCITY, pushed)}, "event_timestamp": [old]}
    async with FeatureFetcher(fs, timeout_s=5.0) as fetcher:
        before = await fetcher.fetch("fraud", {"user_id": user})
        assert writer.submit(VELOCITY_UPDATE.push_source, row)
        await writer.drain()
        after = await fetcher.fetch("fraud", {"user_id": user})
        stale_count = fetcher.registry.get_sample_value("scorestack_feature_stale_total", {"feature_view": "user_txn_velocity"})
    await writer.close()
    assert writer.count(VELOCITY_UPDATE.push_source, "pushed") == 1
    assert all(s is FeatureStatus.MISSING for s in before.feature_status().values())
    status = after.feature_status()
    assert all(status[f] is FeatureStatus.STALE for f in schema.FRAUD_USER_VELOCITY)
    assert all(status[f] is FeatureStatus.MISSING for f in schema.FRAUD_USER_PROFILE)
    np.testing.assert_array_equal(_velocity(after), np.float32(pushed))
    assert not after.degraded and stale_count == len(schema.FRAUD_USER_VELOCITY)
    assert VELOCITY_UPDATE.row(user, after, {"amount": 1.0}) is None


async def test_failed_pushes_are_counted_and_never_raise(tmp_path, private_redis):
    repo = _repo(tmp_path, "redis", private_redis.url, "t_push_down")
    writer = FeatureWriter(store.feature_store(repo), timeout_s=3.0, max_pending=2)
    async with FeatureFetcher(store.feature_store(repo), timeout_s=5.0) as fetcher:
        fetched = await fetcher.fetch("fraud", {"user_id": 3})
    row = VELOCITY_UPDATE.row(3, fetched, {"amount": 1.0})
    private_redis.stop()
    results = [writer.submit(VELOCITY_UPDATE.push_source, row) for _ in range(3)]
    await writer.drain(10.0)
    await writer.close()
    assert results == [True, True, False]  # the third found the queue full
    source = VELOCITY_UPDATE.push_source
    assert writer.count(source, "dropped") == 1
    assert writer.count(source, "failed") + writer.count(source, "timeout") == 2
    assert writer.count(source, "pushed") == 0


async def test_an_event_before_the_previous_push_landed_builds_on_it(repo):
    """Two transactions of one user faster than the store write: the second builds on the first's
    unwritten row, so neither increment is lost."""
    fs = store.feature_store(repo)
    writer = FeatureWriter(store.feature_store(repo), timeout_s=5.0)
    source = VELOCITY_UPDATE.push_source
    async with FeatureFetcher(fs, timeout_s=5.0) as fetcher:
        before = await fetcher.fetch("fraud", {"user_id": 11})
        first = VELOCITY_UPDATE.row(11, before, {"amount": 5.0})
        writer.submit(source, first, entity=11)
        assert writer.unwritten(source, 11) is not None  # submit returns before the write
        second = VELOCITY_UPDATE.row(11, before, {"amount": 7.0}, unwritten=writer.unwritten(source, 11))
        writer.submit(source, second, entity=11)
        await writer.drain()
        assert writer.unwritten(source, 11) is None
        after = await fetcher.fetch("fraud", {"user_id": 11})
    await writer.close()
    index = {f: i for i, f in enumerate(schema.FRAUD_USER_VELOCITY)}
    old, new = _velocity(before).astype(np.float64), _velocity(after)
    assert new[index["txn_count_1h"]] == np.float32(old[index["txn_count_1h"]] + 2)
    assert new[index["amount_sum_24h"]] == pytest.approx(old[index["amount_sum_24h"]] + 12.0, rel=1e-6)
    assert writer.count(source, "pushed") == 2
