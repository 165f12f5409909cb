"""Feature names and tensor names shared by the fraud, ranking and vision models, the feature store and the clients.

One name per idea: the model spec's input features, Feast's feature names and the request fields
all use these strings, in this order.
"""

from __future__ import annotations

# --- Triton tensor contract written by the compiler and used by the clients -----------------
INPUT_TENSOR = "features"  # FP32 [batch, n_features], columns in the spec's feature order
# Image models: raw UINT8 pixels [batch, H, W, C] (or [batch, C, H, W], as the spec declares);
# scaling, normalization and layout are folded into the served graph.
IMAGE_INPUT_TENSOR = "images"
OUTPUT_TENSORS = {
    "binary": "probability",  # FP32 [batch, 1]: probability of the positive class
    "multiclass": "probabilities",  # FP32 [batch, n_classes]
    "regression": "prediction",  # FP32 [batch, 1]
    "ranking": "score",  # FP32 [batch, 1]: higher ranks first
    "image-classification": "probabilities",  # FP32 [batch, n_classes]: softmax over the classes
}


def input_tensor(task: str) -> str:
    """The input tensor's name for a task."""
    return IMAGE_INPUT_TENSOR if task == "image-classification" else INPUT_TENSOR

# --- Fraud -----------------------------------------------------------------------------------
# Slow-moving per-user profile (Feast view `user_fraud_profile`, cacheable).
FRAUD_USER_PROFILE = (
    "user_account_age_days",
    "user_avg_amount_30d",
    "user_std_amount_30d",
    "user_txn_count_30d",
    "user_chargeback_count_90d",
    "user_distinct_merchants_30d",
    "user_distinct_countries_30d",
    "user_avg_txn_hour",
    "user_pct_night_txn_30d",
    "user_pct_online_30d",
    "user_credit_limit",
    "user_prev_risk_score",
)
# Fast-moving per-user counters (Feast view `user_txn_velocity`, never cached for long).
FRAUD_USER_VELOCITY = (
    "txn_count_1h",
    "txn_count_24h",
    "amount_sum_1h",
    "amount_sum_24h",
    "failed_txn_count_24h",
    "distinct_cards_24h",
)
# Sent with the request (the transaction itself).
FRAUD_REQUEST = (
    "amount",
    "hour_of_day",
    "day_of_week",
    "is_online",
    "is_international",
    "merchant_category",
    "merchant_risk",
    "device_trust_score",
    "ip_risk_score",
    "distance_from_home_km",
    "card_present",
    "is_new_device",
)
FRAUD_FEATURES = FRAUD_USER_PROFILE + FRAUD_USER_VELOCITY + FRAUD_REQUEST  # 30, model order

# --- Ranking ---------------------------------------------------------------------------------
RANKING_USER = (  # Feast view `user_ranking_profile`
    "user_tenure_days",
    "user_sessions_7d",
    "user_clicks_7d",
    "user_purchases_30d",
    "user_avg_order_value",
    "user_ctr_30d",
    "user_pref_price_level",
    "user_pref_electronics",
    "user_pref_fashion",
    "user_pref_home",
)
RANKING_ITEM = (  # Feast view `item_stats`
    "item_price",
    "item_price_level",
    "item_is_electronics",
    "item_is_fashion",
    "item_is_home",
    "item_is_other",
    "item_age_days",
    "item_rating",
    "item_rating_count",
    "item_ctr_7d",
    "item_ctr_30d",
    "item_views_7d",
    "item_purchases_7d",
    "item_conversion_30d",
    "item_return_rate",
    "item_stock_level",
    "item_discount_pct",
    "item_shipping_days",
    "item_popularity_rank",
    "item_seller_rating",
    "item_image_count",
    "item_desc_length",
    "item_is_new",
    "item_is_promoted",
)
RANKING_REQUEST = (  # the request context
    "ctx_hour",
    "ctx_is_mobile",
    "ctx_is_weekend",
    "ctx_session_depth",
    "ctx_query_length",
    "ctx_from_search",
)
RANKING_FEATURES = RANKING_USER + RANKING_ITEM + RANKING_REQUEST  # 40, model order

# Feast feature views: name -> (entity, features)
FEATURE_VIEWS = {
    "user_fraud_profile": ("user", FRAUD_USER_PROFILE),
    "user_txn_velocity": ("user", FRAUD_USER_VELOCITY),
    "user_ranking_profile": ("user", RANKING_USER),
    "item_stats": ("item", RANKING_ITEM),
}
ENTITY_KEYS = {"user": "user_id", "item": "item_id"}
