"""The fetch layer against real stores: Feast's own values, missing and stale entities, cache,
coalescing, metrics and input validation (SQLite and the machine's Redis)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis

from scorestack import schema
from scorestack.demo import data as demo_data
from scorestack.errors import FeatureError
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher, FeatureStatus

N_USERS, N_ITEMS = 300, 200
PROJECT = "t_features_fetch"


def _redis_db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


def _clear_project(url: str, project: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=5)
    keys = list(client.scan_iter(match=b"*" + project.encode(), count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def sqlite_repo(tmp_path_factory) -> Path:
    repo = demo_features.init_repo(tmp_path_factory.mktemp("sqlite") / "repo", n_users=N_USERS, n_items=N_ITEMS, project=PROJECT)
    store.apply(repo)
    store.materialize(repo)
    return repo


@pytest.fixture(scope="module")
def redis_repo(tmp_path_factory, redis_url) -> Path:
    url = _redis_db(redis_url, 13)  # a db of our own on the shared Redis
    _clear_project(url, PROJECT)
    repo = demo_features.init_repo(tmp_path_factory.mktemp("redis") / "repo", online="redis", redis_url=url, n_users=N_USERS, n_items=N_ITEMS, project=PROJECT)
    store.apply(repo)
    store.materialize(repo)
    return repo


BACKENDS = [("sqlite", "feast_sync"), ("redis", "feast_async"), ("redis", "direct"), ("redis", "feast_sync")]


def _repo(request, online: str) -> Path:
    return request.getfixturevalue("sqlite_repo" if online == "sqlite" else "redis_repo")


def _feast_reference(fs, service: str, rows: list[dict], names: tuple[str, ...], defaults: dict[str, float]):
    """Feast's own answer for the same rows, with declared defaults where it has no value."""
    got = fs.get_online_features(features=fs.get_feature_service(service), entity_rows=rows).to_dict()
    values = np.array([[defaults[n] if got[n][i] is None else got[n][i] for n in names] for i in range(len(rows))], dtype=np.float32)
    missing = np.array([[got[n][i] is None for n in names] for i in range(len(rows))])
    return values, missing


def _defaults(fetcher: FeatureFetcher) -> dict[str, float]:
    return {f: float(v.defaults[i]) for v in fetcher.views.values() for i, f in enumerate(v.features)}


@pytest.mark.parametrize(("online", "backend"), BACKENDS)
async def test_fetch_returns_feasts_values(request, online, backend):
    fs = store.feature_store(_repo(request, online))
    users = [*range(1, 41), 99_999, 5, 7]  # an unknown user and duplicates
    items = [*range(1, 101), 77_777, 3]
    async with FeatureFetcher(fs, backend=backend, timeout_s=2.0) as fetcher:
        assert fetcher.backend_of("fraud") == backend
        if backend == "direct":  # the demo's connection string is all the lean connection's (features/resp.py)
            assert fetcher._lanes["direct"].backend.lean_reason is None
        defaults = _defaults(fetcher)

        fraud = await fetcher.fetch("fraud", [{"user_id": u} for u in users])
        names = schema.FRAUD_USER_PROFILE + schema.FRAUD_USER_VELOCITY
        assert fraud.feature_names == names and fraud.values.dtype == np.float32
        expected, missing = _feast_reference(fs, "fraud", [{"user_id": u} for u in users], names, defaults)
        np.testing.assert_array_equal(fraud.values, expected)
        np.testing.assert_array_equal(fraud.status == FeatureStatus.MISSING, missing)
        assert missing[40].all() and not missing[:40].any()
        assert (fraud.status[:40] == FeatureStatus.PRESENT).all() and not fraud.degraded
        # ... and they are the demo data.
        demo = demo_data.make_users(N_USERS).set_index("user_id")
        np.testing.assert_array_equal(fraud.values[:40], demo.loc[users[:40], list(names)].to_numpy())
        np.testing.assert_array_equal(fraud.values[40], np.float32([defaults[n] for n in names]))

        ranking = await fetcher.fetch("ranking", {"user_id": 7, "item_id": items})
        names = schema.RANKING_USER + schema.RANKING_ITEM
        assert ranking.feature_names == names and ranking.values.shape == (len(items), len(names))
        rows = [{"user_id": 7, "item_id": i} for i in items]
        expected, missing = _feast_reference(fs, "ranking", rows, names, defaults)
        np.testing.assert_array_equal(ranking.values, expected)
        np.testing.assert_array_equal(ranking.status == FeatureStatus.MISSING, missing)
        assert missing[100, len(schema.RANKING_USER) :].all() and not missing[100, : len(schema.RANKING_USER)].any()
        assert ranking.count(FeatureStatus.MISSING) == len(schema.RANKING_ITEM)


@pytest.mark.parametrize(("online", "backend"), BACKENDS[:3])
async def test_values_older_than_the_view_ttl_are_stale(request, online, backend):
    fs = store.feature_store(_repo(request, online))
    user = {"sqlite": 50_001, "feast_async": 50_002, "direct": 50_003}[backend if online == "redis" else "sqlite"]
    old = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=2)  # velocity ttl: 1 hour
    row = {name: [np.float32(i + 0.5)] for i, name in enumerate(schema.FRAUD_USER_VELOCITY)}
    fs.write_to_online_store("user_txn_velocity", pd.DataFrame({"user_id": [user], **row, "event_timestamp": [old]}))
    async with FeatureFetcher(fs, backend=backend, timeout_s=2.0) as fetcher:
        result = await fetcher.fetch("fraud", {"user_id": user})
    status = result.feature_status()
    assert all(status[n] is FeatureStatus.STALE for n in schema.FRAUD_USER_VELOCITY)
    assert all(status[n] is FeatureStatus.MISSING for n in schema.FRAUD_USER_PROFILE)
    velocity = result.values[0, len(schema.FRAUD_USER_PROFILE) :]
    np.testing.assert_array_equal(velocity, np.float32([i + 0.5 for i in range(len(schema.FRAUD_USER_VELOCITY))]))
    assert not result.degraded
    assert fetcher.registry.get_sample_value("scorestack_feature_stale_total", {"feature_view": "user_txn_velocity"}) == 6


async def test_slow_views_are_cached_fast_counters_are_not(redis_repo):
    fs = store.feature_store(redis_repo)
    items = list(range(1, 51))
    async with FeatureFetcher(fs, backend="direct", timeout_s=2.0) as fetcher:
        first = await fetcher.fetch("ranking", {"user_id": 9, "item_id": items})
        trips = fetcher.round_trips("direct")
        second = await fetcher.fetch("ranking", {"user_id": 9, "item_id": items})
        assert first.cache_hits == 0 and second.cache_hits == 1 + len(items)
        assert fetcher.round_trips("direct") == trips  # no store read at all
        assert second.timings.store_s == 0.0
        np.testing.assert_array_equal(first.values, second.values)

        await fetcher.fetch("fraud", {"user_id": 9})
        trips = fetcher.round_trips("direct")
        fraud = await fetcher.fetch("fraud", {"user_id": 9})
        assert fraud.cache_hits == 1  # the profile; velocity (cache_ttl_s 0) is read again
        assert fetcher.round_trips("direct") == trips + 1
        hits = fetcher.registry.get_sample_value
        assert hits("scorestack_feature_cache_hits_total", {"feature_view": "item_stats"}) == len(items)
        assert hits("scorestack_feature_cache_hits_total", {"feature_view": "user_fraud_profile"}) == 1
        assert hits("scorestack_feature_cache_hits_total", {"feature_view": "user_txn_velocity"}) == 0


@pytest.mark.parametrize("backend", ["direct", "feast_async"])
async def test_concurrent_fetches_are_coalesced(redis_repo, backend):
    fs = store.feature_store(redis_repo)
    users = [1 + i % 10 for i in range(50)]  # 50 requests, 10 distinct users
    options = dict(backend=backend, timeout_s=2.0, cache=False)
    async with FeatureFetcher(fs, coalesce_window_s=None, **options) as alone:
        separate = await asyncio.gather(*(alone.fetch("fraud", {"user_id": u}) for u in users))
        assert alone.round_trips(backend) == 50
    async with FeatureFetcher(fs, coalesce_window_s=0.002, **options) as together:
        shared = await asyncio.gather(*(together.fetch("fraud", {"user_id": u}) for u in users))
        assert together.round_trips(backend) < 5  # one in the usual case; a slow loop may split the window
        assert together.registry.get_sample_value("scorestack_feature_coalesced_requests_sum", {"backend": backend}) == 50
    for a, b in zip(separate, shared):
        np.testing.assert_array_equal(a.values, b.values)
        assert not b.degraded and (b.status == FeatureStatus.PRESENT).all()


async def test_metrics_are_exported(sqlite_repo):
    from prometheus_client import generate_latest

    fs = store.feature_store(sqlite_repo)
    async with FeatureFetcher(fs, timeout_s=2.0) as fetcher:
        await fetcher.fetch("fraud", {"user_id": [1, 123_456]})
    text = generate_latest(fetcher.registry).decode()
    for name in (
        "scorestack_feature_fetch_seconds_bucket",
        "scorestack_feature_store_read_seconds_bucket",
        "scorestack_feature_defaults_total",
        "scorestack_feature_breaker_state",
        "scorestack_feature_cache_misses_total",
    ):
        assert name in text
    get = fetcher.registry.get_sample_value
    assert get("scorestack_feature_fetches_total", {"service": "fraud", "outcome": "ok"}) == 1
    assert get("scorestack_feature_defaults_total", {"feature_view": "user_txn_velocity", "reason": "missing"}) == 6
    assert get("scorestack_feature_breaker_state", {"backend": "feast_sync"}) == 0


@pytest.mark.parametrize(
    ("service", "rows", "field"),
    [
        ("nope", {"user_id": 1}, "service"),
        ("fraud", {"user_id": "12"}, "entity_rows.user_id"),
        ("fraud", {"user_id": 1.5}, "entity_rows.user_id"),
        ("fraud", {"user_id": True}, "entity_rows.user_id"),
        ("fraud", {"user_id": [1, 2**64]}, r"entity_rows.user_id\[1\]"),
        ("fraud", [{"user_id": 1}, {"item_id": 2}], r"entity_rows\[1\].item_id"),
        ("fraud", [{"user_id": 1}, {}], r"entity_rows\[1\].user_id"),
        ("fraud", {"customer": 1}, "entity_rows.customer"),
        ("ranking", {"user_id": 1}, "entity_rows.item_id"),
        ("ranking", {"user_id": [1, 2], "item_id": [1, 2, 3]}, "entity_rows"),
        ("fraud", [], "entity_rows"),
        ("fraud", {"user_id": list(range(20_000))}, "max_rows"),
        ("fraud", "user_id=1", "entity_rows"),
    ],
)
async def test_invalid_requests_name_the_field(sqlite_repo, service, rows, field):
    async with FeatureFetcher.from_repo(sqlite_repo) as fetcher:
        with pytest.raises(FeatureError, match=field):
            await fetcher.fetch(service, rows)


async def test_numpy_ids_and_columns_are_accepted(sqlite_repo):
    async with FeatureFetcher.from_repo(sqlite_repo, timeout_s=2.0) as fetcher:
        a = await fetcher.fetch("ranking", {"user_id": np.int64(4), "item_id": np.arange(1, 6)})
        b = await fetcher.fetch("ranking", [{"user_id": 4, "item_id": i} for i in range(1, 6)])
    np.testing.assert_array_equal(a.values, b.values)


def test_backend_must_fit_the_online_store(sqlite_repo):
    fs = store.feature_store(sqlite_repo)
    with pytest.raises(FeatureError, match="backend"):
        FeatureFetcher(fs, backend="direct")
    with pytest.raises(FeatureError, match="backend"):
        FeatureFetcher(fs, backend={"search": "feast_sync"})
    assert FeatureFetcher(fs).backend_of("ranking") == "feast_sync"


def test_auto_backend_on_redis(redis_repo):
    """`auto` picks the fastest reader (benchmarks/results/features.md) for every service on Redis."""
    fetcher = FeatureFetcher(store.feature_store(redis_repo))
    assert fetcher.backend_of("fraud") == "direct" and fetcher.backend_of("ranking") == "direct"
    assert "fastest" in fetcher.backend_reason("fraud")


async def test_fetch_before_start_says_how(sqlite_repo):
    fetcher = FeatureFetcher.from_repo(sqlite_repo)
    with pytest.raises(FeatureError, match="async with"):
        await fetcher.fetch("fraud", {"user_id": 1})


async def test_fetchers_count_apart_although_feast_sets_multiprocess_mode(sqlite_repo):
    import os

    import feast  # noqa: F401 - sets PROMETHEUS_MULTIPROCESS_DIR for the whole process

    assert "PROMETHEUS_MULTIPROCESS_DIR" in os.environ
    a = FeatureFetcher.from_repo(sqlite_repo, timeout_s=2.0)
    b = FeatureFetcher.from_repo(sqlite_repo, timeout_s=2.0)
    async with a:
        await a.fetch("fraud", {"user_id": 1})
    sample = {"service": "fraud", "outcome": "ok"}
    assert a.registry.get_sample_value("scorestack_feature_fetches_total", sample) == 1
    assert b.registry.get_sample_value("scorestack_feature_fetches_total", sample) == 0


def _hmget_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))


@pytest.mark.parametrize("backend", ["direct", "feast_async"])
async def test_duplicate_entities_are_read_once_by_redis(private_redis, tmp_path, backend):
    """Counted by Redis itself: 50 fetches of 10 users, with and without coalescing."""
    repo = demo_features.init_repo(tmp_path / "repo", online="redis", redis_url=private_redis.url, n_users=50, n_items=10)
    store.apply(repo)
    store.materialize(repo)
    admin = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    users = [1 + i % 10 for i in range(50)]
    # Per entity: the direct reader reads all its views with one HMGET; Feast issues one per view.
    per_user = 1 if backend == "direct" else 2
    calls = {}
    for window in (None, 0.002):
        async with FeatureFetcher(store.feature_store(repo), backend=backend, coalesce_window_s=window, cache=False, timeout_s=2.0) as f:
            admin.config_resetstat()
            results = await asyncio.gather(*(f.fetch("fraud", {"user_id": u}) for u in users))
            calls[window] = _hmget_calls(admin)
            assert all(not r.degraded for r in results)
    admin.close()
    assert calls[None] == 50 * per_user
    assert calls[0.002] == 10 * per_user


async def test_start_freezes_the_heap_it_leaves_unless_told_not_to(redis_repo):
    """`start` moves the start-up heap out of the collector's view (gc.freeze), so a full collection
    no longer walks Feast's registry and friends while requests wait; freeze_heap=False does not."""
    import gc

    fs = store.feature_store(redis_repo)
    gc.unfreeze()
    async with FeatureFetcher(fs, backend="direct", timeout_s=2.0, freeze_heap=False) as fetcher:
        assert gc.get_freeze_count() == 0
        assert not (await fetcher.fetch("fraud", {"user_id": 1})).degraded
    async with FeatureFetcher(fs, backend="direct", timeout_s=2.0) as fetcher:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the registry, feast, pandas and numpy modules alive at start
        assert not (await fetcher.fetch("fraud", {"user_id": 1})).degraded
    gc.unfreeze()
