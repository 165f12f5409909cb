"""Windowed velocity counters declared in a feature repository the demo never wrote.

The repository is written by the test the way a team writes its own: a String join key
(merchants), windows of 10 minutes at 1-minute buckets and 2 hours at 10-minute buckets, a count
and two sums from different event fields, a batch-fed field beside them, and a feature service
joining that view with another. Events go through `AsyncVelocityWriter.for_store` (on time, late,
older than every window, and a retried id); the fetch layer with `windows=True` must return the
exact window sums on SQLite and on Redis, `windows=False` and Feast's own SDK the stored snapshot.
Real Feast, SQLite and Redis; no mocks.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
import pytest
from conftest import user_feature_repo

DEFINITIONS = '''
from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float64, Int64

DATA = {data!r}

merchant = Entity(name="merchant", join_keys=["merchant_id"], value_type=ValueType.STRING)
activity_source = FileSource(name="activity_source", path=DATA + "/activity.parquet", timestamp_field="event_timestamp")
profile_source = FileSource(name="profile_source", path=DATA + "/profile.parquet", timestamp_field="event_timestamp")

merchant_activity = FeatureView(
    name="merchant_activity",
    entities=[merchant],
    ttl=timedelta(days=2),
    schema=[
        Field(name="sales_10m", dtype=Int64, tags={{"window_s": "600", "bucket_s": "60"}}),
        Field(name="revenue_10m", dtype=Float64, tags={{"window_s": "600", "bucket_s": "60", "window_source": "price"}}),
        Field(name="refunds_2h", dtype=Float64, tags={{"window_s": "7200", "bucket_s": "600", "window_source": "refund"}}),
        Field(name="chargeback_rate_30d", dtype=Float64),
    ],
    source=activity_source,
    online=True,
)
merchant_profile = FeatureView(
    name="merchant_profile",
    entities=[merchant],
    ttl=timedelta(days=2),
    schema=[Field(name="risk_tier", dtype=Int64)],
    source=profile_source,
    online=True,
)
merchant_score = FeatureService(name="merchant_score", features=[merchant_profile, merchant_activity])
'''

WINDOWED = ["sales_10m", "revenue_10m", "refunds_2h"]
SNAPSHOT = {"sales_10m": 99.0, "revenue_10m": 999.0, "refunds_2h": 9.0, "chargeback_rate_30d": 0.02}


def _make_repo(root: Path, online_store: str, project: str):
    import feast

    ts = pd.Timestamp("2026-01-01", tz="UTC")
    fs = user_feature_repo(root, DEFINITIONS, online_store, project, {
        "activity.parquet": pd.DataFrame({"merchant_id": ["m-1"], "chargeback_rate_30d": 0.0, "event_timestamp": ts}),
        "profile.parquet": pd.DataFrame({"merchant_id": ["m-1"], "risk_tier": 0, "event_timestamp": ts}),
    })
    # The batch job's snapshot of the activity view (what Feast's SDK and windows=False read).
    now = pd.Timestamp(datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=1))
    fs.write_to_online_store("merchant_activity", pd.DataFrame([{"merchant_id": "m-1", **SNAPSHOT, "event_timestamp": now}]))
    fs.write_to_online_store("merchant_profile", pd.DataFrame([{"merchant_id": m, "risk_tier": k, "event_timestamp": now} for k, m in enumerate(["m-1", "m-2"], 1)]))
    return feast.FeatureStore(repo_path=str(root))


@pytest.fixture(params=["sqlite", "redis"])
def user_store(request, tmp_path):
    if request.param == "sqlite":
        return _make_repo(tmp_path, "online_store:\n  type: sqlite\n  path: data/online.db\n", "merchants")
    url = request.getfixturevalue("private_redis").url
    host = url.split("//", 1)[1].split("/", 1)[0]
    return _make_repo(tmp_path, f'online_store:\n  type: redis\n  connection_string: "{host},db=0"\n', f"merchants_{uuid.uuid4().hex[:6]}")


async def test_counters_of_a_user_written_repository_are_exact_windows(user_store):
    from scorestack.features.fetch import FeatureFetcher, FeatureStatus
    from scorestack.features.velocity import AsyncVelocityWriter, spec_from_view

    fs = user_store
    # Feast is the catalogue: the registry lists the view, and its fields carry the window declarations.
    view = next(v for v in fs.list_feature_views() if v.name == "merchant_activity")
    spec = spec_from_view(view)
    assert [(f.name, f.window_s, f.bucket_s, f.source) for f in spec.features] == [
        ("sales_10m", 600, 60, None), ("revenue_10m", 600, 60, "price"), ("refunds_2h", 7200, 600, "refund")]

    writer = AsyncVelocityWriter.for_store(fs, view="merchant_activity", linger_s=0.001)
    assert writer.path == ("loop" if "redis" in str(fs.config.online_store.type) else "thread")
    now = time.time()
    events = [  # (merchant, id, event, event time offset from now)
        ("m-1", "a", {"price": 10.0, "refund": 0.0}, -5),
        ("m-1", "b", {"price": 20.5, "refund": 1.5}, -5),
        ("m-1", "c", {"price": 40.0, "refund": 4.0}, -3600),  # late: in the 2 h window only
        ("m-1", "d", {"price": 70.0, "refund": 7.0}, -3 * 86400),  # older than every window
        ("m-2", "e", {"price": 1.0, "refund": 0.25}, -5),
        ("m-1", "a", {"price": 10.0, "refund": 0.0}, -5),  # a retry of "a"
    ]
    for merchant, event_id, event, offset in events:
        assert writer.submit(merchant, event, event_id=event_id, event_time=now + offset)
    await writer.drain(10)
    assert {k: writer.count(k) for k in ("added", "duplicate", "expired", "failed", "dropped")} == {
        "added": 4, "duplicate": 1, "expired": 1, "failed": 0, "dropped": 0}

    async with FeatureFetcher(fs, timeout_s=5.0, windows=True) as fetcher:
        got = await fetcher.fetch("merchant_score", [{"merchant_id": "m-1"}, {"merchant_id": "m-2"}, {"merchant_id": "m-none"}])
    names = list(got.feature_names)
    at = lambda row, name: float(got.values[row, names.index(name)])
    # By hand: m-1 has a and b in 10 minutes, c too in 2 hours; d counts nowhere; a's retry once.
    assert [at(0, n) for n in WINDOWED] == [2.0, 30.5, 5.5]
    assert [at(1, n) for n in WINDOWED] == [1.0, 1.0, 0.25]
    assert [at(2, n) for n in WINDOWED] == [0.0, 0.0, 0.0]  # no events: zeros, present
    assert all(got.status[r, names.index(n)] == FeatureStatus.PRESENT for r in range(3) for n in WINDOWED)
    # The same from the reference over the event log (each id once, the expired one included: it counts nowhere).
    once = {e[1]: e for e in events}
    reference = spec.reference(now, [(now + offset, event) for merchant, _, event, offset in once.values() if merchant == "m-1"])
    assert reference == {n: at(0, n) for n in WINDOWED}
    # The batch-fed field beside the windows, and the other view of the service, as stored.
    assert at(0, "chargeback_rate_30d") == pytest.approx(SNAPSHOT["chargeback_rate_30d"])
    assert (at(0, "risk_tier"), at(1, "risk_tier")) == (1.0, 2.0)

    # windows=False and Feast's SDK read the snapshot the batch job wrote, not the live sums.
    async with FeatureFetcher(fs, timeout_s=5.0) as plain:
        stored = await plain.fetch("merchant_score", {"merchant_id": "m-1"})
    assert [float(stored.values[0, list(stored.feature_names).index(n)]) for n in WINDOWED] == [SNAPSHOT[n] for n in WINDOWED]
    sdk = fs.get_online_features(features=[f"merchant_activity:{n}" for n in WINDOWED], entity_rows=[{"merchant_id": "m-1"}]).to_dict()
    assert [sdk[n][0] for n in WINDOWED] == [SNAPSHOT[n] for n in WINDOWED]
    await writer.close()
