"""The fetch layer on feature repositories written the way Feast's own templates write them.

Each repository is written by the test (Python definitions, `FeatureStore.apply`, online data
through Feast's own `write_to_online_store`): on-demand views in pandas and python mode fed by
request data, views that mix numeric with Map, Json, Struct and String fields, a String join
key, a compound join key, and a service joining two entities. Every backend on SQLite and Redis
must return what `FeatureStore.get_online_features` returns, for known and unknown entities.
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis

from conftest import user_feature_repo

from scorestack.errors import FeatureError, FeatureServiceError, InputValidationError, RequestValidationError
from scorestack.features.fetch import FeatureFetcher, FeatureStatus

DEFINITIONS = '''
from datetime import timedelta

import pandas as pd
from feast import Entity, FeatureService, FeatureView, Field, FileSource, RequestSource, ValueType
from feast.on_demand_feature_view import on_demand_feature_view
from feast.types import Float32, Float64, Int64, Json, Map, String, Struct

DATA = {data!r}

driver = Entity(name="driver", join_keys=["driver_id"], value_type=ValueType.INT64)
merchant = Entity(name="merchant", join_keys=["merchant_id"], value_type=ValueType.STRING)
user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64)

driver_stats_source = FileSource(name="driver_stats_source", path=DATA + "/drivers.parquet", timestamp_field="event_timestamp")
merchant_source = FileSource(name="merchant_source", path=DATA + "/merchants.parquet", timestamp_field="event_timestamp")
user_source = FileSource(name="user_source", path=DATA + "/users.parquet", timestamp_field="event_timestamp")
pair_source = FileSource(name="pair_source", path=DATA + "/pairs.parquet", timestamp_field="event_timestamp")

# As in Feast's `feast init` template: numbers beside Map, Json, Struct and String fields.
driver_stats = FeatureView(
    name="driver_hourly_stats",
    entities=[driver],
    ttl=timedelta(days=1),
    schema=[
        Field(name="conv_rate", dtype=Float32, tags={{"default": "0.25"}}),
        Field(name="acc_rate", dtype=Float32),
        Field(name="avg_daily_trips", dtype=Int64, tags={{"default": "7"}}),
        Field(name="driver_metadata", dtype=Map),
        Field(name="driver_config", dtype=Json),
        Field(name="driver_profile", dtype=Struct({{"name": String, "age": String}})),
        Field(name="driver_name", dtype=String),
    ],
    source=driver_stats_source,
    online=True,
)
merchant_stats = FeatureView(
    name="merchant_stats",
    entities=[merchant],
    ttl=timedelta(days=1),
    schema=[
        Field(name="merchant_risk", dtype=Float64, tags={{"default": "0.1"}}),
        Field(name="merchant_txn_count", dtype=Int64),
        Field(name="merchant_category", dtype=String),
    ],
    source=merchant_source,
    online=True,
)
user_stats = FeatureView(
    name="user_stats",
    entities=[user],
    ttl=timedelta(days=1),
    schema=[Field(name="user_age_days", dtype=Int64, tags={{"default": "365"}}), Field(name="user_score", dtype=Float64)],
    source=user_source,
    online=True,
)
# A compound key: one row per (user, merchant) pair.
user_merchant_stats = FeatureView(
    name="user_merchant_stats",
    entities=[user, merchant],
    ttl=timedelta(days=1),
    schema=[Field(name="pair_txn_count", dtype=Int64), Field(name="pair_amount_sum", dtype=Float32, tags={{"default": "0"}})],
    source=pair_source,
    online=True,
)

input_request = RequestSource(
    name="vals_to_add",
    schema=[Field(name="val_to_add", dtype=Int64), Field(name="val_to_add_2", dtype=Int64)],
)


@on_demand_feature_view(
    sources=[driver_stats, input_request],
    schema=[Field(name="conv_rate_plus_val1", dtype=Float64), Field(name="conv_rate_plus_val2", dtype=Float64)],
    mode="pandas",
    tags={{"default:conv_rate_plus_val1": "-1"}},  # declared defaults of on-demand outputs: view tags
)
def transformed_conv_rate(inputs: pd.DataFrame) -> pd.DataFrame:
    df = pd.DataFrame()
    df["conv_rate_plus_val1"] = inputs["conv_rate"] + inputs["val_to_add"]
    df["conv_rate_plus_val2"] = inputs["conv_rate"] + inputs["val_to_add_2"]
    return df


# Python mode, reading a String beside the numbers. (Feast cannot apply a python-mode view whose
# sources hold a Map: its type inference feeds the transformation None for it and fails.)
@on_demand_feature_view(
    sources=[driver_stats[["avg_daily_trips", "driver_name"]], input_request],
    schema=[Field(name="trips_per_val", dtype=Float64), Field(name="name_length", dtype=Int64)],
    mode="python",
    tags={{"default:name_length": "-2"}},
)
def driver_python(inputs: dict) -> dict:
    return {{
        "trips_per_val": [None if t is None else t / (1 + v) for t, v in zip(inputs["avg_daily_trips"], inputs["val_to_add"])],
        "name_length": [None if s is None else len(s) for s in inputs["driver_name"]],
    }}


@on_demand_feature_view(
    sources=[merchant_stats, user_merchant_stats],
    schema=[Field(name="pair_share", dtype=Float64), Field(name="is_online", dtype=Float64)],
    mode="python",
)
def pair_features(inputs: dict) -> dict:
    n = len(inputs["pair_txn_count"])
    column = lambda key: inputs[key] if isinstance(inputs[key], list) else [inputs[key]] * n
    return {{
        "pair_share": [
            None if p is None or m is None else p / (1 + m) for p, m in zip(inputs["pair_txn_count"], inputs["merchant_txn_count"])
        ],
        "is_online": [None if c is None else float(c == "online") for c in column("merchant_category")],
    }}


@on_demand_feature_view(sources=[input_request], schema=[Field(name="val_sum", dtype=Int64)], mode="python")
def request_only(inputs: dict) -> dict:
    return {{"val_sum": [a + b for a, b in zip(inputs["val_to_add"], inputs["val_to_add_2"])]}}


request_features = FeatureService(name="request_features", features=[request_only])
driver_activity_v1 = FeatureService(
    name="driver_activity_v1",
    features=[driver_stats[["conv_rate", "avg_daily_trips"]], transformed_conv_rate, driver_python],
)
driver_activity_v2 = FeatureService(name="driver_activity_v2", features=[driver_stats, transformed_conv_rate])
merchant_risk = FeatureService(
    name="merchant_risk",
    features=[user_stats, merchant_stats[["merchant_risk", "merchant_txn_count"]], user_merchant_stats, pair_features],
)
'''

DRIVERS = [1001, 1002, 1003, 1004, 1005]
USERS = [1, 2, 3]
MERCHANTS = ["m-alpha", "m-beta", "m-gamma", "m-ünïcode"]


def _write_data(fs, data: Path) -> None:
    now = pd.Timestamp(datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=1))
    rng = np.random.default_rng(8)
    drivers = pd.DataFrame(
        {
            "driver_id": DRIVERS,
            "conv_rate": rng.random(len(DRIVERS)).astype(np.float32),
            "acc_rate": rng.random(len(DRIVERS)).astype(np.float32),
            "avg_daily_trips": rng.integers(10, 1000, len(DRIVERS)),
            "driver_metadata": [{"vehicle": "car", "shift": str(i)} if i % 2 else {"k": "v"} for i in range(len(DRIVERS))],
            "driver_config": [json.dumps({"max_km": 100 + i}) for i in range(len(DRIVERS))],
            "driver_profile": [{"name": f"driver {i}", "age": str(30 + i)} for i in range(len(DRIVERS))],
            "driver_name": [f"driver-{'x' * i}" for i in range(len(DRIVERS))],
            "event_timestamp": now,
        }
    )
    merchants = pd.DataFrame(
        {
            "merchant_id": MERCHANTS,
            "merchant_risk": rng.random(len(MERCHANTS)),
            "merchant_txn_count": rng.integers(0, 5000, len(MERCHANTS)),
            "merchant_category": ["online", "grocery", "online", "travel"],
            "event_timestamp": now,
        }
    )
    users = pd.DataFrame(
        {"user_id": USERS, "user_age_days": rng.integers(1, 3000, len(USERS)), "user_score": rng.random(len(USERS)), "event_timestamp": now}
    )
    pairs = pd.DataFrame(
        [(u, m) for u in USERS for m in MERCHANTS[:3] if (u + len(m)) % 3], columns=["user_id", "merchant_id"]
    ).assign(
        pair_txn_count=lambda d: rng.integers(1, 50, len(d)),
        pair_amount_sum=lambda d: rng.random(len(d)).astype(np.float32) * 500,
        event_timestamp=now,
    )
    # Feast's own write path (as a push would write): Map, Json and Struct values included.
    fs.write_to_online_store("driver_hourly_stats", drivers)
    fs.write_to_online_store("merchant_stats", merchants)
    fs.write_to_online_store("user_stats", users)
    fs.write_to_online_store("user_merchant_stats", pairs)


def _make_repo(root: Path, online_store: str, project: str):
    import feast

    # The offline sources exist (numbers and ids); the online store gets everything below.
    ts = pd.Timestamp("2026-01-01", tz="UTC")
    fs = user_feature_repo(root, DEFINITIONS, online_store, project, {
        "drivers.parquet": pd.DataFrame({"driver_id": DRIVERS, "conv_rate": 0.0, "event_timestamp": ts}),
        "merchants.parquet": pd.DataFrame({"merchant_id": MERCHANTS, "merchant_risk": 0.0, "event_timestamp": ts}),
        "users.parquet": pd.DataFrame({"user_id": USERS, "user_score": 0.0, "event_timestamp": ts}),
        "pairs.parquet": pd.DataFrame({"user_id": USERS, "merchant_id": MERCHANTS[:3], "pair_txn_count": 0, "event_timestamp": ts}),
    })
    _write_data(fs, root / "data")
    return feast.FeatureStore(repo_path=str(root))


REDIS_DB = 11


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    return _make_repo(tmp_path_factory.mktemp("user_repo_sqlite"), "online_store:\n  type: sqlite\n  path: data/online.db\n", "user_repo")


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory, redis_url):
    project = f"user_repo_{uuid.uuid4().hex[:8]}"  # a project of its own on the shared Redis
    host = redis_url.split("//", 1)[1].split("/", 1)[0]
    conn = f"{host},db={REDIS_DB},socket_timeout=2,socket_connect_timeout=1,retry=null"
    fs = _make_repo(tmp_path_factory.mktemp("user_repo_redis"), f'online_store:\n  type: redis\n  connection_string: "{conn}"\n', project)
    yield fs
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}", socket_timeout=5)
    keys = list(client.scan_iter(match=b"*" + project.encode(), count=1000))
    if keys:
        client.delete(*keys)
    client.close()


BACKENDS = [("sqlite", "feast_sync"), ("redis", "direct"), ("redis", "feast_async"), ("redis", "feast_sync")]


def _store(request, online: str):
    return request.getfixturevalue(f"{online}_store")


def _defaults(fetcher: FeatureFetcher, service: str) -> dict[str, float]:
    """Declared defaults of a service's outputs, from the definitions above."""
    declared = {
        "conv_rate": 0.25, "avg_daily_trips": 7.0, "conv_rate_plus_val1": -1.0, "name_length": -2.0,
        "merchant_risk": 0.1, "user_age_days": 365.0, "pair_amount_sum": 0.0,
    }
    return {name: declared.get(name, 0.0) for name in fetcher.feature_names(service)}


def _reference(fs, service: str, rows: list[dict], names, defaults):
    """Feast's own answer: values, with the declared default where Feast has none (None or NaN)."""
    got = fs.get_online_features(features=fs.get_feature_service(service), entity_rows=rows).to_dict()
    absent = np.array([[got[n][i] is None or (isinstance(got[n][i], float) and math.isnan(got[n][i])) for n in names] for i in range(len(rows))])
    values = np.array(
        [[defaults[n] if absent[i, j] else got[n][i] for j, n in enumerate(names)] for i in range(len(rows))], dtype=np.float32
    )
    return values, absent


@pytest.mark.parametrize(("online", "backend"), BACKENDS)
async def test_on_demand_views_with_request_data_equal_feasts(request, online, backend):
    """Pandas and python on-demand views, fed by request data in the entity rows, beside a view that
    also holds Map/Json/Struct/String fields the service does not ask for."""
    fs = _store(request, online)
    rows = [{"driver_id": d, "val_to_add": i, "val_to_add_2": 10 * i} for i, d in enumerate([*DRIVERS, 9999, 1002])]
    async with FeatureFetcher(fs, backend=backend, timeout_s=5.0) as fetcher:
        result = await fetcher.fetch("driver_activity_v1", rows)
        names = fetcher.feature_names("driver_activity_v1")
        assert names == ("conv_rate", "avg_daily_trips", "conv_rate_plus_val1", "conv_rate_plus_val2", "trips_per_val", "name_length")
        assert fetcher.inputs("driver_activity_v1") == {"driver_id": "Int64", "val_to_add": "Int64", "val_to_add_2": "Int64"}
        # Only what the service needs is read: the pandas view's sources include the Map, Json,
        # Struct and String fields (as in Feast's template), read as raw values, never as numbers.
        spec = fetcher.views["driver_hourly_stats"]
        assert spec.features == ("conv_rate", "acc_rate", "avg_daily_trips")
        assert set(spec.raw_features) == {"driver_metadata", "driver_config", "driver_profile", "driver_name"}
        expected, absent = _reference(fs, "driver_activity_v1", rows, names, _defaults(fetcher, "driver_activity_v1"))
    assert not result.degraded, result.reason
    np.testing.assert_allclose(result.values, expected, rtol=1e-6)
    np.testing.assert_array_equal(result.status == FeatureStatus.MISSING, absent)
    assert absent[5].all() and not absent[[0, 1, 2, 3, 4, 6]].any()  # the unknown driver: every output defaulted
    assert (result.status[[0, 1, 2, 3, 4, 6]] == FeatureStatus.PRESENT).all()
    np.testing.assert_array_equal(result.values[5], np.float32([0.25, 7, -1, 0, 0, -2]))
    # The on-demand values really depend on the request data of each row.
    assert result.values[6, 2] == pytest.approx(result.values[1, 0] + 6, rel=1e-6)
    np.testing.assert_array_equal(result.values[:5, 5], [7, 8, 9, 10, 11])  # len() of the String feature


@pytest.mark.parametrize(("online", "backend"), BACKENDS)
async def test_string_and_compound_keys_two_entities_equal_feasts(request, online, backend):
    """A String join key, a compound (user, merchant) key, and a service joining both entities;
    an on-demand view reading a String feature and the compound view."""
    fs = _store(request, online)
    pairs = [(u, m) for u in [*USERS, 77] for m in [*MERCHANTS, "m-unknown"]]
    rows = [{"user_id": u, "merchant_id": m} for u, m in pairs]
    async with FeatureFetcher(fs, backend=backend, timeout_s=5.0) as fetcher:
        assert fetcher.inputs("merchant_risk") == {"user_id": "Int64", "merchant_id": "String"}
        result = await fetcher.fetch("merchant_risk", rows)
        columns = await fetcher.fetch("merchant_risk", {"user_id": [u for u, _ in pairs], "merchant_id": [m for _, m in pairs]})
        names = fetcher.feature_names("merchant_risk")
        expected, absent = _reference(fs, "merchant_risk", rows, names, _defaults(fetcher, "merchant_risk"))
    assert names == ("user_age_days", "user_score", "merchant_risk", "merchant_txn_count", "pair_txn_count", "pair_amount_sum", "pair_share", "is_online")
    assert not result.degraded, result.reason
    np.testing.assert_allclose(result.values, expected, rtol=1e-6)
    np.testing.assert_array_equal(result.status == FeatureStatus.MISSING, absent)
    np.testing.assert_array_equal(columns.values, result.values)
    # Known and unknown entities of each key are both in the sample.
    assert 0 < absent[:, names.index("pair_txn_count")].sum() < len(rows)
    assert absent[[i for i, (u, _) in enumerate(pairs) if u == 77], names.index("user_score")].all()
    assert absent[[i for i, (_, m) in enumerate(pairs) if m == "m-unknown"], names.index("merchant_risk")].all()
    assert not absent[[i for i, (_, m) in enumerate(pairs) if m == "m-ünïcode"], names.index("merchant_risk")].any()
    online_rows = [i for i, (_, m) in enumerate(pairs) if m in ("m-alpha", "m-gamma")]
    assert (result.values[online_rows, names.index("is_online")] == 1).all()


@pytest.mark.parametrize(("online", "backend"), BACKENDS)
async def test_non_numeric_service_is_refused_by_name_others_served(request, online, backend):
    fs = _store(request, online)
    async with FeatureFetcher(fs, backend=backend, timeout_s=5.0) as fetcher:
        assert "driver_activity_v2" not in fetcher.services and "driver_activity_v2" in fetcher.refused
        with pytest.raises(FeatureServiceError) as err:
            await fetcher.fetch("driver_activity_v2", [{"driver_id": 1001, "val_to_add": 1, "val_to_add_2": 2}])
        message = str(err.value)
        assert "driver_activity_v2" in message and "driver_hourly_stats:driver_metadata" in message and "type Map" in message
        # The other services are served, from the same views.
        ok = await fetcher.fetch("driver_activity_v1", [{"driver_id": 1001, "val_to_add": 1, "val_to_add_2": 2}])
        assert not ok.degraded and (ok.status == FeatureStatus.PRESENT).all()
    with pytest.raises(FeatureServiceError, match="driver_activity_v2.*type Map"):
        FeatureFetcher(fs, backend=backend, services=["driver_activity_v2"])
    only = FeatureFetcher(fs, backend=backend, services=["merchant_risk"])
    assert only.services == ("merchant_risk",) and "driver_hourly_stats" not in only.views


@pytest.mark.parametrize(("online", "backend"), [("sqlite", "auto"), ("redis", "auto"), ("redis", "direct")])
async def test_a_service_of_request_data_only(request, online, backend):
    """An on-demand view of request data alone: nothing to read from the store, still computed."""
    fs = _store(request, online)
    rows = [{"val_to_add": 2, "val_to_add_2": 40}, {"val_to_add": -5, "val_to_add_2": 1}]
    async with FeatureFetcher(fs, backend=backend, timeout_s=5.0, services=["request_features"]) as fetcher:
        result = await fetcher.fetch("request_features", rows)
    expected, absent = _reference(fs, "request_features", rows, ("val_sum",), {"val_sum": 0.0})
    np.testing.assert_array_equal(result.values, expected)
    np.testing.assert_array_equal(result.values[:, 0], [42, -4])
    assert not absent.any() and (result.status == FeatureStatus.PRESENT).all() and result.timings.store_s == 0.0


@pytest.mark.parametrize(
    ("rows", "field"),
    [
        ([{"driver_id": 1001, "val_to_add": 1}], r"entity_rows\[0\].val_to_add_2"),
        ([{"driver_id": 1001, "val_to_add": "1", "val_to_add_2": 2}], r"entity_rows\[0\].val_to_add"),
        ([{"driver_id": "1001", "val_to_add": 1, "val_to_add_2": 2}], r"entity_rows\[0\].driver_id"),
        ({"driver_id": [1001, 1002], "val_to_add": 1, "val_to_add_2": 1.5}, "entity_rows.val_to_add_2"),
        ([{"driver_id": 1001, "val_to_add": 1, "val_to_add_2": 2, "tip": 3}], r"entity_rows\[0\].tip"),
    ],
)
async def test_bad_request_data_names_the_field(sqlite_store, rows, field):
    async with FeatureFetcher(sqlite_store, timeout_s=5.0) as fetcher:
        with pytest.raises(InputValidationError, match=field) as err:
            await fetcher.fetch("driver_activity_v1", rows)
    # One error type, caught by the fetch layer's and the request paths' handlers alike.
    assert isinstance(err.value, FeatureError) and isinstance(err.value, RequestValidationError)


async def test_string_key_must_be_a_string(sqlite_store):
    async with FeatureFetcher(sqlite_store, timeout_s=5.0) as fetcher:
        with pytest.raises(InputValidationError, match=r"entity_rows\[0\].merchant_id: must be a string id"):
            await fetcher.fetch("merchant_risk", [{"user_id": 1, "merchant_id": 5}])


async def test_store_down_on_demand_outputs_are_defaulted_not_computed(tmp_path, private_redis):
    """With the store unreachable the on-demand outputs get their defaults and the `defaulted` status."""
    project = "user_repo_down"
    conn = f"127.0.0.1:{private_redis.port},db=0,socket_timeout=1,socket_connect_timeout=0.5,retry=null"
    fs = _make_repo(tmp_path / "repo", f'online_store:\n  type: redis\n  connection_string: "{conn}"\n', project)
    async with FeatureFetcher(fs, backend="direct", timeout_s=0.5, breaker_failures=100) as fetcher:
        private_redis.stop()
        result = await fetcher.fetch("driver_activity_v1", [{"driver_id": 1001, "val_to_add": 1, "val_to_add_2": 2}])
    assert result.degraded and (result.status == FeatureStatus.DEFAULTED).all()
    np.testing.assert_array_equal(result.values[0], np.float32([0.25, 7, -1, 0, 0, -2]))


async def test_auto_verifies_the_direct_reader_per_service(redis_store):
    """`auto` keeps the direct reader (fastest) only after it read what Feast reads, at start, for
    entities sampled from the store: String, compound and Int64 keys alike."""
    async with FeatureFetcher(redis_store, timeout_s=5.0) as fetcher:
        for service in ("driver_activity_v1", "merchant_risk"):
            assert fetcher.backend_of(service) == "direct", fetcher.backend_reason(service)
            reason = fetcher.backend_reason(service)
            assert "read what Feast reads" in reason
            sampled = int(reason.split("for ")[-1].split(" ")[0])
            assert sampled > len(fetcher._plans[service].views)  # real entities, not only the probes
        result = await fetcher.fetch("merchant_risk", [{"user_id": 1, "merchant_id": "m-beta"}])
        assert not result.degraded


async def test_auto_falls_back_when_the_direct_reader_differs(redis_store, monkeypatch):
    """A direct reader that misreads (simulated: a layout change in a future Feast cannot be produced
    here for real, so its decoder is patched to return wrong numbers) is replaced by Feast's reads."""
    from scorestack.features import redis_layout

    real = redis_layout.decode_values

    def wrong(cells):
        values, found = real(cells)
        return values + 1.0, found

    monkeypatch.setattr(redis_layout, "decode_values", wrong)
    rows = [{"driver_id": 1001, "val_to_add": 1, "val_to_add_2": 2}]
    async with FeatureFetcher(redis_store, timeout_s=5.0) as fetcher:
        assert fetcher.backend_of("driver_activity_v1") == "feast_async"
        assert "differed from Feast" in fetcher.backend_reason("driver_activity_v1")
        result = await fetcher.fetch("driver_activity_v1", rows)
        names = fetcher.feature_names("driver_activity_v1")
        expected, _ = _reference(redis_store, "driver_activity_v1", rows, names, _defaults(fetcher, "driver_activity_v1"))
    np.testing.assert_allclose(result.values, expected, rtol=1e-6)


def test_features_get_command_on_a_user_repository(sqlite_store):
    """`scorestack features get` reads any service of any repository, request data included."""
    from typer.testing import CliRunner

    from scorestack.cli.features import features_app

    args = ["get", "driver_activity_v1", "--repo-dir", sqlite_store.repo_path, "--timeout-ms", "5000"]
    rows = ["--row", "driver_id=1001", "--row", "driver_id=9999", "--row", "val_to_add=3", "--row", "val_to_add_2=4"]
    result = CliRunner().invoke(features_app, [*args, *rows])
    assert result.exit_code == 0, result.output
    assert "2 row(s), degraded=False" in result.output
    assert "[0] conv_rate_plus_val1" in result.output and "[1] conv_rate_plus_val1" in result.output
    assert "missing" in result.output and "present" in result.output
    refused = CliRunner().invoke(features_app, ["get", "driver_activity_v2", "--repo-dir", sqlite_store.repo_path, "--row", "driver_id=1"])
    assert refused.exit_code == 1 and "type Map" in refused.output
