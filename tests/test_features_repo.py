"""The working feature repository: generated, applied and materialized the way a user does it."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from scorestack import schema
from scorestack.demo import data as demo_data
from scorestack.errors import FeatureError
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.cli.features import features_app
from scorestack.features.repo import definitions


@pytest.fixture(scope="module")
def sqlite_repo(tmp_path_factory) -> Path:
    repo = demo_features.init_repo(tmp_path_factory.mktemp("repo") / "feature_repo", n_users=200, n_items=100)
    store.apply(repo)
    store.materialize(repo)
    return repo


def test_declarations_match_the_models_inputs():
    assert [f.name for f in definitions.fraud.feature_view_projections[0].features] == list(schema.FRAUD_USER_PROFILE)
    assert [f.name for f in definitions.fraud.feature_view_projections[1].features] == list(schema.FRAUD_USER_VELOCITY)
    assert [f.name for f in definitions.ranking.feature_view_projections[0].features] == list(schema.RANKING_USER)
    assert [f.name for f in definitions.ranking.feature_view_projections[1].features] == list(schema.RANKING_ITEM)
    for view in (definitions.user_fraud_profile, definitions.user_txn_velocity, definitions.user_ranking_profile, definitions.item_stats):
        assert all("default" in f.tags for f in view.features), view.name
    assert float(definitions.user_txn_velocity.tags["cache_ttl_s"]) <= 1.0  # fast counters stay fresh
    assert definitions.user_txn_velocity.ttl < definitions.user_fraud_profile.ttl


def test_registry_holds_the_services_in_model_order(sqlite_repo):
    fs = store.feature_store(sqlite_repo)
    fraud = fs.get_feature_service("fraud")
    names = [f.name for p in fraud.feature_view_projections for f in p.features]
    assert names == list(schema.FRAUD_USER_PROFILE + schema.FRAUD_USER_VELOCITY)
    ranking = fs.get_feature_service("ranking")
    names = [f.name for p in ranking.feature_view_projections for f in p.features]
    assert names == list(schema.RANKING_USER + schema.RANKING_ITEM)
    assert fs.get_feature_view("user_txn_velocity").ttl == timedelta(hours=1)


def test_materialized_values_are_the_demo_data(sqlite_repo):
    fs = store.feature_store(sqlite_repo)
    users = demo_data.make_users(200)
    got = fs.get_online_features(features=fs.get_feature_service("fraud"), entity_rows=[{"user_id": 17}, {"user_id": 200}]).to_dict()
    for name in schema.FRAUD_USER_PROFILE + schema.FRAUD_USER_VELOCITY:
        np.testing.assert_array_equal(np.float32(got[name]), users.set_index("user_id").loc[[17, 200], name].to_numpy())


def test_event_times_are_recent(sqlite_repo):
    import pandas as pd

    ts = pd.read_parquet(sqlite_repo / "data" / "users.parquet")["event_timestamp"]
    now = datetime.now(timezone.utc)
    assert (ts <= now).all() and (ts > now - timedelta(minutes=15)).all()


def test_redis_config_bounds_every_call(tmp_path):
    repo = demo_features.init_repo(tmp_path / "r", online="redis", redis_url="redis://:s3cret@10.0.0.5:6380/4", n_users=10, n_items=10)
    config = yaml.safe_load((repo / "feature_store.yaml").read_text())
    conn = config["online_store"]["connection_string"]
    assert conn.startswith("10.0.0.5:6380,db=4,password=s3cret,")
    assert "socket_timeout=" in conn and "socket_connect_timeout=" in conn and "retry=null" in conn
    from feast.infra.online_stores.redis import RedisOnlineStore

    _, params = RedisOnlineStore._parse_connection_string(conn)
    assert params["retry"] is None and params["socket_timeout"] > 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"online": "postgres"}, "online"),
        ({"online": "redis", "redis_url": "http://x"}, "redis_url"),
        ({"n_users": 0}, "n_users"),
        ({"project": "bad-name"}, "project"),
    ],
)
def test_invalid_repo_settings_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(FeatureError, match=field):
        demo_features.init_repo(tmp_path / "r", **kwargs)


def test_feature_store_without_repo_says_how_to_create_it(tmp_path):
    with pytest.raises(FeatureError, match="scorestack features apply"):
        store.feature_store(tmp_path / "nothing")


def test_feast_cli_works_on_the_generated_repository(tmp_path):
    repo = demo_features.init_repo(tmp_path / "cli_repo", n_users=50, n_items=20)
    feast = Path(sys.executable).with_name("feast")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([str(feast), "apply"], cwd=repo, check=True, capture_output=True, env=env, timeout=120)
    end = (datetime.now(timezone.utc) + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")
    subprocess.run([str(feast), "materialize", "2000-01-01T00:00:00", end], cwd=repo, check=True, capture_output=True, env=env, timeout=120)
    fs = store.feature_store(repo)
    got = fs.get_online_features(features=["item_stats:item_price"], entity_rows=[{"item_id": 20}]).to_dict()
    assert np.float32(got["item_price"][0]) == demo_data.make_items(20)["item_price"].iloc[19]


def test_scorestack_features_cli(tmp_path):
    runner = CliRunner()
    repo = tmp_path / "cli"
    result = runner.invoke(features_app, ["apply", "--repo-dir", str(repo), "--users", "30", "--items", "20"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(features_app, ["materialize", "--repo-dir", str(repo), "--restamp"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(features_app, ["get", "ranking", "--user-id", "3", "--item-id", "5", "--repo-dir", str(repo), "--timeout-ms", "2000"])
    assert result.exit_code == 0, result.output
    assert "degraded=False" in result.output and "item_price" in result.output and "present" in result.output
    result = runner.invoke(features_app, ["get", "nope", "--user-id", "3", "--repo-dir", str(repo)])
    assert result.exit_code == 1 and "service" in result.output
