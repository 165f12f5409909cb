"""Windowed velocity counters (scorestack.features.velocity): exact under concurrent writer
processes, events age out of their window on a controllable clock, late events land in their own
bucket, retries never double count, and a Redis outage is counted as failed writes. Real Redis
(the shared one under a key prefix of this test's own, and a private redis-server for the outage)
and real SQLite; no mocks."""

from __future__ import annotations

import multiprocessing
import random
import uuid

import pytest

from scorestack.features.velocity import FRAUD_VELOCITY, RedisVelocity, SqliteVelocity, VelocitySpec, VelocityWriter, WindowedFeature

T0 = 1_800_000_000.0  # a fixed epoch second (aligned to the hour): the tests' clock starts here


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def prefix(redis_url):
    import redis

    prefix = f"test:velocity:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(params=["sqlite", "redis"])
def counters(request, tmp_path):
    clock = Clock()
    if request.param == "sqlite":
        return SqliteVelocity(str(tmp_path / "velocity.db"), FRAUD_VELOCITY, clock=clock), clock
    import redis

    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    return RedisVelocity(client, FRAUD_VELOCITY, prefix=request.getfixturevalue("prefix"), clock=clock), clock


def test_events_age_out_of_their_window(counters):
    store, clock = counters
    store.add(7, "e1", {"amount": 10.0})
    clock.t += 1800
    store.add(7, "e2", {"amount": 5.0})
    assert store.read(7) == {"txn_count_1h": 2.0, "amount_sum_1h": 15.0, "txn_count_24h": 2.0, "amount_sum_24h": 15.0}
    clock.t = T0 + 3600  # e1 is exactly one hour old: out of the 1-hour window (60 s resolution)
    assert store.read(7) == {"txn_count_1h": 1.0, "amount_sum_1h": 5.0, "txn_count_24h": 2.0, "amount_sum_24h": 15.0}
    clock.t = T0 + 1800 + 3600
    assert store.read(7)["txn_count_1h"] == 0.0 and store.read(7)["txn_count_24h"] == 2.0
    clock.t = T0 + 86400 + 3600  # both older than 24 h (1 h resolution)
    assert store.read(7) == dict.fromkeys(FRAUD_VELOCITY.feature_names, 0.0)
    assert store.read(8) == dict.fromkeys(FRAUD_VELOCITY.feature_names, 0.0)  # another entity: untouched
    if isinstance(store, RedisVelocity):
        # Each ring outlives its longest window: its key's expiry is set that window and a bucket
        # ahead when an event opens a bucket in it (e2 opened a new 5-minute one), and not renewed by
        # an event that does not.
        short, long = store.keys(7)
        assert 3600 + 300 - 5 <= store.client.ttl(short) <= 3600 + 300
        assert 86400 + 3600 - 5 <= store.client.ttl(long) <= 86400 + 3600
        clock.t = T0 + 1800
        store.client.expire(short, 100)
        store.add(7, "e3", {"amount": 1.0})  # e2's buckets: nothing new opened
        assert store.client.ttl(short) <= 100
        clock.t = T0 + 1800 + 300
        store.add(7, "e4", {"amount": 1.0})  # a new 5-minute bucket
        assert store.client.ttl(short) >= 3600 + 300 - 5


def test_late_event_lands_in_its_own_bucket_and_retries_do_not_double_count(counters):
    store, clock = counters
    clock.t = T0 + 7200
    events = [(T0 + 7100, {"amount": 1.0}), (T0 + 7200 - 3000, {"amount": 2.0}), (T0 + 7200 - 5000, {"amount": 4.0})]
    for i, (t, event) in enumerate(events):
        assert store.add(3, f"late{i}", event, event_time=t) == "added"
    assert store.add(3, "late0", events[0][1], event_time=events[0][0]) == "duplicate"  # a retry of the same event
    assert store.add(3, "ancient", {"amount": 9.0}, event_time=clock.t - 2 * 86400) == "expired"  # older than every window
    got = store.read(3)
    assert got == FRAUD_VELOCITY.reference(clock.t, events)
    # The 5000 s-old event is outside the hour, inside the day.
    assert got == {"txn_count_1h": 2.0, "amount_sum_1h": 3.0, "txn_count_24h": 3.0, "amount_sum_24h": 7.0}


def test_sqlite_expire_deletes_old_buckets(tmp_path):
    clock = Clock()
    store = SqliteVelocity(str(tmp_path / "v.db"), FRAUD_VELOCITY, clock=clock)
    store.add(1, "a", {"amount": 1.0})
    clock.t += 2 * 86400
    assert store.expire() == len(FRAUD_VELOCITY.features)
    assert store.read(1) == dict.fromkeys(FRAUD_VELOCITY.feature_names, 0.0)


def test_window_must_be_a_multiple_of_its_bucket():
    from scorestack.errors import FeatureError

    with pytest.raises(FeatureError):
        VelocitySpec("v", (WindowedFeature("x", 3600, bucket_s=7),))


def test_a_views_dedup_s_tag_sets_how_long_redis_keeps_an_event_id(redis_url, prefix):
    """The view's `dedup_s` tag is the life of each event's marker in Redis (its TTL, read back), a
    retry within it counts once; a tag that is not a positive whole number is refused naming it."""
    import redis
    from feast import Entity, FeatureView, Field, FileSource, ValueType
    from feast.types import Float64, Int64

    from scorestack.errors import FeatureError
    from scorestack.features.velocity import spec_from_view

    user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64)
    source = FileSource(name="s", path="unused.parquet", timestamp_field="event_timestamp")

    def view(tags):
        return FeatureView(name="card_velocity", entities=[user], source=source, tags=tags,
                           schema=[Field(name="n_10m", dtype=Int64, tags={"window_s": "600", "bucket_s": "60"}),
                                   Field(name="amount_10m", dtype=Float64, tags={"window_s": "600", "bucket_s": "60", "window_source": "amount"})])

    assert spec_from_view(view({})).dedup_s == 3600
    spec = spec_from_view(view({"dedup_s": "120"}))
    assert spec.dedup_s == 120
    for bad in ("0", "-5", "1.5", "an hour"):
        with pytest.raises(FeatureError, match=rf"view 'card_velocity': tag dedup_s='{bad}'; give the whole seconds an event id is remembered"):
            spec_from_view(view({"dedup_s": bad}))

    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    counters = RedisVelocity(client, spec, prefix=prefix, clock=clock)
    assert counters.add(7, "card-7-a", {"amount": 5.0}) == "added"
    assert counters.add(7, "card-7-a", {"amount": 5.0}) == "duplicate"  # a retry within dedup_s
    ttl = client.ttl(f"{prefix}card_velocity:seen:card-7-a")  # <prefix><view>:seen:<event id>
    assert 115 <= ttl <= 120
    assert counters.read(7) == {"n_10m": 1.0, "amount_10m": 5.0}


def test_redis_rings_windows_of_one_resolution_and_a_changed_window(redis_url, prefix):
    """Two windows over one ring (30 min and 1 h at 5-minute buckets) each sum only their own
    buckets; a spec whose longest window changed reads a new ring (the slot count is in the key), not
    the old ring's slots at the wrong places; a ring of too many features is refused by name."""
    import redis

    from scorestack.errors import FeatureError

    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    spec = VelocitySpec("w", (WindowedFeature("n_30m", 1800, None, 300), WindowedFeature("sum_1h", 3600, "amount", 300)))
    store = RedisVelocity(client, spec, prefix=prefix, clock=clock)
    for i, (age, amount) in enumerate([(0, 1.5), (900, 2.0), (2400, 4.0), (3700, 8.0)]):
        assert store.add("u", f"e{i}", {"amount": amount}, event_time=T0 - age) == ("added" if age < 3600 else "expired")
    assert store.read("u") == {"n_30m": 2.0, "sum_1h": 7.5}  # 30 min: ages 0 and 900; 1 h: the three under an hour
    # Slots of (start, n, sum) in float64s, written in place: the string ends at the last slot written, within 12 slots.
    assert client.strlen(store.keys("u")[0]) % (3 * 8) == 0 and client.strlen(store.keys("u")[0]) <= 12 * 3 * 8
    longer = RedisVelocity(client, VelocitySpec("w", (WindowedFeature("sum_2h", 7200, "amount", 300),)), prefix=prefix, clock=clock)
    assert longer.keys("u") != store.keys("u") and longer.read("u") == {"sum_2h": 0.0}
    with pytest.raises(FeatureError, match="give some of them another bucket_s"):
        RedisVelocity(client, VelocitySpec("w", tuple(WindowedFeature(f"f{i}", 3600, None, 300) for i in range(16))), prefix=prefix)


def _writer(url: str, prefix: str, events: list) -> None:
    import redis

    store = RedisVelocity(redis.Redis.from_url(url), FRAUD_VELOCITY, prefix=prefix)
    for event_id, user, t, amount in events:
        store.add(user, event_id, {"amount": amount}, event_time=t)


def test_concurrent_writer_processes_lose_nothing(redis_url, prefix):
    """4 processes add bursts for the same few users at once: every window equals the event log's sums."""
    rng = random.Random(5)
    log = []
    for burst in range(40):
        user = rng.randrange(5)
        for i in range(25):
            log.append((f"{burst}-{i}", user, T0 - rng.uniform(0, 7200), round(rng.uniform(1, 500), 2)))
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(redis_url, prefix, log[k::4])) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    import redis

    store = RedisVelocity(redis.Redis.from_url(redis_url), FRAUD_VELOCITY, prefix=prefix)
    for user in range(5):
        expected = FRAUD_VELOCITY.reference(T0, [(t, {"amount": a}) for _, u, t, a in log if u == user])
        got = store.read(user, now=T0)
        assert got.keys() == expected.keys()
        for name in got:
            assert got[name] == pytest.approx(expected[name], rel=1e-9), name


def test_outage_is_counted_as_failed_and_nothing_is_double_counted(private_redis):
    import redis

    client = redis.Redis.from_url(private_redis.url, socket_timeout=1, socket_connect_timeout=1)
    clock = Clock()
    writer = VelocityWriter(RedisVelocity(client, FRAUD_VELOCITY, clock=clock))
    assert writer.add(1, "a", {"amount": 2.0}) == "added"
    private_redis.stop()
    assert writer.add(1, "b", {"amount": 3.0}) == "failed"
    private_redis.start()  # a restart without persistence: the store starts empty
    assert writer.add(1, "c", {"amount": 4.0}) == "added"
    assert writer.add(1, "c", {"amount": 4.0}) == "duplicate"
    assert writer.counts == {"added": 2, "duplicate": 1, "expired": 0, "failed": 1}
    assert writer.store.read(1)["txn_count_1h"] == 1.0  # "a" went with the restarted store; "c" once


# --- through Feast and the fetch layer -------------------------------------------------------------


def _repo(tmp_path, online: str, redis_url: str | None):
    from scorestack.demo import features as demo_features
    from scorestack.features import store

    repo = demo_features.init_repo(tmp_path / "repo", online=online, redis_url=redis_url, n_users=20, n_items=5, project="t_velocity")
    store.apply(repo)
    store.materialize(repo)
    return repo


@pytest.fixture(params=["sqlite", "redis"])
def repo(request, tmp_path):
    if request.param == "sqlite":
        return _repo(tmp_path, "sqlite", None)
    return _repo(tmp_path, "redis", request.getfixturevalue("private_redis").url)


async def test_fetch_reads_window_sums_and_feast_lists_the_counters(repo):
    import time

    from scorestack import schema
    from scorestack.features import store
    from scorestack.features.fetch import FeatureFetcher, FeatureStatus
    from scorestack.features.velocity import AsyncVelocityWriter, spec_from_view

    fs = store.feature_store(repo)
    # Feast is the catalogue: the view and its window declarations are in the registry.
    spec = spec_from_view(fs.get_feature_view("user_txn_velocity"))
    assert spec.name == FRAUD_VELOCITY.name and set(spec.features) == set(FRAUD_VELOCITY.features)
    writer = AsyncVelocityWriter.for_store(store.feature_store(repo))
    now = time.time()
    for i in range(30):
        writer.submit(4, {"amount": 2.5}, event_id=f"t{i}")
    writer.submit(4, {"amount": 100.0}, event_id="old", event_time=now - 7200)  # late: 24 h window only
    writer.submit(4, {"amount": 1.0}, event_id="t0")  # a retry of t0
    await writer.drain()
    assert (writer.count("added"), writer.count("duplicate"), writer.count("failed"), writer.count("dropped")) == (31, 1, 0, 0)
    index = [schema.FRAUD_FEATURES.index(f) for f in ("txn_count_1h", "amount_sum_1h", "txn_count_24h", "amount_sum_24h")]
    async with FeatureFetcher(fs, timeout_s=5.0, windows=True) as fetcher:
        got = await fetcher.fetch("fraud", [{"user_id": 4}, {"user_id": 55_555}])
        backend = fetcher.backend_of("fraud")
        before = fetcher.round_trips(backend)
        await fetcher.fetch("fraud", {"user_id": 4})
        trips = fetcher.round_trips(backend) - before
    assert got.values[0, index].tolist() == [30.0, 75.0, 31.0, 175.0]
    assert (got.status[0, index] == FeatureStatus.PRESENT).all()
    # A user the batch never saw: no stored row, windows of zero, read as present (not defaulted).
    assert got.values[1, index].tolist() == [0.0, 0.0, 0.0, 0.0] and (got.status[1, index] == FeatureStatus.PRESENT).all()
    assert trips == 1  # the windows come in the same round trip as the rest of the view
    # windows=False and Feast's own read: the stored (materialized) row, untouched by the events.
    feast_row = fs.get_online_features(features=["user_txn_velocity:txn_count_1h"], entity_rows=[{"user_id": 4}]).to_dict()
    async with FeatureFetcher(fs, timeout_s=5.0) as plain:
        stored = await plain.fetch("fraud", {"user_id": 4})
    assert stored.values[0, index[0]] == pytest.approx(feast_row["txn_count_1h"][0])
    await writer.close()


async def test_write_back_resends_through_an_outage_and_counts_what_it_gives_up(tmp_path, private_redis):
    """A stopped Redis: the writer keeps the events and resends them (with their ids and event times) until the store is
    back, so the windows hold each exactly once and every event is counted added; with a short `retry_s` and the store
    still down, the events are given up and counted failed, none silently; closing during an outage counts them failed."""
    from scorestack.features import store
    from scorestack.features.velocity import AsyncVelocityWriter

    repo = _repo(tmp_path, "redis", private_redis.url)
    fs = store.feature_store(repo)
    writer = AsyncVelocityWriter.for_store(fs)  # retry_s 30 by default
    private_redis.stop()
    for i in range(3):
        assert writer.submit(1, {"amount": 2.0}, event_id=f"x{i}")
    await wait_for_count(writer, "retried", 3)
    assert writer.pending == 3 and writer.count("failed") == 0
    private_redis.start()
    await writer.drain(30)
    assert (writer.count("added"), writer.count("failed"), writer.count("duplicate"), writer.pending) == (3, 0, 0, 0)
    assert writer.counters.read(1)["txn_count_1h"] == 3.0 and writer.counters.read(1)["amount_sum_1h"] == 6.0
    await writer.close()

    short = AsyncVelocityWriter.for_store(fs, retry_s=0.3)
    private_redis.stop()
    for i in range(3):
        assert short.submit(1, {"amount": 1.0}, event_id=f"y{i}")
    await short.drain(30)
    assert (short.count("failed"), short.count("added"), short.pending) == (3, 0, 0) and short.count("retried") >= 3
    closing = AsyncVelocityWriter.for_store(fs)
    assert closing.submit(1, {"amount": 1.0}, event_id="z")
    await wait_for_count(closing, "retried", 1)
    await closing.close(timeout_s=0.2)
    assert (closing.count("failed"), closing.pending) == (1, 0)
    await short.close()
    with pytest.raises(ValueError, match="retry_s"):
        AsyncVelocityWriter.for_store(fs, retry_s=-1)


async def wait_for_count(writer, outcome: str, n: int, timeout_s: float = 30.0) -> None:
    import asyncio

    from scorestack.serve.readiness import wait_until

    await asyncio.to_thread(wait_until, lambda: None if writer.count(outcome) >= n else f"{writer.count(outcome)} so far", timeout_s=timeout_s, what=f"{n} {outcome} writes")
