"""Synthetic, self-consistent demo data: users, items, fraud transactions and ranking queries.

The feature store materializes the user and item tables; the compiler trains on transactions and
queries joined to the same tables, so a served score can be checked against the source model.
"""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pandas as pd

from scorestack import schema

DEMO_EPOCH = datetime(2026, 11, 1, tzinfo=timezone.utc)


def make_users(n_users: int = 5000, seed: int = 7) -> pd.DataFrame:
    """One row per user with every user-keyed feature (fraud profile, velocity, ranking profile)."""
    rng = np.random.default_rng(seed)
    n = n_users
    age = rng.gamma(2.0, 400.0, n)
    avg_amt = rng.lognormal(3.8, 0.7, n)
    cols: dict[str, np.ndarray] = {
        "user_account_age_days": age,
        "user_avg_amount_30d": avg_amt,
        "user_std_amount_30d": avg_amt * rng.uniform(0.2, 1.2, n),
        "user_txn_count_30d": rng.poisson(25, n).astype(float),
        "user_chargeback_count_90d": rng.poisson(0.05, n).astype(float),
        "user_distinct_merchants_30d": rng.poisson(9, n).astype(float),
        "user_distinct_countries_30d": 1.0 + rng.poisson(0.2, n),
        "user_avg_txn_hour": np.clip(rng.normal(14, 3, n), 0, 23),
        "user_pct_night_txn_30d": rng.beta(1.2, 12, n),
        "user_pct_online_30d": rng.beta(2, 3, n),
        "user_credit_limit": np.round(rng.lognormal(8.3, 0.6, n), -2),
        "user_prev_risk_score": rng.beta(1.1, 20, n),
        "txn_count_1h": rng.poisson(0.3, n).astype(float),
        "txn_count_24h": rng.poisson(2.0, n).astype(float),
        "amount_sum_1h": rng.exponential(20, n),
        "amount_sum_24h": rng.exponential(120, n),
        "failed_txn_count_24h": rng.poisson(0.1, n).astype(float),
        "distinct_cards_24h": 1.0 + rng.poisson(0.05, n),
        "user_tenure_days": age,
        "user_sessions_7d": rng.poisson(6, n).astype(float),
        "user_clicks_7d": rng.poisson(30, n).astype(float),
        "user_purchases_30d": rng.poisson(2, n).astype(float),
        "user_avg_order_value": rng.lognormal(3.9, 0.5, n),
        "user_ctr_30d": rng.beta(2, 25, n),
        "user_pref_price_level": rng.integers(1, 6, n).astype(float),
    }
    prefs = rng.dirichlet([1.0, 1.0, 1.0], n)
    cols["user_pref_electronics"] = prefs[:, 0]
    cols["user_pref_fashion"] = prefs[:, 1]
    cols["user_pref_home"] = prefs[:, 2]
    df = pd.DataFrame({k: v.astype(np.float32) for k, v in cols.items()})
    df.insert(0, "user_id", np.arange(1, n + 1, dtype=np.int64))
    df["event_timestamp"] = DEMO_EPOCH + pd.to_timedelta(rng.integers(0, 3600, n), unit="s")
    return df


def make_items(n_items: int = 2000, seed: int = 11) -> pd.DataFrame:
    """One row per catalogue item with every item-keyed ranking feature."""
    rng = np.random.default_rng(seed)
    n = n_items
    price = rng.lognormal(3.5, 1.0, n)
    cat = rng.integers(0, 4, n)
    views = rng.poisson(rng.lognormal(5, 1, n)).astype(float)
    ctr7 = rng.beta(2, 30, n)
    cols: dict[str, np.ndarray] = {
        "item_price": price,
        "item_price_level": np.clip(np.digitize(price, [15, 30, 60, 120]) + 1, 1, 5).astype(float),
        "item_is_electronics": (cat == 0).astype(float),
        "item_is_fashion": (cat == 1).astype(float),
        "item_is_home": (cat == 2).astype(float),
        "item_is_other": (cat == 3).astype(float),
        "item_age_days": rng.exponential(200, n),
        "item_rating": np.clip(rng.normal(4.0, 0.6, n), 1, 5),
        "item_rating_count": rng.poisson(rng.lognormal(3, 1.2, n)).astype(float),
        "item_ctr_7d": ctr7,
        "item_ctr_30d": np.clip(ctr7 + rng.normal(0, 0.01, n), 0, 1),
        "item_views_7d": views,
        "item_purchases_7d": rng.binomial(views.astype(np.int64), 0.02).astype(float),
        "item_conversion_30d": rng.beta(1.5, 60, n),
        "item_return_rate": rng.beta(1.2, 15, n),
        "item_stock_level": rng.poisson(40, n).astype(float),
        "item_discount_pct": rng.choice([0, 0, 0, 5, 10, 20, 30], n).astype(float),
        "item_shipping_days": rng.integers(1, 8, n).astype(float),
        "item_popularity_rank": rng.permutation(n).astype(float) + 1,
        "item_seller_rating": np.clip(rng.normal(4.3, 0.4, n), 1, 5),
        "item_image_count": rng.integers(1, 12, n).astype(float),
        "item_desc_length": rng.poisson(400, n).astype(float),
        "item_is_new": (rng.random(n) < 0.1).astype(float),
        "item_is_promoted": (rng.random(n) < 0.05).astype(float),
    }
    df = pd.DataFrame({k: v.astype(np.float32) for k, v in cols.items()})
    df.insert(0, "item_id", np.arange(1, n + 1, dtype=np.int64))
    df["event_timestamp"] = DEMO_EPOCH + pd.to_timedelta(rng.integers(0, 3600, n), unit="s")
    return df


def make_fraud_requests(n: int, seed: int = 13) -> pd.DataFrame:
    """Request-time transaction fields (the part of a fraud request not in the feature store)."""
    rng = np.random.default_rng(seed)
    cols = {
        "amount": rng.lognormal(3.8, 1.0, n),
        "hour_of_day": rng.integers(0, 24, n).astype(float),
        "day_of_week": rng.integers(0, 7, n).astype(float),
        "is_online": (rng.random(n) < 0.45).astype(float),
        "is_international": (rng.random(n) < 0.08).astype(float),
        "merchant_category": rng.integers(0, 20, n).astype(float),
        "merchant_risk": rng.beta(1.5, 12, n),
        "device_trust_score": rng.beta(6, 2, n),
        "ip_risk_score": rng.beta(1.2, 10, n),
        "distance_from_home_km": rng.exponential(25, n),
        "card_present": (rng.random(n) < 0.5).astype(float),
        "is_new_device": (rng.random(n) < 0.07).astype(float),
    }
    return pd.DataFrame({k: v.astype(np.float32) for k, v in cols.items()})


def make_fraud_dataset(users: pd.DataFrame, n: int = 60000, seed: int = 17) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Transactions joined to user features: (X float32 in FRAUD_FEATURES order, y int, user_ids).

    About 1.5% positives, driven by a nonlinear mix of amount anomalies, velocity and risk scores.
    """
    rng = np.random.default_rng(seed)
    user_idx = rng.integers(0, len(users), n)
    req = make_fraud_requests(n, seed + 1)
    u = users.iloc[user_idx].reset_index(drop=True)
    frame = pd.concat([u[list(schema.FRAUD_USER_PROFILE + schema.FRAUD_USER_VELOCITY)], req], axis=1)
    X = frame[list(schema.FRAUD_FEATURES)].to_numpy(np.float32)
    f = frame
    ratio = f["amount"] / (f["user_avg_amount_30d"] + 1.0)
    logit = (
        -5.5
        + 1.1 * np.log1p(ratio)
        + 0.6 * f["txn_count_1h"]
        + 0.9 * f["failed_txn_count_24h"]
        + 3.0 * f["ip_risk_score"]
        - 2.0 * f["device_trust_score"]
        + 1.2 * f["is_new_device"] * f["is_online"]
        + 0.8 * f["is_international"]
        + 4.0 * f["merchant_risk"]
        + 5.0 * f["user_prev_risk_score"]
        + 0.9 * f["user_chargeback_count_90d"]
        + 0.6 * (f["distinct_cards_24h"] - 1)
        + 0.01 * f["distance_from_home_km"] * (1 - f["card_present"])
        - 0.0008 * f["user_account_age_days"]
        + 0.8 * ((f["hour_of_day"] < 5) & (f["user_pct_night_txn_30d"] < 0.1))
    )
    p = 1.0 / (1.0 + np.exp(-logit.to_numpy()))
    y = (rng.random(n) < p).astype(np.int64)
    return X, y, users["user_id"].to_numpy()[user_idx]


def make_ranking_context(n: int, seed: int = 19) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    cols = {
        "ctx_hour": rng.integers(0, 24, n).astype(float),
        "ctx_is_mobile": (rng.random(n) < 0.6).astype(float),
        "ctx_is_weekend": (rng.random(n) < 0.28).astype(float),
        "ctx_session_depth": rng.poisson(3, n).astype(float),
        "ctx_query_length": rng.poisson(3, n).astype(float),
        "ctx_from_search": (rng.random(n) < 0.5).astype(float),
    }
    return pd.DataFrame({k: v.astype(np.float32) for k, v in cols.items()})


def make_ranking_dataset(
    users: pd.DataFrame, items: pd.DataFrame, n_queries: int = 3000, group_size: int = 30, seed: int = 23
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query groups of candidate items: (X float32 in RANKING_FEATURES order, relevance 0-4, group sizes)."""
    rng = np.random.default_rng(seed)
    n = n_queries * group_size
    uidx = np.repeat(rng.integers(0, len(users), n_queries), group_size)
    iidx = rng.integers(0, len(items), n)
    ctx = make_ranking_context(n_queries, seed + 1).iloc[np.repeat(np.arange(n_queries), group_size)]
    u = users.iloc[uidx].reset_index(drop=True)[list(schema.RANKING_USER)]
    it = items.iloc[iidx].reset_index(drop=True)[list(schema.RANKING_ITEM)]
    frame = pd.concat([u, it, ctx.reset_index(drop=True)], axis=1)
    X = frame[list(schema.RANKING_FEATURES)].to_numpy(np.float32)
    f = frame
    affinity = (
        f["user_pref_electronics"] * f["item_is_electronics"]
        + f["user_pref_fashion"] * f["item_is_fashion"]
        + f["user_pref_home"] * f["item_is_home"]
    )
    util = (
        3.0 * affinity
        + 25.0 * f["item_ctr_7d"]
        + 0.6 * (f["item_rating"] - 4.0)
        - 0.4 * np.abs(f["item_price_level"] - f["user_pref_price_level"])
        + 0.02 * f["item_discount_pct"]
        + 0.5 * f["item_is_promoted"] * f["ctx_from_search"]
        - 3.0 * f["item_return_rate"]
        + rng.normal(0, 0.5, n)
    )
    rel = np.clip(np.floor((util - util.mean()) / util.std() * 1.2 + 1.5), 0, 4).astype(np.int64)
    return X, rel.to_numpy() if hasattr(rel, "to_numpy") else rel, np.full(n_queries, group_size)
