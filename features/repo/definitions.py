"""Feast declarations for scorestack: entities, parquet sources, feature views and feature services.

`scorestack.features.store.write_repo` copies this module into a working feature repository beside
its `data/` folder; `feast apply` reads it from there. Each view carries its fetch policy as Feast
tags (`cache_ttl_s` on the view, `default` on every field), so one declaration serves
materialization, the fast reader and the tests.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource, ValueType
from feast.types import Float32

from scorestack import schema

# Parquet sources lie in data/ beside this file (in the working repository, not in the package).
DATA_DIR = Path(__file__).resolve().parent / "data"

# How long a stored value stays valid (Feast ttl; older reads are reported `stale`) and how long the
# in-process cache of the fetch layer may keep it (0: never cached; fast counters must stay fresh).
VIEW_TTL = {
    "user_fraud_profile": timedelta(days=2),
    "user_txn_velocity": timedelta(hours=1),
    "user_ranking_profile": timedelta(days=2),
    "item_stats": timedelta(days=2),
}
CACHE_TTL_S = {
    "user_fraud_profile": 60.0,
    "user_txn_velocity": 0.0,
    "user_ranking_profile": 60.0,
    "item_stats": 60.0,
}

# Declared defaults: what a model receives when the store has no value or cannot be read in time.
# Medians of the demo population (scorestack.demo.data), rounded; counts of rare events are 0.
DEFAULTS = {
    # user_fraud_profile
    "user_account_age_days": 662.0,
    "user_avg_amount_30d": 44.6,
    "user_std_amount_30d": 28.7,
    "user_txn_count_30d": 25.0,
    "user_chargeback_count_90d": 0.0,
    "user_distinct_merchants_30d": 9.0,
    "user_distinct_countries_30d": 1.0,
    "user_avg_txn_hour": 14.0,
    "user_pct_night_txn_30d": 0.071,
    "user_pct_online_30d": 0.386,
    "user_credit_limit": 4000.0,
    "user_prev_risk_score": 0.039,
    # user_txn_velocity
    "txn_count_1h": 0.0,
    "txn_count_24h": 2.0,
    "amount_sum_1h": 13.8,
    "amount_sum_24h": 83.1,
    "failed_txn_count_24h": 0.0,
    "distinct_cards_24h": 1.0,
    # user_ranking_profile
    "user_tenure_days": 662.0,
    "user_sessions_7d": 6.0,
    "user_clicks_7d": 30.0,
    "user_purchases_30d": 2.0,
    "user_avg_order_value": 49.0,
    "user_ctr_30d": 0.0629,
    "user_pref_price_level": 3.0,
    "user_pref_electronics": 0.333,
    "user_pref_fashion": 0.333,
    "user_pref_home": 0.333,
    # item_stats
    "item_price": 33.9,
    "item_price_level": 3.0,
    "item_is_electronics": 0.0,
    "item_is_fashion": 0.0,
    "item_is_home": 0.0,
    "item_is_other": 0.0,
    "item_age_days": 138.0,
    "item_rating": 4.02,
    "item_rating_count": 21.0,
    "item_ctr_7d": 0.054,
    "item_ctr_30d": 0.0541,
    "item_views_7d": 145.0,
    "item_purchases_7d": 3.0,
    "item_conversion_30d": 0.0192,
    "item_return_rate": 0.0592,
    "item_stock_level": 40.0,
    "item_discount_pct": 5.0,
    "item_shipping_days": 4.0,
    "item_popularity_rank": 1000.0,
    "item_seller_rating": 4.31,
    "item_image_count": 6.0,
    "item_desc_length": 400.0,
    "item_is_new": 0.0,
    "item_is_promoted": 0.0,
}

user = Entity(
    name="user",
    join_keys=[schema.ENTITY_KEYS["user"]],
    value_type=ValueType.INT64,
    description="A card holder (fraud) and a shopper (ranking).",
)
item = Entity(
    name="item",
    join_keys=[schema.ENTITY_KEYS["item"]],
    value_type=ValueType.INT64,
    description="A catalogue item.",
)
_ENTITIES = {"user": user, "item": item}

users_source = FileSource(
    name="users_source",
    path=str(DATA_DIR / "users.parquet"),
    timestamp_field="event_timestamp",
)
items_source = FileSource(
    name="items_source",
    path=str(DATA_DIR / "items.parquet"),
    timestamp_field="event_timestamp",
)
_SOURCES = {"user": users_source, "item": items_source}

# The fraud path writes the velocity counters back after each scored transaction (Feast's push API,
# scorestack.features.push); materialization still reads the parquet batch source.
user_txn_velocity_push = PushSource(name="user_txn_velocity_push", batch_source=users_source)
PUSH_SOURCES = {"user_txn_velocity": user_txn_velocity_push}


# Exact windowed counters (scorestack.features.velocity): feature -> (window s, bucket s, the event
# field added, "" for a count). Each scored transaction adds itself atomically to the bucket of its
# time; a fetcher built with `windows=True` reads the sum of the window's buckets in the same round
# trip as the rest of the view. Feast's own reads return the row last stored (materialized from
# the batch source or pushed by a stream processor), not the live sums.
WINDOWS = {
    "txn_count_1h": (3600, 300, ""),
    "amount_sum_1h": (3600, 300, "amount"),
    "txn_count_24h": (86400, 3600, ""),
    "amount_sum_24h": (86400, 3600, "amount"),
}


def _tags(feature: str) -> dict[str, str]:
    tags = {"default": repr(DEFAULTS[feature])}
    if feature in WINDOWS:
        window_s, bucket_s, source = WINDOWS[feature]
        tags.update(window_s=str(window_s), bucket_s=str(bucket_s), window_source=source)
    return tags


def _view(name: str) -> FeatureView:
    entity, features = schema.FEATURE_VIEWS[name]
    return FeatureView(
        name=name,
        entities=[_ENTITIES[entity]],
        ttl=VIEW_TTL[name],
        schema=[Field(name=f, dtype=Float32, tags=_tags(f)) for f in features],
        source=PUSH_SOURCES.get(name, _SOURCES[entity]),
        online=True,
        tags={"cache_ttl_s": repr(CACHE_TTL_S[name])},
    )


user_fraud_profile = _view("user_fraud_profile")
user_txn_velocity = _view("user_txn_velocity")
user_ranking_profile = _view("user_ranking_profile")
item_stats = _view("item_stats")

# Feature order of a service = the model's input order for its store-backed features.
fraud = FeatureService(
    name="fraud",
    features=[user_fraud_profile, user_txn_velocity],
    description="Store-backed inputs of the fraud model: FRAUD_USER_PROFILE + FRAUD_USER_VELOCITY.",
)
ranking = FeatureService(
    name="ranking",
    features=[user_ranking_profile, item_stats],
    description="Store-backed inputs of the ranking model: RANKING_USER + RANKING_ITEM.",
)
